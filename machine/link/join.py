"""Joining a control plane: pin its CA, trade a one-time token for a certificate.

The flow (``agents-machine join H:P --token T --ca-hash sha256:...``):

1. Check the inputs: the token's shape, the hash's shape, the address.
2. Open a bare TLS connection to the address, send nothing but the TLS
   handshake, and read the certificate chain the server presents. One of the
   chain's certificates must be a CA whose public key hashes to the pinned
   value, and the server's own certificate must be signed by it. Only then is
   the token sent, over a gRPC channel that trusts that CA and nothing else.
3. Make the machine's keys (Ed25519 signing, X25519 box, P-256 TLS) and a CSR;
   call ``Join``; check the answer (certificate for our key, issued by the
   pinned CA, well-formed ids).
4. Write ``keys/`` and ``link.json`` into a staging folder beside the data
   folder and move them into place only once everything succeeded, so a
   refused join writes nothing on the machine. With them goes the mark that
   the join is not confirmed yet (:data:`machine.link.identity.UNCONFIRMED_FILE`):
   the control plane confirms it when the machine first connects, and rolls
   it back when it does not within its grace.

A repair join (a token from ``agents-control machine repair M``) is the same
flow; the control plane answers with M's id, so the box becomes M. With
``--recovery-key FILE`` the CLI then runs :func:`restore_after_join`: M's
newest backup, opened with the account recovery key, restored whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc
import grpc.aio
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from machine.link import identity
from machine.link.client import JoinDialer, JoinReply, LinkClient, MachineInfo
from machine.version import machine_version
from shared import tls
from shared.errors import (
    AgentsError,
    IntegrityError,
    InvalidArgument,
    TransientError,
)
from shared.ids import is_valid_id, validate_id
from shared.rpc import domain_error
from shared.timestamps import Clock, utc_now

__all__ = [
    "JoinResult",
    "fetch_pinned_ca",
    "join_control_plane",
    "parse_address",
    "parse_link_addresses",
    "validate_ca_hash",
    "validate_name",
    "validate_token",
]

logger = logging.getLogger(__name__)

#: Seconds allowed for the pin-check handshake and for the Join call.
CONNECT_TIMEOUT: Final = 10.0
JOIN_TIMEOUT: Final = 30.0

_TOKEN_RE: Final = re.compile(r"\A(tok_[0-9a-z]{26})\.([A-Za-z0-9_-]{16,128})\Z")
_CA_HASH_RE: Final = re.compile(r"\Asha256:[0-9a-f]{64}\Z")
_HOST_RE: Final = re.compile(
    r"\A(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z"
)
_MAX_NAME: Final = 64


@dataclass(frozen=True)
class JoinResult:
    """What a successful join produced."""

    machine_id: str
    account_id: str
    control_address: str
    repaired: bool = False
    """A re-pair: an already-joined box took a new certificate and CA, keeping its id."""


def validate_token(token: str) -> str:
    """Return the token id of ``<tok_id>.<secret>``; InvalidArgument naming ``token``.

    The message never repeats the token: its second half is a secret.
    """
    m = _TOKEN_RE.match(token.strip()) if isinstance(token, str) else None
    if m is None or not is_valid_id("token", m.group(1)):
        raise InvalidArgument("token", "must look like <tok_id>.<secret> (tok_... dot secret)")
    return m.group(1)


def validate_ca_hash(ca_hash: str) -> str:
    """Return the normalised ``sha256:<64 hex>``; InvalidArgument naming ``ca_hash``."""
    value = ca_hash.strip().lower() if isinstance(ca_hash, str) else ""
    if not _CA_HASH_RE.match(value):
        raise InvalidArgument("ca_hash", "must look like sha256:<64 hex characters>")
    return value


def parse_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6); InvalidArgument naming ``address``."""
    text = address.strip() if isinstance(address, str) else ""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise InvalidArgument("address", f"must be HOST:PORT, got {text[:100]!r}")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise InvalidArgument("address", f"port must be 1..65535, got {port}")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise InvalidArgument("address", f"not an IPv6 address: {host!r}") from None
        return host[1:-1], port
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        if not _HOST_RE.match(host):
            raise InvalidArgument("address", f"not a host name: {host[:100]!r}") from None
    return host, port


