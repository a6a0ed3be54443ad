"""open_machine builds the backup service: metrics on the daemon's registry, status, restart."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest

from machine.app import open_machine
from machine.backups.targets.bucket import BucketTarget
from machine.backups.targets.control_plane import ControlPlaneTarget
from machine.backups.targets.folder import check_backup_folder
from machine.backups.wiring import backup_warnings, continuous_interval
from machine.config import MachineConfig
from machine.link.client import LinkClient
from machine.metrics import MachineMetrics
from shared.backup_target import StoreTarget
from shared.errors import ConfigError, InvalidArgument
from shared.metrics import new_registry
from shared.store.folder import FolderStore
from shared.store.url import StoreOptions


def _config(root: Path, keep: int = 3) -> MachineConfig:
    return MachineConfig(
        data_dir=root, background_loops=False, shutdown_grace_seconds=0, backup_keep=keep
    ).validate()


def _value(metrics: MachineMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name)


async def test_backup_metrics_and_status_survive_a_restart(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "d", keep=2)
    metrics = MachineMetrics(new_registry())
    async with open_machine(cfg, metrics=metrics) as m:
        backups = m.require_backups()
        assert _value(metrics, "agents_machine_backup_last_success_timestamp_seconds") == 0
        result = await backups.backup_now()
        check = await backups.restore_check()
        assert check.ok, check.problem
        assert _value(metrics, "agents_machine_restore_check_ok") == 1
        status = backups.status()
        assert status.last_backup_id == result.backup_id and status.keep == 2
        assert str(cfg.backups_dir) in status.target
        # The default folder is in the data folder: the same device.
        assert any("same device" in w for w in status.warnings)
        assert any("no recovery key" in w for w in status.warnings)
    assert (cfg.backups_dir / "machine.json").is_file()
    metrics = MachineMetrics(new_registry())
    async with open_machine(cfg, metrics=metrics) as m:
        # A restarted daemon knows its last backup (else BackupTooOld would fire).
        last = _value(metrics, "agents_machine_backup_last_success_timestamp_seconds")
        assert last is not None and last > 0
        assert m.require_backups().status().last_backup_id == result.backup_id


async def test_a_recovery_key_made_while_running_seals_later_backups(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "d")
    async with open_machine(cfg) as m:
        backups = m.require_backups()
        pair = backups.create_recovery_key()
        assert backups.status().recovery_key
        made = await backups.backup_now()
        manifest = await backups.engine.open(made.backup_id, pair)
        assert manifest.backup_id == made.backup_id


async def test_a_joined_machine_is_not_warned_about_a_backup_folder_it_does_not_use(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path / "d")
    folder = StoreTarget(FolderStore(cfg.backups_dir))
    assert any("same device" in w for w in backup_warnings(cfg, folder))
    # Backups of a joined machine go to the control plane, off this disk.
    client = LinkClient(grpc.aio.insecure_channel("127.0.0.1:1"))
    try:
        assert backup_warnings(cfg, ControlPlaneTarget(client)) == ()
    finally:
        await client.aclose()


def test_backup_folder_refusals_leave_the_folder_as_it_was(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "keys").mkdir(parents=True)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    (home / ".notes.tmp").write_text("someone's")  # a stale temp name: swept in a store
    refusals = {
        a_file: "not a folder",
        data: "holds the data folder",
        tmp_path: "holds the data folder",
        data / "keys" / "b": "inside the keys folder",
        data / "attachments": "one of the daemon's own folders",
        data / "backup-work" / "b": "one of the daemon's own folders",
        home: "not empty and not a backup folder",
    }
    for folder, why in refusals.items():
        with pytest.raises(ConfigError, match=why):
            check_backup_folder(folder, data)
    assert (home / ".notes.tmp").exists() and (home.stat().st_mode & 0o777) == 0o755
    # Accepted: new, empty, or a backup folder already.
    check_backup_folder(tmp_path / "new" / "backups", data)
    check_backup_folder(data / "backups", data)
    (tmp_path / "empty").mkdir()
    check_backup_folder(tmp_path / "empty", data)
    # A new disk's root, and a first start that stopped before writing machine.json.
    disk = tmp_path / "disk"
    (disk / "lost+found").mkdir(parents=True)
    (disk / ".lock").write_text("")
    (disk / ".machine.json.0123456789ab.tmp").write_text("{")
    check_backup_folder(disk, data)
    (home / "machine.json").write_text("{}")
    check_backup_folder(home, data)


async def test_from_a_folder_that_is_not_a_backup_folder_changes_nothing(tmp_path: Path) -> None:
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True, mode=0o755)
    os.chmod(other, 0o755)
    stale = other / "sub" / ".important.tmp"
    stale.write_text("keep")
    old = time.time() - 3 * 3600
    os.utime(stale, (old, old))
    async with open_machine(_config(tmp_path / "d")) as m:
        with pytest.raises(InvalidArgument, match="not a backup folder"):
            async with m.backups_at(str(other)):
                pass
    assert stale.exists() and (other.stat().st_mode & 0o777) == 0o755


async def test_a_backup_folder_that_cannot_be_made_stops_the_start_with_its_reason(
    tmp_path: Path,
) -> None:
    (tmp_path / "file").write_text("x")
    cfg = MachineConfig(
        data_dir=tmp_path / "d",
        background_loops=False,
        shutdown_grace_seconds=0,
        backup_dir=tmp_path / "file" / "backups",
    ).validate()
    with pytest.raises(ConfigError, match="cannot be made or opened"):
        async with open_machine(cfg):
            pass


def test_increments_go_to_a_store_off_the_machine_not_to_a_folder(tmp_path: Path) -> None:
    cfg = MachineConfig(data_dir=tmp_path / "data", backup_interval=45)
    folder = StoreTarget(FolderStore(tmp_path / "backups"))
    bucket = BucketTarget("s3://b/p", StoreOptions(), where="bucket s3://b/p", owner="mc_1")
    assert continuous_interval(cfg, bucket) == 45
    assert continuous_interval(cfg, folder) is None
