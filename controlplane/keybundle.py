"""The control plane's key bundle: every key of the home, sealed to the recovery key.

``cp/keys.sealed`` in the store holds the CA, the server TLS key and
certificate, the control key and the secrets key, sealed
(:func:`shared.crypto.seal_bytes`) to the operator's recovery public key
alone. The control plane cannot open it (it does not hold the recovery
private key); the operator can, offline, and ``agents-control restore``
rebuilds a home from it. The deployment id is associated data, so a bundle
copied into another deployment's store does not open there.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from typing import Any, Final

from controlplane.keys import HomeKeys
from shared.crypto import BoxKeyPair, open_bytes, seal_bytes
from shared.errors import IntegrityError
from shared.tls import CertKey

__all__ = ["BUNDLE_KEY", "BUNDLE_VERSION", "KeyBundle", "open_bundle", "seal_bundle"]

logger = logging.getLogger(__name__)

#: Where the sealed bundle lives in the store (relative to the deployment prefix).
BUNDLE_KEY: Final = "cp/keys.sealed"
BUNDLE_VERSION: Final = 1
_AAD: Final = b"agents.cp.keys.v1:"
_PEM_FIELDS: Final = ("ca_cert", "ca_key", "server_cert", "server_key", "control_key")


@dataclass(frozen=True)
class KeyBundle:
    """The keys a home holds, and the deployment they belong to. ``repr`` shows no key."""

    deployment_id: str
    keys: HomeKeys
    version: int = BUNDLE_VERSION

    def __repr__(self) -> str:
        return f"KeyBundle(deployment_id={self.deployment_id!r}, {self.keys!r})"

    def to_json(self) -> bytes:
        k = self.keys
        fields: dict[str, Any] = {
            "version": self.version,
            "deployment_id": self.deployment_id,
            "ca_cert": k.ca.cert_pem.decode(),
            "ca_key": k.ca.key_pem.decode(),
            "server_cert": k.server.cert_pem.decode(),
            "server_key": k.server.key_pem.decode(),
            "control_key": k.control_key_pem.decode(),
            "secrets_key": base64.b64encode(k.secrets_key).decode(),
        }
        return json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def parse(cls, raw: bytes, what: str) -> KeyBundle:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise IntegrityError(what, "not valid JSON") from None
        if not isinstance(data, dict) or data.get("version") != BUNDLE_VERSION:
            raise IntegrityError(what, "not a version 1 key bundle")
        deployment = data.get("deployment_id")
        if not isinstance(deployment, str) or not deployment:
            raise IntegrityError(what, "deployment_id missing")
        for name in (*_PEM_FIELDS, "secrets_key"):
            if not isinstance(data.get(name), str):
                raise IntegrityError(what, f"{name} missing")
        try:
            secrets_key = base64.b64decode(data["secrets_key"], validate=True)
        except ValueError:
            raise IntegrityError(what, "secrets_key is not base64") from None
        if len(secrets_key) != 32:
            raise IntegrityError(what, "secrets_key must be 32 bytes")
        keys = HomeKeys(
            ca=CertKey(data["ca_cert"].encode(), data["ca_key"].encode()),
            server=CertKey(data["server_cert"].encode(), data["server_key"].encode()),
            control_key_pem=data["control_key"].encode(),
            secrets_key=secrets_key,
        )
        return cls(deployment, keys)


def _aad(deployment_id: str) -> bytes:
    return _AAD + deployment_id.encode()


def seal_bundle(bundle: KeyBundle, recovery_public_key: bytes) -> bytes:
    """The bundle sealed to the operator's recovery public key only."""
    return seal_bytes(bundle.to_json(), [recovery_public_key], aad=_aad(bundle.deployment_id))


def open_bundle(blob: bytes, recovery: BoxKeyPair, deployment_id: str) -> KeyBundle:
    """Open ``cp/keys.sealed`` of ``deployment_id`` with the recovery key.

    IntegrityError when the key is not the bundle's recipient, the blob was
    altered or truncated, or it is another deployment's bundle.
    """
    what = "key bundle"
    raw = open_bytes(blob, recovery, aad=_aad(deployment_id), what=what)
    bundle = KeyBundle.parse(raw, what)
    if bundle.deployment_id != deployment_id:
        raise IntegrityError(what, "belongs to another deployment")
    return bundle
