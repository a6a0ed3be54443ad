"""The machine's identity on disk: its keys and its control-plane link record.

Layout inside the data folder (folders 0700, files 0600)::

    keys/signing.key   Ed25519 signing key, PKCS#8 PEM
    keys/box.key       X25519 box key (shared.crypto text form, ``agsk1_...``):
                       prompts for a stopped workspace are sealed to it
    keys/tls.key       ECDSA P-256 TLS client key, PKCS#8 PEM
    keys/tls.crt       the client certificate the control plane issued, PEM
    keys/ca.crt        the control plane CA certificate (the pinned one), PEM
    link.json          control address, ids, account recovery public key,
                       heartbeat interval, certificate expiry

``link.json`` is written last, so its presence is what "joined" means: a join
interrupted half-way leaves no ``link.json`` and may simply be run again.
Beside the keys, marks of where the machine stands: ``keys/link-stopped.json``
(stopped for good), ``keys/restore-pending.json`` (a repair join's restore to
come) and ``keys/join-unconfirmed.json`` (joined, not yet connected).
Nothing here ever logs or formats key material.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import json
import logging
import os
import secrets
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from shared import tls
from shared.atomic import ensure_private_dir, fsync_dir, write_atomic
from shared.config import split_hostport
from shared.crypto import BoxKeyPair, decode_private_key, decode_public_key, encode_private_key
from shared.crypto import encode_public_key as encode_box_public_key
from shared.errors import AgentsError, ConfigError, IntegrityError, InvalidArgument, InvalidState
from shared.ids import validate_id

__all__ = [
    "BOX_KEY",
    "CA_CERT",
    "KEYS_DIR",
    "LINK_FILE",
    "SIGNING_KEY",
    "TLS_CERT",
    "TLS_KEY",
    "LinkRecord",
    "MachineKeys",
    "NewKeys",
    "UnconfirmedJoin",
    "check_not_joined",
    "clear_restore_pending",
    "clear_stopped",
    "clear_unconfirmed",
    "is_joined",
    "mark_restore_pending",
    "mark_unconfirmed",
    "restore_pending",
    "mark_stopped",
    "unconfirmed_join",
    "stopped_reason",
    "load_keys",
    "load_link",
    "save_certificate",
    "save_link",
    "staged_join",
    "write_identity",
    "write_repair",
]

logger = logging.getLogger(__name__)

KEYS_DIR: Final = "keys"
LINK_FILE: Final = "link.json"
SIGNING_KEY: Final = "signing.key"
BOX_KEY: Final = "box.key"
TLS_KEY: Final = "tls.key"
TLS_CERT: Final = "tls.crt"
CA_CERT: Final = "ca.crt"
#: Written when the control plane stopped this machine's link for good (revoked,
#: account deleted): what lets ``join --as-new`` give the folder a new machine.
STOPPED_FILE: Final = "link-stopped.json"
#: Committed with the identity of a repair join that restores the machine's
#: backup, removed once the restore committed: while it is there, the backup
#: is still to come, and the daemon does not start (empty, it would back up
#: nothing and, after ``backup_keep`` days, prune the backup to restore).
RESTORE_PENDING_FILE: Final = "restore-pending.json"
#: Committed with the identity of a join that made a new machine (a fresh data
#: folder, or ``join --as-new``), removed by the link at the control plane's first
#: welcome. Until the machine first connects, the control plane holds the join
#: unconfirmed and rolls it back (the machine's record deleted, the token's use
#: given back) once its grace passed. The mark names the machine and the token:
#: the same join command run again starts the machine instead of asking for a
#: token, and a folder whose join was rolled back may join again with ``--as-new``.
UNCONFIRMED_FILE: Final = "join-unconfirmed.json"

_FORMAT: Final = 1
_STAGE_MARK: Final = ".join-"
# link.json is small; anything bigger is not ours.
_MAX_LINK_BYTES: Final = 64 * 1024
#: Most link addresses a record holds (one per control-plane replica).
MAX_CONTROL_ADDRESSES: Final = 16
#: The longest link address kept (a DNS name of 253 characters and a port).
_MAX_ADDRESS: Final = 261


def listed_address(text: str) -> str | None:
    """A link address as the control plane listed it, in the form the record keeps
    (``host:port``, ``[v6]:port``); None when it is not one (never dialled)."""
    if len(text) > _MAX_ADDRESS or not text.isprintable() or any(c.isspace() for c in text):
        return None
    try:
        host, port = split_hostport(text, "control_addresses", allow_port_zero=False)
    except ConfigError:
        return None
    if "," in host or "/" in host or "@" in host:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class LinkRecord:
    """What ``link.json`` holds: how to reach the control plane and who we are there."""

    control_address: str
    """``host:port`` of the control plane's machine endpoint (mutual TLS): the
    one the link last worked with, tried first."""
    machine_id: str
    """This machine's id (``mc_...``), as issued at join."""
    account_id: str
    """The owning account's id (``acct_...``)."""
    account_recovery_public_key: bytes
    """The account's X25519 recovery public key (32 bytes); backups are sealed to it too."""
    heartbeat_interval: float
    """Seconds between heartbeats, as the control plane last said."""
    cert_not_after: dt.datetime
    """Expiry of the current client certificate (UTC)."""
    cert_received_at: dt.datetime
    """When the current client certificate was received (UTC); renewal is timed from it."""
    other_addresses: tuple[str, ...] = ()
    """The link addresses of the control plane's other replicas, in the order the
    link tries them after ``control_address`` (docs/controlplane.md "Replicas")."""
    learned_addresses: frozenset[str] = frozenset()
    """Those of the addresses known only from the control plane's lists (not the
    join's, not the operator's): the ones a later list may take back."""

    def __post_init__(self) -> None:
        addresses = self.control_addresses
        if not self.learned_addresses <= set(addresses):
            raise InvalidArgument("learned_addresses", "must be among control_addresses")
        for address in addresses:
            # Validated before use: the link dials them; no secret is ever among them.
            try:
                split_hostport(address, "control_addresses", allow_port_zero=False)
            except ConfigError as e:
                raise InvalidArgument("control_addresses", e.reason) from None
        if len(set(addresses)) != len(addresses):
            raise InvalidArgument("control_addresses", "an address is listed twice")
        if len(addresses) > MAX_CONTROL_ADDRESSES:
            raise InvalidArgument("control_addresses", f"at most {MAX_CONTROL_ADDRESSES} addresses")
        validate_id("machine", self.machine_id, "machine_id")
        validate_id("account", self.account_id, "account_id")
        if len(self.account_recovery_public_key) != 32:
            raise InvalidArgument("account_recovery_public_key", "must be 32 bytes")
        if not self.heartbeat_interval > 0:
            raise InvalidArgument("heartbeat_interval", "must be positive")
        for name in ("cert_not_after", "cert_received_at"):
            if getattr(self, name).tzinfo is None:
                raise InvalidArgument(name, "must be timezone-aware")

    @property
    def control_addresses(self) -> tuple[str, ...]:
        """Every link address, the one to try first first."""
        return (self.control_address, *self.other_addresses)

    def starting_at(self, address: str) -> LinkRecord:
        """This record with ``address`` (one of its own) tried first, the round-robin
        order kept: a, b, c starting at b is b, c, a."""
        addresses = self.control_addresses
        at = addresses.index(address)
        first, *others = addresses[at:] + addresses[:at]
        return replace(self, control_address=first, other_addresses=tuple(others))

    def learning(self, listed: Sequence[str]) -> LinkRecord:
        """This record as the control plane's latest list of live replicas'
        addresses (at join and at each welcome) leaves it: the listed addresses it
        lacks added after its own, and those it learned from an earlier list that
        this one no longer names taken out (a replica gone for good, or moved to
        another address), so a fleet whose replicas are replaced over months keeps
        learning the new ones. The join's address and the operator's
        (``--link-address``) are never taken out, nor is the order changed. Each
        listed address is checked (:func:`listed_address`, the others left out),
        repeats left out, none past :data:`MAX_CONTROL_ADDRESSES`. An empty list
        (nothing valid) changes nothing; nor does a list that changes nothing, and
        then the record itself is given back."""
        valid: list[str] = []
        for raw in listed[:MAX_CONTROL_ADDRESSES]:
            address = listed_address(raw)
            if address is not None and address not in valid:
                valid.append(address)
        if not valid:
            return self
        kept = [a for a in self.control_addresses if a not in self.learned_addresses or a in valid]
        added = [a for a in valid if a not in kept][: MAX_CONTROL_ADDRESSES - len(kept)]
        addresses = kept + added
        if tuple(addresses) == self.control_addresses:
            return self
        learned = (self.learned_addresses & set(valid)) | set(added)
        return replace(
            self,
            control_address=addresses[0],
            other_addresses=tuple(addresses[1:]),
            learned_addresses=frozenset(learned),
        )

    def with_addresses_of(self, other: LinkRecord) -> LinkRecord:
        """This record with ``other``'s link addresses (and which were learned)."""
        return replace(
            self,
            control_address=other.control_address,
            other_addresses=other.other_addresses,
            learned_addresses=other.learned_addresses,
        )

    def to_json(self) -> bytes:
        """Serialise as the ``link.json`` document."""
        doc = {
            "format": _FORMAT,
            # The first address alone too: the field an older daemon reads.
            "control_address": self.control_address,
            "control_addresses": list(self.control_addresses),
            # Which of them the control plane listed (a later list may take them back).
            "learned_addresses": sorted(self.learned_addresses),
            "machine_id": self.machine_id,
            "account_id": self.account_id,
            "account_recovery_public_key": encode_box_public_key(self.account_recovery_public_key),
            "heartbeat_interval_ms": round(self.heartbeat_interval * 1000),
            "cert_not_after": self.cert_not_after.astimezone(dt.UTC).isoformat(),
            "cert_received_at": self.cert_received_at.astimezone(dt.UTC).isoformat(),
        }
        return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes) -> LinkRecord:
        """Parse a ``link.json`` document; raise IntegrityError when it is malformed."""
        try:
            doc: Any = json.loads(data)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            if doc.get("format") != _FORMAT:
                raise ValueError(f"unknown format {doc.get('format')!r}")
            # A record written before replicas holds control_address alone.
            listed = doc.get("control_addresses", [doc["control_address"]])
            if not isinstance(listed, list) or not listed:
                raise ValueError("control_addresses must be a non-empty list")
            # A record written before addresses could be taken back: all kept.
            learned = doc.get("learned_addresses", [])
            if not isinstance(learned, list) or not all(isinstance(a, str) for a in learned):
                raise ValueError("learned_addresses must be a list of addresses")
            return cls(
                control_address=str(listed[0]),
                other_addresses=tuple(str(a) for a in listed[1:]),
                learned_addresses=frozenset(learned),
                machine_id=str(doc["machine_id"]),
                account_id=str(doc["account_id"]),
                account_recovery_public_key=decode_public_key(
                    str(doc["account_recovery_public_key"])
                ),
                heartbeat_interval=int(doc["heartbeat_interval_ms"]) / 1000,
                cert_not_after=dt.datetime.fromisoformat(str(doc["cert_not_after"])),
                cert_received_at=dt.datetime.fromisoformat(str(doc["cert_received_at"])),
            )
        except (ValueError, KeyError, TypeError, AgentsError) as e:
            raise IntegrityError(LINK_FILE, f"malformed: {e}") from None