def validate_name(name: str | None) -> str:
    """The machine's display name: given, else the host name; 1..64 printable chars."""
    value = (name if name is not None else socket.gethostname()).strip()
    if name is None:
        value = value[:_MAX_NAME] or "machine"
    if not 1 <= len(value) <= _MAX_NAME or not value.isprintable():
        raise InvalidArgument("name", f"must be 1..{_MAX_NAME} printable characters")
    return value


def _spki_hash(cert: x509.Certificate) -> str:
    return tls.ca_hash(cert.public_bytes(serialization.Encoding.PEM))


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


#: Seconds a join waits, after its TLS handshake, to tell a hang-up from silence.
_HANGUP_WAIT: Final = 2.0


def _fetch_chain_blocking(host: str, port: int, timeout: float) -> tuple[list[bytes], bool]:
    """The server's certificate chain (DER), and whether it closed the connection
    at once after the handshake: the control plane's link port does, as it
    wants a machine certificate this box does not have yet; its public port
    (Join) sends its HTTP/2 settings first."""
    # A bare TLS handshake with verification off: we verify by the pin below,
    # and nothing but the ClientHello is sent before that.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, port), timeout=timeout) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as sock,
    ):
        # Python 3.13 makes this public (SSLSocket.get_unverified_chain); 3.11
        # has it on the private _sslobj.
        sslobj = getattr(sock, "_sslobj", None)
        getter = getattr(sslobj, "get_unverified_chain", None)
        if getter is None:
            leaf = sock.getpeercert(binary_form=True)
            ders = [leaf] if leaf else []
        else:
            chain = getter() or []
            ders = [c.public_bytes(ssl._ssl.ENCODING_DER) for c in chain]  # type: ignore[attr-defined]
        # Briefly: a proxy in front of the public port may wait for the client
        # to speak first; that silence is not a hang-up.
        sock.settimeout(min(timeout, _HANGUP_WAIT))
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
        except (OSError, ssl.SSLError):
            closed = True  # an alert (TLS 1.3: "certificate required") or a reset
        return ders, closed


async def fetch_pinned_ca(
    host: str,
    port: int,
    ca_hash: str,
    *,
    timeout: float = CONNECT_TIMEOUT,
    clock: Clock = utc_now,
) -> bytes:
    """Return the PEM of the server's CA once it matches ``ca_hash``.

    Raises TransientError when the server cannot be reached,
    IntegrityError (field ``ca_hash``) when no certificate of the chain is a CA
    with the pinned key or the server's certificate is not signed by it, and
    InvalidArgument (field ``address``) when it is the control plane's link
    port (it hangs up on a client without a certificate).
    """
    try:
        ders, closed = await asyncio.wait_for(
            asyncio.to_thread(_fetch_chain_blocking, host, port, timeout), timeout + 1
        )
    except (OSError, TimeoutError, ssl.SSLError) as e:
        raise TransientError(f"join {host}:{port}: cannot reach the control plane: {e}") from None
    try:
        chain = [x509.load_der_x509_certificate(d) for d in ders]
    except ValueError:
        raise IntegrityError("ca_hash", "the server sent an unreadable certificate") from None
    if not chain:
        raise IntegrityError("ca_hash", "the server sent no certificate")
    expected = validate_ca_hash(ca_hash)
    pinned = [c for c in chain if _is_ca(c) and _spki_hash(c) == expected]
    if not pinned:
        seen = ", ".join(_spki_hash(c) for c in chain if _is_ca(c)) or "no CA certificate"
        raise IntegrityError(
            "ca_hash",
            f"the control plane at {host}:{port} does not present the pinned CA "
            f"(expected {expected}, server offers {seen}); check --ca-hash, or you may "
            "be talking to another server",
        )
    ca = pinned[0]
    leaf = chain[0]
    now = clock()
    try:
        leaf.verify_directly_issued_by(ca)
    except Exception:  # cryptography raises several types for a bad signature
        raise IntegrityError(
            "ca_hash", f"the server certificate of {host}:{port} is not issued by the pinned CA"
        ) from None
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        raise IntegrityError("ca_hash", f"the server certificate of {host}:{port} is not valid now")
    if closed:
        # Our control plane (the pin matched) hung up without a word: its link
        # port. Sending the token there would fail as a lost connection, and
        # "run it again" would never help.
        raise InvalidArgument(
            "address",
            f"{host}:{port} is the control plane's link port (it wants a machine"
            " certificate); join at its public port, as `agents-control token create`"
            " prints it",
        )
    return ca.public_bytes(serialization.Encoding.PEM)


