"""Disaster recovery: rebuild a control plane's home from its store and the recovery key.

:func:`restore_home` reads ``cp/deployment.json`` and ``cp/keys.sealed``
straight from the store (their MACs can only be checked once the keys are
out), opens the bundle with the operator's recovery key, checks both MACs
with the key it holds, then:

1. stages the new home in a temporary folder beside ``--home`` (keys,
   config.toml with the store it was given, a new home id);
2. takes the next epoch for the new home (controlplane.recovery.fencing): from here on
   the old home, running or restarted, can write nothing;
3. renames the staged folder into place. COMMIT POINT of the restore.

A crash before 3 leaves ``--home`` as it was (empty) and a stale staging
folder that the next restore removes; a crash between 2 and 3 leaves the
deployment fenced against the old home, and running the restore again
completes it. A wrong key, a damaged bundle or a store that is not a
deployment's raise before anything is written.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.config import CONFIG_FILE, ControlConfig
from controlplane.integrity.keys import check_home_empty, write_home_keys
from controlplane.integrity.opening import open_control_store
from controlplane.integrity.trusted import (
    DEPLOYMENT_KEY,
    marker_deployment_id,
    open_trusted_store,
    record_mac_key,
)
from controlplane.recovery.bootstrap import toml_dumps
from controlplane.recovery.fencing import Fence, new_home_id, write_home_id
from controlplane.recovery.keybundle import (
    BUNDLE_KEY,
    KeyBundle,
    StoredBundle,
    open_bundle,
    write_recovery_public_key,
)
from shared.atomic import fsync_dir, write_atomic
from shared.crypto import BoxKeyPair
from shared.errors import IntegrityError, InvalidArgument, InvalidState, NotFound
from shared.store.authenticated import MAC_HEADER, unseal
from shared.store.url import parse_store_url

__all__ = ["RestoreResult", "restore_home"]

logger = logging.getLogger(__name__)

_STAGING_PREFIX = ".restore-"


@dataclass(frozen=True)
class RestoreResult:
    """What ``restore`` reports."""

    home: Path
    deployment_id: str
    ca_hash: str
    epoch: int


def _unverified(stored: bytes, key: str) -> bytes:
    """The payload of a MAC'd object, not yet verified (we do not hold the key yet)."""
    end = stored.find(b"\n")
    if not stored.startswith(MAC_HEADER) or end < 0:
        raise InvalidState("restore", f"{key} is not a control-plane object")
    return stored[end + 1 :]


def _config_text(bundle: KeyBundle, cfg: ControlConfig) -> bytes:
    """The bundle's config.toml, pointed at the store the restore was given."""
    try:
        values: dict[str, Any] = tomllib.loads(bundle.config_toml.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        # The bundle is authentic, so this is a config.toml the operator broke:
        # the defaults and the restore's flags still make a working home.
        logger.warning("the key bundle's config.toml does not parse; using defaults")
        values = {}
    values["store_url"] = cfg.store_url
    if cfg.store_endpoint:
        values["store_endpoint"] = cfg.store_endpoint
    return toml_dumps(values).encode()


async def restore_home(cfg: ControlConfig, recovery: BoxKeyPair) -> RestoreResult:
    """Rebuild ``cfg.home`` from ``cfg.store_url`` (see the module doc).

    InvalidArgument("recovery_key", ...) when the key does not open the bundle
    (wrong key, or the bundle was altered); InvalidState when the store holds
    no deployment or no bundle; ConfigError for a non-empty home.
    """
    if not cfg.store_url:
        raise InvalidArgument("store", "required: give --store s3://bucket/prefix or a folder")
    home = cfg.home.absolute()
    check_home_empty(home)
    folder = parse_store_url(cfg.store_url)
    if isinstance(folder, Path) and not folder.is_dir():
        # Opening a folder store makes the folder: a typo would leave an empty one.
        raise InvalidArgument("store", f"{folder}: no such folder; restore reads an existing store")
    raw = await open_control_store(cfg, None)
    try:
        try:
            marker = await raw.get(DEPLOYMENT_KEY)
        except NotFound:
            raise InvalidState("restore", "the store holds no control plane") from None
        try:
            stored = await raw.get(BUNDLE_KEY)
        except NotFound:
            raise InvalidState(
                "restore", f"the store holds no key bundle ({BUNDLE_KEY}); it cannot be restored"
            ) from None
    finally:
        await raw.close()
    try:
        deployment_id = marker_deployment_id(_unverified(marker, DEPLOYMENT_KEY))
        envelope = StoredBundle.parse(_unverified(stored, BUNDLE_KEY))
        bundle = open_bundle(envelope.sealed, recovery, deployment_id)
        mac_key = record_mac_key(bundle.keys)
        unseal(mac_key, DEPLOYMENT_KEY, marker)
        unseal(mac_key, BUNDLE_KEY, stored)
    except IntegrityError as e:
        raise InvalidArgument(
            "recovery_key",
            f"the key bundle does not open with this recovery key ({e.message}): "
            "wrong key, or the bundle was damaged; nothing was written",
        ) from None
    parent = home.parent
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(f"{_STAGING_PREFIX}{home.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)  # a crashed restore's staging
    staging = Path(tempfile.mkdtemp(prefix=f"{_STAGING_PREFIX}{home.name}-", dir=parent))
    try:
        write_home_keys(staging, bundle.keys)
        write_atomic(staging / CONFIG_FILE, _config_text(bundle, cfg), mode=0o600)
        home_id = new_home_id()
        write_home_id(staging, home_id)
        write_recovery_public_key(staging, envelope.recovery_public_key)
        fsync_dir(staging)
        trusted = await open_trusted_store(cfg, bundle.keys, None)
        try:
            fence = Fence(trusted.authenticated, home_id, trusted.where, home=staging)
            epoch = await fence.acquire(take_over=True)
        finally:
            await trusted.close()
        # COMMIT POINT: the staged home becomes the home (an empty --home is replaced).
        staging.rename(home)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("restored %s from %s (epoch %d)", home, trusted.where, epoch)
    return RestoreResult(home, deployment_id, bundle.keys.ca_hash, epoch)
