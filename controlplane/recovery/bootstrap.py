"""``agents-control init``: make a new control plane's keys, config and first credential."""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import dataclass
from typing import Any

from controlplane.access.accounts import AccountService
from controlplane.access.authz import CredentialService
from controlplane.config import ControlConfig
from controlplane.integrity.audit import Auditor
from controlplane.integrity.keys import check_home_empty, create_home_keys
from controlplane.integrity.opening import open_control_store
from controlplane.integrity.records import credential_key
from controlplane.integrity.trusted import DEPLOYMENT_KEY, deployment_marker, open_trusted_store
from controlplane.recovery.fencing import new_home_id, write_home_id
from controlplane.recovery.keybundle import reseal_key_bundle, write_recovery_public_key
from shared.atomic import write_atomic
from shared.crypto import BoxKeyPair
from shared.errors import InvalidArgument, InvalidState, NotFound, PreconditionFailed
from shared.ids import new_id
from shared.store import S3Config
from shared.store.base import ObjectStore
from shared.store.url import parse_store_url

__all__ = [
    "DEPLOYMENT_KEY",
    "InitResult",
    "init_control_plane",
    "recovery_public_key_for",
    "toml_dumps",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InitResult:
    """What ``init`` shows the operator once."""

    operator_credential: str
    ca_hash: str
    recovery_private_key: bytes | None = None
    """The operator recovery key init made (folder store, none given): shown once."""
    deployment_id: str = ""


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    # A JSON string with only ASCII escapes is a valid TOML basic string.
    return json.dumps(str(value), ensure_ascii=True)


def toml_dumps(values: dict[str, Any]) -> str:
    """A flat table of scalars and lists as TOML text."""
    lines = ["# agents-control configuration (written by init; flags and env override it)"]
    lines += [f"{key} = {_toml_value(value)}" for key, value in sorted(values.items())]
    return "\n".join(lines) + "\n"


def recovery_public_key_for(cfg: ControlConfig, given: bytes | None) -> tuple[bytes, bytes | None]:
    """(public key to seal the bundle to, private key to show once or None)."""
    if given is not None:
        return given, None
    if isinstance(parse_store_url(cfg.store_url), S3Config):
        # A bucket outlives the host: its bundle must open with a key kept elsewhere.
        raise InvalidArgument(
            "recovery_public_key",
            "required with an S3 store: make one with `agents-control recovery-key new "
            "--out FILE` and give its public key",
        )
    made = BoxKeyPair.generate()
    return made.public_key, made.private_key


async def init_control_plane(
    cfg: ControlConfig, recovery_public_key: bytes | None = None
) -> InitResult:
    """Refuse a non-empty home or an initialised store; make keys, config, credential,
    and the key bundle sealed to the operator's recovery key.

    Raises InvalidArgument("store", ...) when no store is given: missing input,
    which the CLI reports as a usage error (exit 2). ``recovery_public_key`` is
    required for an S3 store; for a folder store one is made when not given
    and its private half returned (shown once).
    """
    if not cfg.store_url:
        raise InvalidArgument("store", "required: give --store s3://bucket/prefix or a folder")
    public, private = recovery_public_key_for(cfg, recovery_public_key)
    check_home_empty(cfg.home)
    raw = await open_control_store(cfg, None)
    try:
        # Checked before any key is made, so a refused init leaves the home empty.
        await raw.head(DEPLOYMENT_KEY)
    except NotFound:
        pass
    else:
        raise InvalidState(
            "init",
            "the store already holds a control plane (if its keys are lost: init --adopt)",
        )
    finally:
        await raw.close()
    keys = create_home_keys(cfg.home, cfg.server_names)
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        write_atomic(cfg.config_path, toml_dumps(cfg.file_values()).encode(), mode=0o600)
        store = trusted.store
        auditor = Auditor(store)
        creds = CredentialService(store, AccountService(store, auditor), auditor)
        made = await creds.create_operator()
        deployment_id = new_id("deployment")
        write_home_id(cfg.home, new_home_id())
        write_recovery_public_key(cfg.home, public)
        # Before the marker: a deployment that exists always has its bundle.
        # Below the guard: it would take the missing marker for a swapped store.
        await _seal_new_bundle(cfg, trusted.authenticated, deployment_id, public)
        marker = deployment_marker(keys, dt.datetime.now(dt.UTC), deployment_id)
        try:
            # COMMIT POINT of init: the marker is written last, so a store without it
            # holds no deployment (serve refuses it) whatever a crash left before.
            # MAC'd like every object: only this home's key can write a valid marker.
            await trusted.authenticated.put(DEPLOYMENT_KEY, marker, if_none_match=True)
        except PreconditionFailed:
            # Another init won the race: our credential names nothing; take it back.
            await store.delete(credential_key(made.credential.credential_id))
            raise InvalidState("init", "the store already holds a control plane") from None
    finally:
        await trusted.close()
    logger.info("initialised control plane in %s", cfg.home)
    return InitResult(made.value, keys.ca_hash, private, deployment_id)


async def _seal_new_bundle(
    cfg: ControlConfig, store: ObjectStore, deployment_id: str, public: bytes
) -> None:
    try:
        await reseal_key_bundle(
            cfg.home,
            store,
            deployment_id=deployment_id,
            recovery_public_key=public,
        )
    except PreconditionFailed:
        raise InvalidState("init", "the store already holds a control plane") from None
