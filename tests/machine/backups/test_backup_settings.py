"""A backup carries the machine's non-secret settings (MachineConfig.backup_settings)
and never a secret; a restore names the backed-up machine's settings that differ
from this one's, and changes none."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from machine.api import codec
from machine.app import Machine, open_machine
from machine.backups.keys import load_backup_keys, new_standalone_recovery_key
from machine.backups.service import BackupService
from machine.backups.transfer import SettingDiff
from machine.config import BACKUP_SETTINGS, FILE_KEYS, MachineConfig
from shared.backup_target import StoreTarget
from shared.store.folder import FolderStore

SECRET = "SECRET-b1d4c0ffee"
#: What a machine's environment may hold beside its settings: none may reach a backup.
ENV = {
    "AWS_ACCESS_KEY_ID": f"AKIA{SECRET}",
    "AWS_SECRET_ACCESS_KEY": f"aws-{SECRET}",
    "ANTHROPIC_API_KEY": f"sk-ant-{SECRET}",
    "AGENTS_CONTROL_CREDENTIAL": f"adm_x.{SECRET}",
    "AGENTS_MACHINE_PROMPT_LIMIT": "2MiB",
    "TZ": "Europe/Paris",
}


def _config(root: Path, **file: object) -> MachineConfig:
    root.mkdir(parents=True, exist_ok=True)
    lines = [f"{k} = {_toml(v)}" for k, v in file.items()]
    (root / "machine.toml").write_text("\n".join(lines) + "\n")
    return MachineConfig.build(
        flags={"data_dir": str(root), "background_loops": False, "shutdown_grace_seconds": 0},
        env=ENV,
        home=root.parent,
    )


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else str(value)


def _service(m: Machine, target: Path) -> BackupService:
    return BackupService(
        m.db,
        StoreTarget(FolderStore(target)),
        target_name="t",
        machine_id=m.ids.canonical,
        keys=load_backup_keys(m.config.data_dir),
        data_dir=m.config.data_dir,
        attachments_dir=m.config.attachments_dir,
        keep=m.config.backup_keep,
        daily_at=dt.time(3, 30),
        settings=m.config.backup_settings(),
    )


def test_the_settings_a_backup_carries_are_an_allow_list_of_file_keys(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "m", backup_keep=5, scheduler=False, backup_time="04:10")
    settings = cfg.backup_settings()
    assert tuple(settings) == BACKUP_SETTINGS
    assert set(BACKUP_SETTINGS) <= set(FILE_KEYS)  # each can be set again in machine.toml
    assert settings["backup_keep"] == "5"
    assert settings["scheduler"] == "false"
    assert settings["backup_time"] == "04:10"
    assert settings["prompt_limit"] == str(2 * 1024 * 1024)
    assert settings["time_zone"] == "Europe/Paris"
    text = repr(settings)
    assert SECRET not in text and str(tmp_path) not in text


async def test_a_backup_holds_the_settings_and_no_secret(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "m", backup_keep=4, event_retention_days=30)
    async with open_machine(cfg) as m:
        agent = (await m.agents.create(name="a", folder=str(tmp_path))).id
        async for _ in await m.runs.prompt(agent, "hello"):
            pass
        service = _service(m, tmp_path / "target")
        made = await service.backup_now()
        manifest = await service.engine.open(made.backup_id)
    assert manifest.settings == cfg.backup_settings()
    assert manifest.settings["event_retention_days"] == "30"
    opened = manifest.to_json()
    secrets = [SECRET.encode()]
    # Nothing of keys/ either: the local API token, the backup and link keys
    # (but the naming key, which the sealed manifest carries by design:
    # docs/formats/backup.md).
    for path in (cfg.data_dir / "keys").rglob("*"):
        if path.is_file() and path.stat().st_size >= 16 and path.name != "naming.key":
            raw = path.read_bytes()
            secrets += [raw.strip(), raw.hex().encode()]
    assert secrets[1:], "the machine made no keys"
    for secret in secrets:
        assert secret not in opened


async def test_a_restore_names_the_settings_that_differ_and_changes_none(
    tmp_path: Path,
) -> None:
    old_cfg = _config(tmp_path / "old", backup_keep=5, time_zone="Asia/Tokyo")
    async with open_machine(old_cfg) as old:
        agent = (await old.agents.create(name="a", folder=str(tmp_path))).id
        recovery = new_standalone_recovery_key(old.config.data_dir)
        service = _service(old, tmp_path / "target")
        made = await service.backup_now()
    new_cfg = _config(tmp_path / "new")
    async with open_machine(new_cfg) as new:
        fresh = BackupService(
            new.db,
            StoreTarget(FolderStore(tmp_path / "target")),
            target_name="t",
            machine_id=service.engine._machine_id,
            keys=load_backup_keys(new.config.data_dir),
            data_dir=new.config.data_dir,
            attachments_dir=new.config.attachments_dir,
            keep=3,
            daily_at=dt.time(1, 0),
            settings=new.config.backup_settings(),
        )
        result = await fresh.restore(made.backup_id, recovery=recovery)
    assert result.restored == (agent,)
    assert result.settings == (
        SettingDiff("backup_keep", "5", "3"),
        SettingDiff("time_zone", "Asia/Tokyo", "Europe/Paris"),
    )
    # The reply carries them to the CLI as they are.
    assert codec.in_result_from_pb(codec.restore_result_to_pb(result)).settings == result.settings
    # Shown, not applied: this machine's settings are its own.
    assert (tmp_path / "new" / "machine.toml").read_text() == "\n"