@dataclass(frozen=True)
class NewKeys:
    """Freshly made private keys of a machine about to join."""

    signing_key: ed25519.Ed25519PrivateKey = field(repr=False)
    box: BoxKeyPair = field(repr=False)
    tls_key: ec.EllipticCurvePrivateKey = field(repr=False)

    @classmethod
    def generate(cls) -> NewKeys:
        """Make a signing key, a box key and a TLS client key."""
        return cls(
            signing_key=ed25519.Ed25519PrivateKey.generate(),
            box=BoxKeyPair.generate(),
            tls_key=tls.new_tls_key(),
        )

    @property
    def signing_public_key(self) -> bytes:
        """Raw 32-byte Ed25519 public key."""
        return self.signing_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    def csr_pem(self) -> bytes:
        """A PEM CSR for the TLS key (the control plane sets the identity)."""
        return tls.build_csr(self.tls_key)


@dataclass(frozen=True)
class MachineKeys:
    """The machine's keys and certificates as loaded from ``keys/``."""

    signing_key: ed25519.Ed25519PrivateKey = field(repr=False)
    box: BoxKeyPair = field(repr=False)
    tls_key_pem: bytes = field(repr=False)
    tls_cert_pem: bytes
    ca_cert_pem: bytes


def is_joined(data_dir: Path) -> bool:
    """True when ``data_dir`` holds a committed join (its ``link.json``)."""
    return (data_dir / LINK_FILE).is_file()


