"""The control plane's key bundle: every key of the home, sealed to the recovery key.

``cp/keys.sealed`` in the store holds the CA, the server TLS key and
certificate, the control key and the secrets key, sealed
(:func:`shared.crypto.seal_bytes`) to the operator's recovery public key
alone. The control plane cannot open it (it does not hold the recovery
private key); the operator can, offline, and ``agents-control restore``
rebuilds a home from it. The deployment id is associated data, so a bundle
copied into another deployment's store does not open there.

In the store the sealed bundle travels in a small envelope (:class:`StoredBundle`)
that also names the recovery public key it is sealed to and a keyed digest of
the plaintext, and is MAC'd like every control-plane object. So the control
plane can tell whether the stored bundle still matches its home without
opening it, and someone who can only write to the bucket cannot swap in their
own public key to have the next reseal hand them the keys.
:func:`reseal_key_bundle` is the one function that writes it (``init``, the
start of ``serve``, and after any key rotation).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from controlplane.config import CONFIG_FILE
from controlplane.integrity.keys import HomeKeys, load_home_keys
from controlplane.integrity.trusted import DEPLOYMENT_KEY, marker_deployment_id
from shared.atomic import write_atomic
from shared.crypto import (
    BoxKeyPair,
    decode_public_key,
    encode_public_key,
    open_bytes,
    seal_bytes,
)
from shared.errors import (
    IntegrityError,
    InvalidArgument,
    InvalidState,
    NotFound,
    PreconditionFailed,
)
from shared.store.base import ObjectStore
from shared.tls import CertKey

__all__ = [
    "BUNDLE_KEY",
    "BUNDLE_VERSION",
    "KeyBundle",
    "StoredBundle",
    "bundle_digest",
    "home_bundle",
    "open_bundle",
    "read_recovery_public_key",
    "reseal_key_bundle",
    "seal_bundle",
    "write_recovery_public_key",
]

logger = logging.getLogger(__name__)

#: Where the sealed bundle lives in the store (relative to the deployment prefix).
BUNDLE_KEY: Final = "cp/keys.sealed"
BUNDLE_VERSION: Final = 1
_AAD: Final = b"agents.cp.keys.v1:"
_PEM_FIELDS: Final = ("ca_cert", "ca_key", "server_cert", "server_key", "control_key")
_ENVELOPE_FORMAT: Final = "agents-cp-keys/1"
_DIGEST_INFO: Final = b"agents.cp.keys-digest.v1"
#: The recovery public key, in the home (so a lost or damaged bundle can be sealed again).
RECOVERY_PUBLIC_FILE: Final = "recovery.pub"
#: Attempts at the compare-and-swap of the stored bundle before giving up.
_RESEAL_ATTEMPTS: Final = 3


@dataclass(frozen=True)
class KeyBundle:
    """The keys a home holds, and the deployment they belong to. ``repr`` shows no key."""

    deployment_id: str
    keys: HomeKeys
    version: int = BUNDLE_VERSION
    config_toml: bytes = b""
    """The home's config.toml (restore writes it back, with the store it was given)."""

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
        # During a CA rollover the next CA signs every new machine certificate:
        # a restore without it would strand the machines that already renewed.
        for name, pair in (("next_ca", k.next_ca), ("next_server", k.next_server)):
            if pair is not None:
                fields[f"{name}_cert"] = pair.cert_pem.decode()
                fields[f"{name}_key"] = pair.key_pem.decode()
        if self.config_toml:
            fields["config_toml"] = self.config_toml.decode()
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
            next_ca=_optional_pair(data, "next_ca", what),
            next_server=_optional_pair(data, "next_server", what),
        )
        config = data.get("config_toml", "")
        if not isinstance(config, str):
            raise IntegrityError(what, "config_toml is not text")
        return cls(deployment, keys, config_toml=config.encode())


def _optional_pair(data: dict[str, Any], name: str, what: str) -> CertKey | None:
    """The ``*-next`` certificate and key of a rollover in progress, when the bundle has them."""
    cert, key = data.get(f"{name}_cert"), data.get(f"{name}_key")
    if cert is None and key is None:
        return None
    if not isinstance(cert, str) or not isinstance(key, str):
        raise IntegrityError(what, f"{name} must have a certificate and a key")
    return CertKey(cert.encode(), key.encode())


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


