"""``agents-control init --adopt``: new keys over an existing store, when the old keys are lost.

When the home is gone and no sealed key bundle can bring it back, the store
still holds everything that matters: accounts, machines, queued prompts (sealed
to the machines' box keys) and backups (sealed to the machines' and accounts'
keys). Adopting keeps all of it and starts a new CA, control key and
secrets-key:

1. Refused unless the store holds a control plane (``cp/deployment.json``) and
   the home is empty; nothing is written before both checks.
2. The new keys and config are made in a staging folder beside the home.
3. Every MAC'd object is authenticated again under the new key. The old MAC
   cannot be checked (its key is lost): adopting trusts the store as it is,
   which is the operator's explicit decision. Objects already under the new key
   (a resumed adopt) are left alone; backup segments are authenticated by
   their manifests and are not MAC'd, so they are not touched (manifests are).
4. The staged home takes over the deployment's fencing epoch
   (controlplane.recovery.fencing): a control plane still running on the lost keys, or
   brought back later, can write nothing from here on.
5. A new operator credential is made (old credentials stay valid: only their
   hashes are stored), and the new keys are sealed to the operator's recovery
   public key in ``cp/keys.sealed`` (as ``init`` does), bound to the
   deployment's id, which adopting keeps.
6. COMMIT POINT: the deployment marker, rewritten under the new key naming the
   new CA. Before it, a crashed adopt is simply run again (the staging folder
   is made afresh); after it, only the home remains to be moved into place.
7. The staging folder becomes the home.

Machines do not trust the new CA: each re-pairs with a repair token
(``agents-control machine repair M``), keeping its id, agents and backups.
Provider secrets were sealed with the lost secrets-key: set each machine's
provider again (their count is reported).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import shutil
from dataclasses import dataclass

from controlplane.access.accounts import AccountService
from controlplane.access.authz import CredentialService
from controlplane.config import ControlConfig
from controlplane.integrity.audit import Auditor
from controlplane.integrity.keys import check_home_empty, create_home_keys
from controlplane.integrity.opening import open_control_store
from controlplane.integrity.trusted import (
    DEPLOYMENT_KEY,
    deployment_marker,
    marker_deployment_id,
    open_trusted_store,
    record_mac_key,
)
from controlplane.recovery.bootstrap import recovery_public_key_for, toml_dumps
from controlplane.recovery.fencing import Fence, new_home_id, write_home_id
from controlplane.recovery.keybundle import reseal_key_bundle, write_recovery_public_key
from shared.atomic import fsync_dir, write_atomic
from shared.errors import IntegrityError, InvalidArgument, InvalidState, NotFound
from shared.store.authenticated import MAC_HEADER, seal, unseal, unverified_payload
from shared.store.base import ObjectStore

__all__ = ["AdoptResult", "adopt_control_plane"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdoptResult:
    """What ``init --adopt`` shows the operator once."""

    operator_credential: str
    ca_hash: str
    objects_adopted: int
    """MAC'd objects authenticated again under the new key."""
    provider_secrets_lost: int
    """Machine providers whose sealed settings the lost key held (set them again)."""
    recovery_private_key: bytes | None = None
    """The operator recovery key adopting made (folder store, none given): shown once."""


def _unmacd(key: str) -> bool:
    """Objects the control plane never MACs: backup segments (their manifest
    authenticates them), ``accounts/<a>/backups/<m>/segments/<name>``."""
    parts = key.split("/")
    return (
        len(parts) == 6
        and parts[0] == "accounts"
        and parts[2] == "backups"
        and parts[4] == "segments"
    )


async def _re_mac(store: ObjectStore, mac_key: bytes) -> tuple[int, int]:
    """Authenticate every MAC'd object again under ``mac_key``: (adopted, providers)."""
    adopted = providers = 0
    async for info in store.list(""):
        key = info.key
        if _unmacd(key) or key == DEPLOYMENT_KEY:
            continue
        try:
            stored = await store.get(key)
        except NotFound:
            continue  # deleted since the listing
        if not stored.startswith(MAC_HEADER):
            continue  # not ours to vouch for (a probe, a foreign object)
        try:
            unseal(mac_key, key, stored)
            continue  # already adopted (a resumed run)
        except IntegrityError:
            pass
        await store.put(key, seal(mac_key, key, unverified_payload(stored)))
        adopted += 1
        if key.split("/")[2:3] == ["providers"]:
            providers += 1
    return adopted, providers


async def adopt_control_plane(
    cfg: ControlConfig, recovery_public_key: bytes | None = None
) -> AdoptResult:
    """New keys over an existing store (see the module doc).

    ``recovery_public_key`` as for ``init``: required with an S3 store; with a
    folder store one is made when not given and its private half returned.
    """
    if not cfg.store_url:
        raise InvalidArgument("store", "required: give --store s3://bucket/prefix or a folder")
    public, private = recovery_public_key_for(cfg, recovery_public_key)
    check_home_empty(cfg.home)
    raw = await open_control_store(cfg, None)
    try:
        try:
            old_marker = await raw.get(DEPLOYMENT_KEY)
        except NotFound:
            raise InvalidState(
                "init --adopt",
                "the store holds no control plane to adopt; run init without --adopt",
            ) from None
        stage = cfg.home.parent / f".{cfg.home.name}.adopting"
        await asyncio.to_thread(shutil.rmtree, stage, True)  # a crashed adopt's leftovers
        keys = await asyncio.to_thread(create_home_keys, stage, cfg.server_names)
        write_atomic(
            stage / cfg.config_path.name, toml_dumps(cfg.file_values()).encode(), mode=0o600
        )
        adopted, providers = await _re_mac(raw, record_mac_key(keys))
    finally:
        await raw.close()
    # The deployment keeps its id (machines' backups and the bundle are bound
    # to it). Its MAC cannot be checked (the old key is lost): see step 3.
    payload = old_marker[old_marker.find(b"\n") + 1 :]
    deployment_id = marker_deployment_id(payload)
    home_id = new_home_id()
    write_home_id(stage, home_id)
    write_recovery_public_key(stage, public)
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        fence = Fence(trusted.authenticated, home_id, trusted.where, home=stage)
        epoch = await fence.acquire(take_over=True)
        store = trusted.store
        auditor = Auditor(store)
        made = await CredentialService(
            store, AccountService(store, auditor), auditor
        ).create_operator()
        await reseal_key_bundle(
            stage, trusted.authenticated, deployment_id=deployment_id, recovery_public_key=public
        )
        # COMMIT POINT: the marker under the new key, naming the new CA.
        await trusted.authenticated.put(
            DEPLOYMENT_KEY, deployment_marker(keys, dt.datetime.now(dt.UTC), deployment_id)
        )
        await auditor.record(made.credential.credential_id, "keys.adopt", "deployment")
    finally:
        await trusted.close()
    if cfg.home.exists():
        cfg.home.rmdir()  # empty (checked above): rename needs it gone
    os.rename(stage, cfg.home)
    fsync_dir(cfg.home.parent)
    logger.info("adopted home %s holds fencing epoch %d", cfg.home, epoch)
    logger.warning(
        "adopted the store with new keys (CA %s): %d objects re-authenticated; machines "
        "must re-pair (`agents-control machine repair`)",
        keys.ca_hash,
        adopted,
    )
    return AdoptResult(made.value, keys.ca_hash, adopted, providers, private)