def _check_reply(
    reply: JoinReply, keys: identity.NewKeys, ca_pem: bytes, expected_hash: str
) -> tuple[bytes, bytes]:
    """Validate the Join answer; return (client cert PEM, CA PEM)."""
    validate_id("machine", reply.machine_id, "machine_id")
    validate_id("account", reply.account_id, "account_id")
    if len(reply.account_recovery_public_key) != 32:
        raise IntegrityError("join", "account recovery public key is not 32 bytes")
    cert_pem = reply.certificate_pem.encode("ascii", "replace")
    try:
        if reply.ca_certificate_pem:
            tls.check_ca_hash(reply.ca_certificate_pem, expected_hash)
            # During a CA rollover the reply names the pinned CA and the new one
            # (which signed our certificate): we trust both from now on.
            ca_pem = reply.ca_certificate_pem.encode("ascii", "replace")
        tls.check_client_cert(
            cert_pem,
            ca_pem,
            public_key=keys.tls_key.public_key(),
            account_id=reply.account_id,
            machine_id=reply.machine_id,
        )
    except InvalidArgument as e:
        raise IntegrityError("join", f"bad certificate in the reply: {e}") from None
    return cert_pem, ca_pem


def _join_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _link_address(reply: JoinReply, host: str, port: int) -> str:
    """The mutual-TLS listener the reply names (same host as the join by default)."""
    link_host = reply.link_host or host
    link_port = reply.link_port or port
    try:
        parsed_host, parsed_port = parse_address(_join_hostport(link_host, link_port))
    except InvalidArgument as e:
        raise IntegrityError("join", f"bad link address in the reply: {e}") from None
    return (
        f"[{parsed_host}]:{parsed_port}" if ":" in parsed_host else f"{parsed_host}:{parsed_port}"
    )


def parse_link_addresses(text: str) -> tuple[str, ...]:
    """``HOST:PORT[,HOST:PORT…]``: the link addresses of a control plane's replicas,
    each checked (InvalidArgument naming ``link_address``), repeats dropped."""
    out: list[str] = []
    for part in text.split(","):
        try:
            host, port = parse_address(part)
        except InvalidArgument as e:
            raise InvalidArgument("link_address", e.reason) from None
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if address not in out:
            out.append(address)
    # Room for the address the join reply names: the record is refused past the
    # maximum, and by then the token would be spent.
    most = identity.MAX_CONTROL_ADDRESSES - 1
    if len(out) > most:
        raise InvalidArgument("link_address", f"at most {most} addresses")
    return tuple(out)


def _connection_lost(e: grpc.aio.AioRpcError) -> bool:
    """UNAVAILABLE from the transport (no status detail of ours): the server went away."""
    if e.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    trailers: tuple[tuple[str, object], ...] = tuple(e.trailing_metadata() or ())  # type: ignore[arg-type]
    return not any(key == "grpc-status-details-bin" for key, _ in trailers)