def mark_stopped(data_dir: Path, reason: str, at: float) -> None:
    """Record that the control plane stopped this machine for good, and why."""
    doc = {"reason": reason[:500], "at": at}
    write_atomic(data_dir / KEYS_DIR / STOPPED_FILE, json.dumps(doc).encode())


def stopped_reason(data_dir: Path) -> str | None:
    """Why the control plane stopped this machine for good, or None if it did not."""
    try:
        doc = json.loads((data_dir / KEYS_DIR / STOPPED_FILE).read_bytes()[:4096])
    except (OSError, ValueError):
        return None
    reason = doc.get("reason") if isinstance(doc, dict) else None
    return reason if isinstance(reason, str) and reason else "stopped"


def clear_stopped(data_dir: Path) -> None:
    """Forget a stop (the folder joined again, as a new machine or re-paired)."""
    (data_dir / KEYS_DIR / STOPPED_FILE).unlink(missing_ok=True)


@dataclass(frozen=True)
class UnconfirmedJoin:
    """A committed join of a new machine not confirmed yet (:data:`UNCONFIRMED_FILE`)."""

    machine_id: str
    """The machine the join made."""
    token_id: str
    """The token it used (its id only: the secret is never stored)."""
    at: float
    """When the join committed (Unix time)."""

    def to_json(self) -> bytes:
        """Serialise as the mark's document."""
        doc = {"machine_id": self.machine_id, "token_id": self.token_id, "at": self.at}
        return (json.dumps(doc, sort_keys=True) + "\n").encode()


