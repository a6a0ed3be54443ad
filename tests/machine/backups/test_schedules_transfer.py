"""Schedules in backups and exports: they come back on a new machine, paused."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from machine.app import Machine, open_machine
from machine.backups.engine import BackupEngine
from machine.backups.restore import restore_fetched
from machine.backups.source import DatabaseBackupSource
from machine.backups.transfer import export_agents, import_archive
from machine.config import MachineConfig
from machine.models import RunState
from machine.schedules.service import SchedulesService
from shared.backup_target import StoreTarget
from shared.crypto import BoxKeyPair
from shared.store.folder import FolderStore
from tests.helpers.runs import wait_for_state


def _config(root: Path) -> MachineConfig:
    return MachineConfig(
        data_dir=root, background_loops=False, scheduler=False, shutdown_grace_seconds=0
    ).validate()


def _service(m: Machine) -> SchedulesService:
    assert m.schedules is not None
    return m.schedules


async def _agent_with_schedules(m: Machine, tmp: Path) -> tuple[str, list[str], str]:
    """An agent with two schedules, one of which fired once; (agent, schedules, run)."""
    agent = (await m.agents.create(name="nightly", folder=str(tmp))).id
    svc = _service(m)
    first = await svc.create(agent, "0 3 * * *", "check deps", time_zone="Europe/Berlin")
    second = await svc.create(agent, "0 7 * * 1-5", "summary", missed="once")
    assert m.scheduler is not None
    assert await m.scheduler.fire(first, 1_800_000_000.0, "fired")
    [fire] = await svc.runs(first.id)
    await wait_for_state(m, fire.run_id, RunState.FINISHED)
    return agent, [first.id, second.id], fire.run_id


async def _check_restored(m: Machine, agent: str, schedules: list[str], run_id: str) -> None:
    svc = _service(m)
    got = await svc.list(agent)
    assert [s.id for s in got] == schedules
    assert all(not s.enabled for s in got), "restored schedules come back paused"
    assert [(s.cron, s.time_zone, s.prompt) for s in got][0] == (
        "0 3 * * *",
        "Europe/Berlin",
        "check deps",
    )
    assert got[1].missed == "once"
    [fire] = await svc.runs(schedules[0])
    assert (fire.fire_time, fire.run_id, fire.result) == (1_800_000_000.0, run_id, "fired")
    assert (await m.runs.get_run(run_id)).state is RunState.FINISHED
    # Paused, archived: nothing fires until a person unarchives and resumes.
    assert m.scheduler is not None
    assert await m.scheduler.fire_due() is None


async def test_backup_then_restore_on_a_new_machine_brings_schedules_back_paused(
    tmp_path: Path,
) -> None:
    machine_key, recovery = BoxKeyPair.generate(), BoxKeyPair.generate()
    async with open_machine(_config(tmp_path / "old")) as old:
        agent, schedules, run_id = await _agent_with_schedules(old, tmp_path)
        engine = BackupEngine(
            DatabaseBackupSource(old.db, old.config.attachments_dir, tmp_path / "work"),
            StoreTarget(FolderStore(tmp_path / "target")),
            machine_id=old.ids.canonical,
            naming_key=os.urandom(32),
            recipients=[machine_key.public_key, recovery.public_key],
            keypair=machine_key,
            work_dir=tmp_path / "work",
        )
        await engine.backup_now()
        # A schedule change alone is a change of the agent's segment.
        await _service(old).set_enabled(schedules[1], False)
        made = await engine.backup_now()
        assert made.uploaded >= 1, "pausing a schedule is backed up"
        assert (await engine.backup_now()).uploaded == 0
    async with open_machine(_config(tmp_path / "new")) as new:
        fetched = await engine.fetch(made.backup_id, tmp_path / "fetch", recovery)
        result = await restore_fetched(
            new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
        )
        assert result.restored == (agent,)
        await _check_restored(new, agent, schedules, run_id)


async def test_export_then_import_carries_schedules_paused(tmp_path: Path) -> None:
    archive = tmp_path / "out.tar.gz"
    async with open_machine(_config(tmp_path / "a")) as a:
        agent, schedules, run_id = await _agent_with_schedules(a, tmp_path)
        await export_agents(
            a.db,
            [agent],
            archive,
            machine_id=a.ids.canonical,
            attachments_dir=a.config.attachments_dir,
            now=1.0,
        )
    async with open_machine(replace(_config(tmp_path / "b"))) as b:
        result = await import_archive(
            b.db,
            archive,
            staging_dir=tmp_path / "incoming",
            attachments_dir=b.config.attachments_dir,
            erased=set(),
        )
        assert result.restored == (agent,)
        svc = _service(b)
        got = await svc.list(agent)
        assert [s.id for s in got] == schedules and not any(s.enabled for s in got)
        [fire] = await svc.runs(schedules[0])
        assert fire.run_id == run_id