async def join_control_plane(
    *,
    data_dir: Path,
    address: str,
    token: str,
    ca_hash: str,
    name: str | None,
    take_over: bool = False,
    recovery_public_key: bytes = b"",
    as_new: bool = False,
    link_addresses: tuple[str, ...] = (),
    clock: Clock = utc_now,
    dial: JoinDialer = LinkClient.for_join,
) -> JoinResult:
    """Join the control plane at ``address`` with a one-time ``token``.

    Raises InvalidArgument (naming the field) for malformed input, InvalidState
    when ``data_dir`` is already joined, IntegrityError when the CA does not
    match the pin, TransientError when the control plane cannot be reached,
    and the control plane's refusal (Unauthenticated for a bad, expired, used
    or revoked token; PermissionDenied for a deleted account) otherwise.
    In every failure case nothing is written under ``data_dir``.

    A ``data_dir`` already joined RE-PAIRS (after the control plane's keys were
    lost and it adopted its store, or it moved): the token must be a repair
    token for this very machine (the control plane checks that before using
    it); the machine keeps its id, its signing and box keys (queued prompts and
    backups are sealed to them) and its data, and takes a new TLS key,
    certificate, CA and link record (:func:`machine.link.identity.write_repair`).

    With ``as_new``, a joined ``data_dir`` whose machine is gone for good
    (revoked, or its account deleted) joins again as a NEW machine with a plain
    token: it keeps its signing and box keys and its data, and takes the new
    id, TLS key, certificate and link record as a re-pair does; the old id
    stays one of its own (machine.link.machine_ids), so its agents still run here.

    A new box with a repair token takes that machine over only with
    ``take_over`` (the caller restores its backup next, or was told to take it
    over empty); without, the control plane refuses before using the token.
    ``recovery_public_key`` (the public half of the key it will restore with)
    lets the control plane refuse a key that is not the account's before the
    takeover; an older control plane ignores it, and the caller's check after
    the join catches that key instead.
    A new box given one also commits, with its identity, that the restore is
    still to come (:func:`machine.link.identity.restore_pending`): the caller clears
    it once the restore committed.

    ``link_addresses`` (checked by :func:`parse_link_addresses`): the link
    addresses of the control plane's other replicas; the record lists them after
    the one the reply names, then the live replicas the reply lists that are not
    among them (:meth:`~machine.link.identity.LinkRecord.learning`), and the link
    moves to them when its replica goes.

    ``dial`` opens the channel the token goes over, once the pin check passed
    (the real TLS client; tests pass a fake control plane's).
    """
    token_id = validate_token(token)
    expected = validate_ca_hash(ca_hash)
    host, port = parse_address(address)
    if link_addresses:
        link_addresses = parse_link_addresses(",".join(link_addresses))
    machine_name = validate_name(name)
    data_dir = Path(data_dir).absolute()
    current = await asyncio.to_thread(_current_link, data_dir)

    ca_pem = await fetch_pinned_ca(host, port, expected, clock=clock)
    logger.info("control plane %s:%d presents the pinned CA %s", host, port, expected)

    if current is None:
        keys = await asyncio.to_thread(identity.NewKeys.generate)
    else:
        held = await asyncio.to_thread(identity.load_keys, data_dir)
        keys = identity.NewKeys(held.signing_key, held.box, tls.new_tls_key())
    machine = MachineInfo(
        name=machine_name,
        version=machine_version(),
        hostname=socket.gethostname()[:253],
        box_public_key=keys.box.public_key,
        signing_public_key=keys.signing_public_key,
    )
    target = _join_hostport(host, port)
    async with contextlib.aclosing(dial(target, ca_pem)) as client:
        try:
            try:
                reply = await client.join(
                    token.strip(),
                    keys.csr_pem().decode("ascii"),
                    machine,
                    timeout=JOIN_TIMEOUT,
                    repair_machine_id=current.machine_id if current and not as_new else "",
                    # Only a new box takes a machine over: a joined one (a re-pair, or
                    # --as-new) must never become another machine with its own data.
                    take_over=take_over and current is None,
                    recovery_public_key=recovery_public_key if current is None else b"",
                )
            except grpc.aio.AioRpcError as e:
                if _connection_lost(e):
                    raise TransientError(
                        f"join {target}: cannot reach the control plane (the connection was "
                        f"lost: {e.details()}); run the same command again (a join that did "
                        "not complete gives its token back within minutes)"
                    ) from None
                raise domain_error(e) from None
        except TransientError as e:
            logger.warning("join %s failed: %s", target, e)
            raise
        except AgentsError as e:
            logger.warning("join %s refused: %s: %s", target, type(e).__name__, e)
            raise
    cert_pem, ca_pem = _check_reply(reply, keys, ca_pem, expected)
    link_address = _link_address(reply, host, port)
    interval_ms = reply.heartbeat_interval_ms or 10_000
    link = identity.LinkRecord(
        control_address=link_address,
        other_addresses=tuple(a for a in link_addresses if a != link_address),
        machine_id=reply.machine_id,
        account_id=reply.account_id,
        account_recovery_public_key=reply.account_recovery_public_key,
        heartbeat_interval=interval_ms / 1000,
        cert_not_after=tls.cert_not_after(cert_pem),
        cert_received_at=clock(),
        # The other replicas the control plane knows of, after the operator's.
    ).learning(reply.control_addresses)
    if current is not None:
        same = (reply.machine_id, reply.account_id) == (current.machine_id, current.account_id)
        if same == as_new:
            raise IntegrityError(
                "join",
                "the reply names the machine this box was"
                if as_new
                else "the re-pair reply names another machine",
            )
        await asyncio.to_thread(
            identity.write_repair,
            data_dir,
            keys.tls_key,
            cert_pem=cert_pem,
            ca_cert_pem=ca_pem,
            link=link,
            # A new machine: the control plane rolls it back unless it connects.
            unconfirmed=_unconfirmed(link, token_id, clock) if as_new else None,
        )
        await asyncio.to_thread(identity.clear_stopped, data_dir)
        if as_new:
            logger.info(
                "joined %s again as the new machine %s (was %s)",
                link_address,
                link.machine_id,
                current.machine_id,
            )
            return JoinResult(link.machine_id, link.account_id, link_address)
        logger.info("re-paired with %s as machine %s", link_address, link.machine_id)
        return JoinResult(link.machine_id, link.account_id, link_address, repaired=True)
    # Only now, with the certificate in hand, does anything touch the disk.
    with identity.staged_join(data_dir) as stage:
        await asyncio.to_thread(
            identity.write_identity, stage, keys, cert_pem=cert_pem, ca_cert_pem=ca_pem, link=link
        )
        # Until the daemon first connects: a crash or a daemon that does not start
        # leaves a join the control plane rolls back (docs/join.md).
        await asyncio.to_thread(
            identity.mark_unconfirmed, stage, _unconfirmed(link, token_id, clock)
        )
        if recovery_public_key:
            # The caller restores the machine's backup next: until that commits,
            # the folder says so (a crash between the two is finished by running
            # the join again, and the daemon does not start empty meanwhile).
            await asyncio.to_thread(identity.mark_restore_pending, stage)
    logger.info(
        "joined %s as machine %s of account %s", link_address, link.machine_id, link.account_id
    )
    return JoinResult(
        machine_id=link.machine_id, account_id=link.account_id, control_address=link_address
    )


def _unconfirmed(
    link: identity.LinkRecord, token_id: str, clock: Clock
) -> identity.UnconfirmedJoin:
    return identity.UnconfirmedJoin(link.machine_id, token_id, clock().timestamp())


def _current_link(data_dir: Path) -> identity.LinkRecord | None:
    """The link record of an already-joined ``data_dir`` (a re-pair), else None."""
    return identity.load_link(data_dir) if identity.is_joined(data_dir) else None