def mark_unconfirmed(root: Path, join: UnconfirmedJoin) -> None:
    """Record, in the identity at ``root`` (a join's stage), that ``join`` awaits the
    machine's first connection (see :data:`UNCONFIRMED_FILE`)."""
    keys_dir = ensure_private_dir(root / KEYS_DIR)
    write_atomic(keys_dir / UNCONFIRMED_FILE, join.to_json())


def unconfirmed_join(data_dir: Path) -> UnconfirmedJoin | None:
    """The join of ``data_dir``'s machine while the control plane has not confirmed
    it (the machine never connected since), else None; a mark naming another
    machine than ``link.json`` (an earlier identity's) is not one."""
    if not is_joined(data_dir):
        return None
    try:
        current = load_link(data_dir).machine_id  # first: it finishes a swap found begun
        doc = json.loads((data_dir / KEYS_DIR / UNCONFIRMED_FILE).read_bytes()[:4096])
        join = UnconfirmedJoin(str(doc["machine_id"]), str(doc["token_id"]), float(doc["at"]))
    except (OSError, ValueError, KeyError, TypeError, AgentsError):
        return None
    return join if join.machine_id == current else None


def clear_unconfirmed(data_dir: Path) -> None:
    """The control plane confirmed the join (the machine connected), or it was re-paired."""
    (data_dir / KEYS_DIR / UNCONFIRMED_FILE).unlink(missing_ok=True)


