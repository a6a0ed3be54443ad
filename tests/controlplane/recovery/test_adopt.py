"""``init --adopt``: new keys over an existing store keep its accounts and credentials."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from controlplane.cli.client import AdminClient
from controlplane.config import ControlConfig
from controlplane.integrity.keys import load_ca_cert, load_home_keys
from controlplane.integrity.trusted import open_trusted_store
from controlplane.machines.backups import MachineBackups, backups_prefix
from controlplane.recovery.adopt import adopt_control_plane
from controlplane.recovery.bootstrap import init_control_plane
from controlplane.recovery.restore import restore_home
from controlplane.server import ControlPlane
from shared.backup_target import segment_key
from shared.crypto import BoxKeyPair
from shared.errors import IntegrityError, InvalidArgument, InvalidState
from shared.ids import new_id
from shared.store import FolderStore


def _cfg(tmp_path: Path, store: str = "store") -> ControlConfig:
    return ControlConfig(
        home=tmp_path / "home",
        store_url=str(tmp_path / store),
        listen="127.0.0.1:0",
        link_listen="127.0.0.1:0",
        metrics_listen="",
    ).validate()


async def test_adopt_keeps_accounts_and_refuses_where_it_must(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    made = await init_control_plane(cfg)
    async with ControlPlane(cfg) as cp:
        async with AdminClient(
            f"127.0.0.1:{cp.public_port}", load_ca_cert(cfg.home), made.operator_credential
        ) as client:
            account = (await client.create_account(7, "alice")).account.account_id

    shutil.rmtree(cfg.home)  # the keys are lost
    with pytest.raises(InvalidState, match="already holds a control plane"):
        await init_control_plane(cfg)  # without --adopt: refused as before
    assert not cfg.home.exists() or not any(cfg.home.iterdir())
    with pytest.raises(InvalidState, match="no control plane to adopt"):
        await adopt_control_plane(_cfg(tmp_path, "empty-store"))

    adopted = await adopt_control_plane(cfg)
    assert adopted.ca_hash != made.ca_hash and adopted.objects_adopted > 0
    assert not list(tmp_path.glob(".home.adopting*"))
    async with ControlPlane(cfg) as cp:
        ca = load_ca_cert(cfg.home)
        for credential in (adopted.operator_credential, made.operator_credential):
            async with AdminClient(f"127.0.0.1:{cp.public_port}", ca, credential) as client:
                listed = await client.list_accounts()
                assert [a.account_id for a in listed] == [account]
    # A home in place: adopting again is refused like init.
    with pytest.raises(Exception, match="not empty"):
        await adopt_control_plane(cfg)


async def test_an_adopted_home_can_be_restored_with_its_new_recovery_key(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    made = await init_control_plane(cfg)
    assert made.deployment_id
    async with ControlPlane(cfg):
        pass
    shutil.rmtree(cfg.home)  # the keys, and with them the old recovery key's use, are lost
    adopted = await adopt_control_plane(cfg)
    assert adopted.recovery_private_key is not None  # folder store: made and shown once
    async with ControlPlane(cfg) as cp:
        assert cp.fence is not None and cp.fence.epoch >= 2  # took over the deployment
    # The adopted keys are in the bundle: a restore brings them back, same deployment.
    target = ControlConfig(
        home=tmp_path / "restored",
        store_url=cfg.store_url,
        listen="127.0.0.1:0",
        link_listen="127.0.0.1:0",
        metrics_listen="",
    ).validate()
    with pytest.raises(InvalidArgument, match="recovery_key"):
        await restore_home(target, BoxKeyPair.from_private(made.recovery_private_key or b""))
    restored = await restore_home(target, BoxKeyPair.from_private(adopted.recovery_private_key))
    assert restored.ca_hash == adopted.ca_hash
    assert restored.deployment_id == made.deployment_id


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def test_adopting_vouches_for_backup_manifests_and_leaves_segments_as_they_are(
    tmp_path: Path,
) -> None:
    cfg = _cfg(tmp_path)
    await init_control_plane(cfg)
    acct, machine, backup = new_id("account"), new_id("machine"), new_id("backup")
    name = os.urandom(32).hex()

    async def machine_backups(use: ControlConfig) -> tuple[MachineBackups, object]:
        trusted = await open_trusted_store(use, load_home_keys(use.home), None)
        assert trusted.backups is not None
        return MachineBackups(trusted.backups, records=trusted.store), trusted

    backups, trusted = await machine_backups(cfg)
    try:
        await backups.put_segment(acct, machine, name, _one(b"sealed segment"))
        await backups.put_manifest(acct, machine, backup, b"sealed manifest", [name])
    finally:
        await trusted.close()  # type: ignore[attr-defined]
    seg = backups_prefix(acct, machine) + segment_key(name)
    async with FolderStore(tmp_path / "store") as raw:
        stored_segment = await raw.get(seg)

    shutil.rmtree(cfg.home)
    await adopt_control_plane(cfg)
    backups, trusted = await machine_backups(cfg)
    try:
        # The manifest verifies under the new key (its names list too: prune keeps
        # the segment); the segment was not rewritten.
        assert await backups.get_manifest(acct, machine, backup) == b"sealed manifest"
        assert (await backups.prune(acct, machine, 1)).segments == 0
    finally:
        await trusted.close()  # type: ignore[attr-defined]
    async with FolderStore(tmp_path / "store") as raw:
        assert await raw.get(seg) == stored_segment == b"sealed segment"
    # A manifest planted after the adopt is refused like any forged record.
    async with FolderStore(tmp_path / "store") as raw:
        await raw.put(backups_prefix(acct, machine) + f"manifests/{new_id('backup')}.sealed", b"x")
    backups, trusted = await machine_backups(cfg)
    try:
        newest = (await backups.list_manifests(acct, machine))[-1].backup_id
        with pytest.raises(IntegrityError):
            await backups.get_manifest(acct, machine, newest)
    finally:
        await trusted.close()  # type: ignore[attr-defined]