def bundle_digest(bundle: KeyBundle) -> str:
    """A digest of the bundle's plaintext keyed by its own secrets key.

    Equal digests mean equal bundles; the digest tells someone without the
    secrets key nothing about the keys.
    """
    key = hmac.new(bundle.keys.secrets_key, _DIGEST_INFO, hashlib.sha256).digest()
    return hmac.new(key, bundle.to_json(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class StoredBundle:
    """What ``cp/keys.sealed`` holds (inside the store's MAC): the sealed bundle,
    the recovery public key it is sealed to, and :func:`bundle_digest`."""

    recovery_public_key: bytes
    digest: str
    sealed: bytes

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": _ENVELOPE_FORMAT,
                "recovery_public_key": encode_public_key(self.recovery_public_key),
                "digest": self.digest,
                "sealed": base64.b64encode(self.sealed).decode(),
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def parse(cls, raw: bytes) -> StoredBundle:
        """IntegrityError naming what is wrong with a stored envelope."""
        what = BUNDLE_KEY
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise IntegrityError(what, "not valid JSON") from None
        if not isinstance(data, dict) or data.get("format") != _ENVELOPE_FORMAT:
            raise IntegrityError(what, f"not a {_ENVELOPE_FORMAT} envelope")
        try:
            public = decode_public_key(str(data.get("recovery_public_key", "")))
            sealed = base64.b64decode(str(data.get("sealed", "")), validate=True)
        except (InvalidArgument, ValueError):
            raise IntegrityError(what, "recovery_public_key or sealed is malformed") from None
        digest = data.get("digest")
        if not isinstance(digest, str) or not sealed:
            raise IntegrityError(what, "digest or sealed missing")
        return cls(public, digest, sealed)


def write_recovery_public_key(home: Path, public: bytes) -> None:
    """Record the recovery public key in ``home`` (not secret; 0600 like the rest)."""
    text = encode_public_key(public) + "\n"
    write_atomic(home / RECOVERY_PUBLIC_FILE, text.encode(), mode=0o600)


def read_recovery_public_key(home: Path) -> bytes | None:
    """The recovery public key the home names, None when it names none."""
    try:
        text = (home / RECOVERY_PUBLIC_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidState(f"home {home}", f"{RECOVERY_PUBLIC_FILE} is unreadable: {e}") from None
    try:
        return decode_public_key(text)
    except InvalidArgument as e:
        raise InvalidState(f"home {home}", f"{RECOVERY_PUBLIC_FILE}: {e.reason}") from None


def home_bundle(home: Path, deployment_id: str) -> KeyBundle:
    """The bundle of what ``home`` holds now: its keys and its config.toml."""
    keys = load_home_keys(home)
    try:
        config = (home / CONFIG_FILE).read_bytes()
    except FileNotFoundError:
        config = b""
    return KeyBundle(deployment_id, keys, config_toml=config)


async def reseal_key_bundle(
    home: Path,
    store: ObjectStore,
    *,
    deployment_id: str | None = None,
    recovery_public_key: bytes | None = None,
) -> bool:
    """Seal ``home``'s current keys to ``cp/keys.sealed`` unless it already holds them.

    The one writer of the bundle: ``init``, the start of ``serve``, and anything
    that changes a key of the home calls it afterwards (idempotent, cheap when
    nothing changed: one HEAD and one GET). ``store`` is the control plane's
    MAC'd store (the trusted stack). ``deployment_id`` defaults to the one
    ``cp/deployment.json`` names. The recovery public key is the one given
    (``init``), else the home's ``recovery.pub``, else (a home from before that
    file) the one the stored envelope names. The write is a compare-and-swap
    on the envelope's etag (create-only when there is none), so two writers
    never lose a change. Returns True when it wrote.

    With a public key from the caller or the home, a missing or unverifiable
    envelope is simply replaced (a crashed init's leftover, a deleted or
    damaged bundle). Without one: InvalidState when there is no bundle, and
    IntegrityError when the envelope does not verify under this home's key.
    """
    if deployment_id is None:
        deployment_id = marker_deployment_id(await store.get(DEPLOYMENT_KEY))
    if recovery_public_key is None:
        recovery_public_key = read_recovery_public_key(home)
    replace_unverified = recovery_public_key is not None
    for _ in range(_RESEAL_ATTEMPTS):
        etag: str | None
        current: StoredBundle | None = None
        try:
            etag = (await store.head(BUNDLE_KEY)).etag
            try:
                current = StoredBundle.parse(await store.get(BUNDLE_KEY))
            except IntegrityError:
                if not replace_unverified:
                    raise
        except NotFound:
            etag = None
        public = recovery_public_key
        if public is None:
            if current is None:
                raise InvalidState(
                    "key bundle",
                    f"{BUNDLE_KEY} is missing and no recovery public key was given",
                )
            public = current.recovery_public_key
        bundle = home_bundle(home, deployment_id)
        digest = bundle_digest(bundle)
        if current is not None and (current.digest, current.recovery_public_key) == (
            digest,
            public,
        ):
            return False
        envelope = StoredBundle(public, digest, seal_bundle(bundle, public)).to_json()
        try:
            if etag is None:
                await store.put(BUNDLE_KEY, envelope, if_none_match=True)
            else:
                await store.put(BUNDLE_KEY, envelope, if_match=etag)
        except PreconditionFailed:
            continue  # changed under us (another writer): read again and compare
        logger.info("%s: key bundle sealed (%s)", BUNDLE_KEY, bundle.keys.ca_hash)
        return True
    raise InvalidState("key bundle", f"{BUNDLE_KEY} keeps changing under us; try again")
