"""The control plane's home folder: keys and config only (all state is in the store).

Layout (folder 0700, files 0600)::

    config.toml     settings written by ``init`` (no secrets)
    ca.pem ca.key   the CA machines pin and whose certificates they hold
    server.pem server.key   the TLS server certificate (SANs: localhost, 127.0.0.1, names)
    control.key     the control key (Ed25519, PKCS#8 PEM), signs control-plane statements
    secrets.key     32 random bytes that encrypt provider secrets in the store
    serve.json      written by ``serve``: the addresses it actually listens on
    instance.json   this home's id (fencing: controlplane.fencing)
    recovery.pub    the operator recovery public key the key bundle is sealed to
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from shared import tls
from shared.atomic import ensure_private_dir, write_atomic
from shared.errors import ConfigError
from shared.tls import CertKey

__all__ = [
    "HomeKeys",
    "check_home_empty",
    "create_home_keys",
    "load_home_keys",
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


@dataclass(frozen=True)
class HomeKeys:
    """Key material read from the home. ``repr`` shows nothing secret."""

    ca: CertKey
    server: CertKey
    control_key_pem: bytes
    secrets_key: bytes

    def __repr__(self) -> str:
        return f"HomeKeys(ca_hash={tls.ca_hash(self.ca.cert_pem)})"

    @property
    def ca_hash(self) -> str:
        """The pin machines use: ``sha256:<hex>``."""
        return tls.ca_hash(self.ca.cert_pem)


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


def load_home_keys(home: Path) -> HomeKeys:
    """Read the keys ``init`` wrote; ConfigError naming a missing or unreadable file."""
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
    )


def load_ca_cert(home: Path) -> bytes:
    """Only the CA certificate (what the CLI needs to trust the daemon)."""
    path = home / _FILES["ca_cert"]
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError("home", f"cannot read {path}: {e.strerror}") from None