def mark_restore_pending(root: Path) -> None:
    """Record, in the identity at ``root`` (a join's stage), that the machine's
    backup is to be restored (see :data:`RESTORE_PENDING_FILE`)."""
    keys_dir = ensure_private_dir(root / KEYS_DIR)
    write_atomic(keys_dir / RESTORE_PENDING_FILE, b'{"restore": "newest backup"}\n')


def restore_pending(data_dir: Path) -> bool:
    """True while a repair join's restore has not committed (a mark without a
    committed join, left by a join killed before its commit point, is not one)."""
    return is_joined(data_dir) and (data_dir / KEYS_DIR / RESTORE_PENDING_FILE).exists()


def clear_restore_pending(data_dir: Path) -> None:
    """The repair join's restore committed (or its operator gave it up)."""
    path = data_dir / KEYS_DIR / RESTORE_PENDING_FILE
    if path.exists():
        path.unlink()
        fsync_dir(path.parent)


def _signing_pem(key: ed25519.Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_identity(
    root: Path,
    keys: NewKeys,
    *,
    cert_pem: bytes,
    ca_cert_pem: bytes,
    link: LinkRecord,
) -> None:
    """Write ``keys/`` and then ``link.json`` under ``root`` (a staging folder at join)."""
    keys_dir = ensure_private_dir(root / KEYS_DIR)
    write_atomic(keys_dir / SIGNING_KEY, _signing_pem(keys.signing_key))
    write_atomic(keys_dir / BOX_KEY, (encode_private_key(keys.box.private_key) + "\n").encode())
    write_atomic(keys_dir / TLS_KEY, tls.private_key_pem(keys.tls_key))
    write_atomic(keys_dir / TLS_CERT, cert_pem)
    write_atomic(keys_dir / CA_CERT, ca_cert_pem)
    write_atomic(root / LINK_FILE, link.to_json())


def _read_private(path: Path, limit: int = 64 * 1024) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise InvalidState(str(path.parent.parent), f"missing {path.name}: not joined") from None
    if len(data) > limit:
        raise IntegrityError(path.name, "too large")
    return data


def load_link(data_dir: Path) -> LinkRecord:
    """Read ``link.json``; InvalidState when the machine has not joined."""
    _finish_repair(data_dir)
    path = data_dir / LINK_FILE
    if not path.is_file():
        raise InvalidState(str(data_dir), "not joined to a control plane (no link.json)")
    return LinkRecord.from_json(_read_private(path, _MAX_LINK_BYTES))


def save_link(data_dir: Path, link: LinkRecord) -> None:
    """Replace ``link.json`` atomically."""
    write_atomic(data_dir / LINK_FILE, link.to_json())


def load_keys(data_dir: Path) -> MachineKeys:
    """Read every key and certificate under ``keys/``; IntegrityError if one is damaged."""
    _finish_repair(data_dir)
    keys_dir = data_dir / KEYS_DIR
    signing_pem = _read_private(keys_dir / SIGNING_KEY)
    box_text = _read_private(keys_dir / BOX_KEY)
    tls_key_pem = _read_private(keys_dir / TLS_KEY)
    tls_cert_pem = _read_private(keys_dir / TLS_CERT)
    ca_cert_pem = _read_private(keys_dir / CA_CERT)
    try:
        signing = serialization.load_pem_private_key(signing_pem, password=None)
    except (ValueError, TypeError):
        raise IntegrityError(SIGNING_KEY, "cannot parse the signing key") from None
    if not isinstance(signing, ed25519.Ed25519PrivateKey):
        raise IntegrityError(SIGNING_KEY, "not an Ed25519 key")
    try:
        box = BoxKeyPair.from_private(decode_private_key(box_text.decode("ascii").strip()))
        tls.load_private_key(tls_key_pem)
        tls.load_cert(tls_cert_pem, TLS_CERT)
        tls.load_cert(ca_cert_pem, CA_CERT)
    except (InvalidArgument, UnicodeDecodeError) as e:
        # InvalidArgument messages name the field, never the key bytes.
        raise IntegrityError(str(keys_dir), f"damaged key file: {e}") from None
    return MachineKeys(
        signing_key=signing,
        box=box,
        tls_key_pem=tls_key_pem,
        tls_cert_pem=tls_cert_pem,
        ca_cert_pem=ca_cert_pem,
    )


def save_certificate(
    data_dir: Path,
    cert_pem: bytes,
    ca_cert_pem: bytes,
    link: LinkRecord,
    *,
    received_at: dt.datetime | None = None,
) -> LinkRecord:
    """Store a renewed client certificate (same TLS key) and update ``link.json``.

    Each file is replaced atomically; the certificate goes first so that a
    crash in between leaves a newer certificate with an older expiry in
    ``link.json``, which only makes the next renewal come early. Link
    addresses are the record on disk's (a welcome may have changed them since
    ``link`` was read).
    """
    keys_dir = data_dir / KEYS_DIR
    write_atomic(keys_dir / CA_CERT, ca_cert_pem)
    write_atomic(keys_dir / TLS_CERT, cert_pem)
    with contextlib.suppress(InvalidState, IntegrityError):
        link = link.with_addresses_of(load_link(data_dir))
    updated = replace(
        link,
        cert_not_after=tls.cert_not_after(cert_pem),
        cert_received_at=received_at or dt.datetime.now(dt.UTC),
    )
    save_link(data_dir, updated)
    return updated


# A re-pair replaces these (staged as NAME.new) in this order; the first rename
# is its commit point, and load_keys/load_link finish a swap found begun. The
# unconfirmed mark is staged only by a join as a new machine.
_REPAIR_SWAP: Final = (
    (KEYS_DIR, TLS_KEY),
    (KEYS_DIR, TLS_CERT),
    (KEYS_DIR, CA_CERT),
    (KEYS_DIR, UNCONFIRMED_FILE),
    (".", LINK_FILE),
)


def _finish_repair(data_dir: Path) -> None:
    staged = [data_dir / folder / f"{name}.new" for folder, name in _REPAIR_SWAP]
    if staged[0].exists() or not any(p.exists() for p in staged[1:]):
        return  # no swap begun (staged files alone are a re-pair that never committed)
    logger.warning("%s: finishing a re-pair a crash interrupted", data_dir)
    _swap_repair(data_dir)


def _swap_repair(data_dir: Path) -> None:
    for folder, name in _REPAIR_SWAP:
        src = data_dir / folder / f"{name}.new"
        if src.exists():
            os.replace(src, data_dir / folder / name)
    fsync_dir(data_dir / KEYS_DIR)
    fsync_dir(data_dir)


def write_repair(
    data_dir: Path,
    tls_key: ec.EllipticCurvePrivateKey,
    *,
    cert_pem: bytes,
    ca_cert_pem: bytes,
    link: LinkRecord,
    unconfirmed: UnconfirmedJoin | None = None,
) -> None:
    """Re-pair a joined machine: a new TLS key, certificate, CA set and link record.

    The signing and box keys stay (prompts queued for this machine and its
    backups are sealed to them). Each file is staged, then renamed into place
    with the TLS key first (the commit point, see :data:`_REPAIR_SWAP`).
    ``unconfirmed``: the folder joins as a new machine (``--as-new``), whose join
    the control plane confirms at its first connection; a re-pair (the record is
    never rolled back) drops an earlier join's mark instead.
    """
    mark = data_dir / KEYS_DIR / UNCONFIRMED_FILE
    Path(f"{mark}.new").unlink(missing_ok=True)  # a stage never committed
    if unconfirmed is None:
        # Before the commit point: killed here, the machine re-pairs again with
        # the same token, and a repaired record is never rolled back.
        mark.unlink(missing_ok=True)
    staged = (
        tls.private_key_pem(tls_key),
        cert_pem,
        ca_cert_pem,
        unconfirmed.to_json() if unconfirmed is not None else None,
        link.to_json(),
    )
    for (folder, name), data in zip(_REPAIR_SWAP, staged, strict=True):
        if data is not None:
            write_atomic(data_dir / folder / f"{name}.new", data)
    _swap_repair(data_dir)


def _remove_stale_stages(data_dir: Path) -> None:
    # A crash during a past join may have left a staging folder behind.
    prefix = f".{data_dir.name}{_STAGE_MARK}"
    for entry in data_dir.parent.glob(prefix + "*"):
        if entry.is_dir() and not entry.is_symlink():
            logger.info("removing a stale join staging folder %s", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _commit(stage: Path, data_dir: Path) -> None:
    try:
        # rename(2) onto a missing or empty folder swaps the whole identity in at once.
        os.rename(stage, data_dir)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    else:
        fsync_dir(data_dir.parent)
        return
    # A data folder already in use (a stand-alone machine joining): move the key
    # files in one by one, then link.json, which is the commit point.
    ensure_private_dir(data_dir, 0o700)
    keys_dir = ensure_private_dir(data_dir / KEYS_DIR)
    for name in (SIGNING_KEY, BOX_KEY, TLS_KEY, TLS_CERT, CA_CERT):
        os.replace(stage / KEYS_DIR / name, keys_dir / name)
    for mark in (RESTORE_PENDING_FILE, UNCONFIRMED_FILE):
        if (stage / KEYS_DIR / mark).exists():
            os.replace(stage / KEYS_DIR / mark, keys_dir / mark)
        else:  # an earlier identity's, removed by hand: not this join's
            (keys_dir / mark).unlink(missing_ok=True)
    fsync_dir(keys_dir)
    os.replace(stage / LINK_FILE, data_dir / LINK_FILE)
    fsync_dir(data_dir)
    shutil.rmtree(stage, ignore_errors=True)


def check_not_joined(data_dir: Path) -> None:
    """Raise InvalidState (field ``data_dir``) when ``data_dir`` is already joined."""
    if not is_joined(data_dir):
        return
    try:
        where = load_link(data_dir)
        detail = f" to {where.control_address} as machine {where.machine_id}"
    except IntegrityError:
        detail = ""
    raise InvalidState(
        "data_dir",
        f"{data_dir} is already joined{detail}; use another --data-dir or remove this one first",
    )


@contextlib.contextmanager
def staged_join(data_dir: Path) -> Iterator[Path]:
    """Yield an empty private staging folder beside ``data_dir``; commit it on success.

    Write the identity into the yielded folder. When the block ends normally
    the identity is moved into ``data_dir`` (see :func:`_commit`); when it
    raises, the staging folder is removed and ``data_dir`` is untouched, so a
    refused join writes nothing on the machine.
    """
    data_dir = data_dir.absolute()
    check_not_joined(data_dir)
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_stages(data_dir)
    stage = data_dir.parent / f".{data_dir.name}{_STAGE_MARK}{secrets.token_hex(6)}"
    stage.mkdir(mode=0o700)
    os.chmod(stage, 0o700)
    try:
        yield stage
        if is_joined(data_dir):  # another join won the race while we talked to the server
            raise InvalidState("data_dir", f"{data_dir} was joined by another process")
        _commit(stage, data_dir)
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)
