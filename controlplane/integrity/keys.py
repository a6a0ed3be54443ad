"""The control plane's home folder: keys and config only (all state is in the store).

Layout (folder 0700, files 0600)::

    config.toml     settings written by ``init`` (no secrets)
    ca.pem ca.key   the CA machines pin and whose certificates they hold
    server.pem server.key   the TLS server certificate (SANs: localhost, 127.0.0.1, names)
    control.key     the control key (Ed25519, PKCS#8 PEM), signs control-plane statements
    secrets.key     32 random bytes that encrypt provider secrets in the store
    serve.json      written by ``serve``: the addresses it actually listens on
    instance.json   this home's id (fencing: controlplane.recovery.fencing)
    serve.lock      flock'd by the one process using the home: serve or store migrate
    store-migrate.json  only during ``store migrate`` (controlplane.recovery.migrate)
    recovery.pub    the operator recovery public key the key bundle is sealed to
    ca-next.pem ca-next.key server-next.pem server-next.key
                    only during a CA rollover (see below)

**Rotation** (controlplane.recovery.rotation). Replacing several files is made
crash-consistent by renaming staged files into place in a fixed order whose
FIRST rename is the commit point: :func:`load_home_keys` finishes a swap it
finds begun (its first staged file gone while a later one remains), so a
crash never leaves a key beside another key's certificate.

- Server certificate: ``server.key.new`` and ``server.pem.new`` are written,
  then renamed over ``server.key`` and ``server.pem``.
- CA rollover: the new CA and a server certificate under it are written as
  the ``*-next`` files (``ca-next.pem`` last: its presence is the rollover's
  commit point). While they exist, new client certificates are signed by the
  next CA, and client certificates of both CAs are accepted; the server keeps
  presenting the old chain so that machines which never renewed still
  connect. Retiring the old CA renames the ``*-next`` files over the current
  ones (``server-next.key`` first: the commit point).
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from shared import tls
from shared.atomic import ensure_private_dir, fsync_dir, write_atomic
from shared.errors import ConfigError
from shared.tls import CertKey

__all__ = [
    "HomeKeys",
    "KeyRing",
    "check_home_empty",
    "create_home_keys",
    "finish_ca_rollover",
    "load_home_keys",
    "replace_server_cert",
    "start_ca_rollover",
    "write_home_keys",
]

logger = logging.getLogger(__name__)

_FILES: Final = {
    "ca_cert": "ca.pem",
    "ca_key": "ca.key",
    "server_cert": "server.pem",
    "server_key": "server.key",
    "control_key": "control.key",
    "secrets_key": "secrets.key",
}
_NEXT_CA: Final = ("ca-next.pem", "ca-next.key")
_NEXT_SERVER: Final = ("server-next.pem", "server-next.key")
# Staged swaps (source, destination) in rename order; the first rename commits.
_SERVER_SWAP: Final = (("server.key.new", "server.key"), ("server.pem.new", "server.pem"))
_RETIRE_SWAP: Final = (
    ("server-next.key", "server.key"),
    ("server-next.pem", "server.pem"),
    ("ca-next.key", "ca.key"),
    ("ca-next.pem", "ca.pem"),
)


@dataclass(frozen=True)
class HomeKeys:
    """Key material read from the home. ``repr`` shows nothing secret."""

    ca: CertKey
    server: CertKey
    control_key_pem: bytes
    secrets_key: bytes
    next_ca: CertKey | None = None
    """During a CA rollover: the new CA (it signs every new client certificate)."""
    next_server: CertKey | None = None
    """During a CA rollover: the server certificate under :attr:`next_ca`."""

    def __repr__(self) -> str:
        return f"HomeKeys(ca_hash={tls.ca_hash(self.ca.cert_pem)})"

    @property
    def ca_hash(self) -> str:
        """The pin machines use: ``sha256:<hex>``."""
        return tls.ca_hash(self.ca.cert_pem)

    @property
    def issuing_ca(self) -> CertKey:
        """The CA that signs client certificates now (the next one during a rollover)."""
        return self.next_ca or self.ca

    @property
    def ca_bundle_pem(self) -> bytes:
        """Every CA a client certificate may chain to; the pinned one first."""
        return self.ca.cert_pem + (self.next_ca.cert_pem if self.next_ca else b"")


class KeyRing:
    """The keys a serving control plane uses now; rotation swaps them while it serves.

    Readers (pairing, the link's certificate check, the TLS listeners) read
    :attr:`keys` at each use, so a rotation reaches the next join, renewal or
    handshake without a restart. :attr:`version` counts the swaps.
    """

    def __init__(self, keys: HomeKeys) -> None:
        self.keys = keys
        self.version = 0

    def __repr__(self) -> str:
        return f"KeyRing({self.keys!r}, version={self.version})"

    def replace(self, keys: HomeKeys) -> None:
        """Use ``keys`` from now on."""
        self.keys = keys
        self.version += 1


def check_home_empty(home: Path) -> None:
    """ConfigError unless ``home`` is missing or an empty folder."""
    if home.exists():
        if not home.is_dir():
            raise ConfigError("home", f"{home} exists and is not a folder")
        if any(home.iterdir()):
            raise ConfigError("home", f"{home} is not empty; refusing to initialise over it")


def create_home_keys(home: Path, server_names: tuple[str, ...] = ()) -> HomeKeys:
    """Make every key, write them 0600 in a 0700 ``home``, and return them."""
    ensure_private_dir(home)
    ca = tls.make_ca()
    server = tls.issue_server_cert(ca, server_names)
    control = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    keys = HomeKeys(ca, server, control, secrets.token_bytes(32))
    write_home_keys(home, keys)
    logger.info("home %s: keys created", home)
    return keys


def write_home_keys(home: Path, keys: HomeKeys) -> None:
    """Write ``keys`` as the home's key files (0600, each atomically) in a 0700 ``home``."""
    ensure_private_dir(home)
    contents = {
        "ca_cert": keys.ca.cert_pem,
        "ca_key": keys.ca.key_pem,
        "server_cert": keys.server.cert_pem,
        "server_key": keys.server.key_pem,
        "control_key": keys.control_key_pem,
        "secrets_key": keys.secrets_key,
    }
    for name, data in contents.items():
        write_atomic(home / _FILES[name], data, mode=0o600)
    for files, pair in ((_NEXT_CA, keys.next_ca), (_NEXT_SERVER, keys.next_server)):
        if pair is not None:
            # The certificate last: its presence is what marks a rollover (ca-next.pem).
            write_atomic(home / files[1], pair.key_pem, mode=0o600)
            write_atomic(home / files[0], pair.cert_pem, mode=0o600)


def _swap_in(home: Path, swap: tuple[tuple[str, str], ...]) -> None:
    """Rename each staged file over its destination, in order (the first commits)."""
    for src, dst in swap:
        if (home / src).exists():
            os.replace(home / src, home / dst)
    fsync_dir(home)


def _finish_begun_swaps(home: Path) -> None:
    """Complete a staged swap a crash interrupted after its commit point."""
    for swap in (_SERVER_SWAP, _RETIRE_SWAP):
        first, rest = swap[0][0], [src for src, _ in swap[1:]]
        if not (home / first).exists() and any((home / src).exists() for src in rest):
            logger.warning("home %s: finishing a key swap a crash interrupted", home)
            _swap_in(home, swap)


def _read_optional(home: Path, names: tuple[str, str]) -> CertKey | None:
    cert_path, key_path = (home / n for n in names)
    if not cert_path.exists():
        return None
    try:
        return CertKey(cert_path.read_bytes(), key_path.read_bytes())
    except OSError as e:
        raise ConfigError("home", f"cannot read {key_path}: {e.strerror}") from None


def replace_server_cert(home: Path, server: CertKey) -> None:
    """Swap a new server certificate and key into ``home`` (see the module doc)."""
    for (src, _), data in zip(_SERVER_SWAP, (server.key_pem, server.cert_pem), strict=True):
        write_atomic(home / src, data, mode=0o600)
    # COMMIT POINT: the first rename of _swap_in (finished at load if interrupted).
    _swap_in(home, _SERVER_SWAP)


def start_ca_rollover(home: Path, next_ca: CertKey, next_server: CertKey) -> None:
    """Write the ``*-next`` files; ``ca-next.pem``, written last, commits the rollover."""
    contents = (
        ("server-next.key", next_server.key_pem),
        ("server-next.pem", next_server.cert_pem),
        ("ca-next.key", next_ca.key_pem),
        ("ca-next.pem", next_ca.cert_pem),
    )
    for name, data in contents:
        write_atomic(home / name, data, mode=0o600)


def abort_ca_rollover(home: Path) -> None:
    """Undo :func:`start_ca_rollover` (``ca-next.pem`` first: no rollover from then on)."""
    for name in ("ca-next.pem", "ca-next.key", "server-next.pem", "server-next.key"):
        (home / name).unlink(missing_ok=True)
    fsync_dir(home)


def finish_ca_rollover(home: Path) -> None:
    """Make the next CA and its server certificate the current ones (old CA retired)."""
    if not (home / "ca-next.pem").exists():
        raise ConfigError("home", "no CA rollover in progress")
    _swap_in(home, _RETIRE_SWAP)


def load_home_keys(home: Path) -> HomeKeys:
    """Read the keys ``init`` wrote; ConfigError naming a missing or unreadable file."""
    if home.is_dir():
        _finish_begun_swaps(home)
    data: dict[str, bytes] = {}
    for name, filename in _FILES.items():
        path = home / filename
        try:
            data[name] = path.read_bytes()
        except OSError as e:
            raise ConfigError("home", f"cannot read {path}: {e.strerror}") from None
    if len(data["secrets_key"]) != 32:
        raise ConfigError("home", "secrets.key must be 32 bytes")
    return HomeKeys(
        ca=CertKey(data["ca_cert"], data["ca_key"]),
        server=CertKey(data["server_cert"], data["server_key"]),
        control_key_pem=data["control_key"],
        secrets_key=data["secrets_key"],
        next_ca=_read_optional(home, _NEXT_CA),
        next_server=_read_optional(home, _NEXT_SERVER) if (home / _NEXT_CA[0]).exists() else None,
    )


def load_ca_cert(home: Path) -> bytes:
    """Only the CA certificate (what the CLI needs to trust the daemon)."""
    path = home / _FILES["ca_cert"]
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError("home", f"cannot read {path}: {e.strerror}") from None
