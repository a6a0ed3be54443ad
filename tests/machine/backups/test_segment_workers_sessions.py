"""Segments made by worker processes carry an agent's CLI session files as the
daemon's own do: the same bytes (so the same names), and they restore."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from machine.app import open_machine
from machine.backups.engine import BackupEngine
from machine.backups.restore import restore_fetched
from machine.backups.source import DatabaseBackupSource
from machine.backups.workers import segment_workers
from machine.config import MachineConfig
from machine.core.agents import SessionHomes
from machine.storage import tables
from shared.backup_target import StoreTarget
from shared.crypto import BoxKeyPair
from shared.ids import new_id
from shared.store.folder import FolderStore

SID = "0b7c4a52-5a7e-4a38-9c3e-2f1d7e0f9a11"
NAMING_KEY = bytes(range(32))


def _config(root: Path) -> MachineConfig:
    return MachineConfig(
        data_dir=root / "data",
        background_loops=False,
        shutdown_grace_seconds=0,
        claude_home=root / "claude",
    ).validate()


def _engine(
    source: DatabaseBackupSource, target: Path, work: Path, key: BoxKeyPair
) -> BackupEngine:
    return BackupEngine(
        source,
        StoreTarget(FolderStore(target)),
        machine_id=new_id("machine"),
        naming_key=NAMING_KEY,
        recipients=[key.public_key],
        keypair=key,
        work_dir=work,
    )


async def test_worker_segments_hold_the_same_session_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = BoxKeyPair.generate()
    settings = {"command": ["claude-code-acp"], "env": {"K": "secret-v"}, "kind": "claude"}
    async with open_machine(_config(tmp_path / "old")) as old:
        home = old.config.claude_home
        assert home is not None
        agent = await old.agents.create(
            name="a", folder=str(tmp_path), runtime="acp", settings_json=json.dumps(settings)
        )
        await old.db.write(lambda c: tables.set_session_id(c, agent.id, SID))
        (home / "projects" / "-srv").mkdir(parents=True)
        (home / "projects" / "-srv" / f"{SID}.jsonl").write_bytes(b'{"turn":1}\n')
        homes = SessionHomes(claude=home)

        def source(work: Path) -> DatabaseBackupSource:
            return DatabaseBackupSource(old.db, old.config.attachments_dir, work, homes=homes)

        here = _engine(source(tmp_path / "w1"), tmp_path / "t1", tmp_path / "w1", key)
        made_here = await here.backup_now()
        monkeypatch.setattr(segment_workers, "MIN_AGENTS", 1)
        workers = _engine(source(tmp_path / "w2"), tmp_path / "t2", tmp_path / "w2", key)
        made = await workers.backup_now()
    one = await here.open(made_here.backup_id, key)
    two = await workers.open(made.backup_id, key)
    assert sorted((r.name, r.plain_size) for r in one.segments) == sorted(
        (r.name, r.plain_size) for r in two.segments
    )
    async with open_machine(_config(tmp_path / "new")) as new:
        assert new.config.claude_home is not None
        fetched = await workers.fetch(made.backup_id, tmp_path / "fetch", key)
        await restore_fetched(
            new.db,
            fetched,
            attachments_dir=new.config.attachments_dir,
            erased=set(),
            homes=SessionHomes(claude=new.config.claude_home),
        )
        restored = new.config.claude_home / "projects" / "-srv" / f"{SID}.jsonl"
        assert restored.read_bytes() == b'{"turn":1}\n'
        assert (await new.agents.get(agent.id)).session_id == SID
