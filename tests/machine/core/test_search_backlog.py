"""Restored agents are indexed in the background, and a killed indexer resumes."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from machine.app import Machine, open_machine
from machine.backups.engine import BackupEngine
from machine.backups.reader import FetchedBackup
from machine.backups.restore import restore_fetched
from machine.backups.source import DatabaseBackupSource
from machine.config import MachineConfig
from machine.models import EventKind
from shared.backup_target import StoreTarget
from shared.crypto import BoxKeyPair
from shared.store.folder import FolderStore
from tests.helpers.poll import apoll_until

DEADLINE = 10.0
AGENTS = 3
ROOT = Path(__file__).resolve().parents[3]


def _config(root: Path) -> MachineConfig:
    return MachineConfig(data_dir=root, background_loops=False, shutdown_grace_seconds=0).validate()


async def _drain(stream: AsyncIterator[object]) -> None:
    async for _ in stream:
        pass


async def _populate(m: Machine, tmp: Path) -> list[str]:
    ids = []
    for i in range(AGENTS):
        agent = (await m.agents.create(name=f"agent-{i}", folder=str(tmp))).id
        ids.append(agent)
        await asyncio.wait_for(_drain(await m.runs.prompt(agent, f"BACKLOG-{i} hi")), DEADLINE)
        stream = await m.runs.prompt(agent, f"/tool ls TOOLMARK-{i}")
        async for ev in stream:
            if ev.kind is EventKind.PERMISSION_REQUEST:
                await m.runs.answer(ev.run_id, ev.payload["request_id"], "allow_once")
        await m.agents.archive(agent)
    return ids


def _search_rows(db_path: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db_path) as conn:
        return sorted(conn.execute("SELECT text, agent_id, run_id, seq, source FROM search"))


def _backlog(db_path: Path) -> set[str]:
    with sqlite3.connect(db_path) as conn:
        return {r[0] for r in conn.execute("SELECT agent_id FROM search_backlog")}


@pytest.fixture
async def restored(tmp_path: Path) -> dict[str, Any]:
    """A machine's backup restored into a new machine's database, not indexed yet."""
    key = BoxKeyPair.generate()
    async with open_machine(_config(tmp_path / "old")) as old:
        agents = await _populate(old, tmp_path)
        engine = BackupEngine(
            DatabaseBackupSource(old.db, old.config.attachments_dir, tmp_path / "work"),
            StoreTarget(FolderStore(tmp_path / "target")),
            machine_id=old.ids.canonical,
            naming_key=os.urandom(32),
            recipients=[key.public_key],
            keypair=key,
            work_dir=tmp_path / "work",
        )
        made = await engine.backup_now()
        fetched: FetchedBackup = await engine.fetch(made.backup_id, tmp_path / "fetch")
        old_rows = _search_rows(old.config.db_path)
    new_config = _config(tmp_path / "new")
    async with open_machine(new_config) as new:
        assert new.indexer is not None
        # Hold the indexer off: the test decides when indexing happens.
        new.indexer.kick = lambda: None  # type: ignore[method-assign]
        await restore_fetched(
            new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
        )
        assert await new.agents.search_indexing() == AGENTS
        assert await new.agents.search("TOOLMARK-1") == [], "not searchable until indexed"
    return {"agents": agents, "old_rows": old_rows, "config": new_config}


async def test_background_index_matches_the_original_machines(restored: dict[str, Any]) -> None:
    config = restored["config"]
    async with open_machine(config) as m:
        assert m.indexer is not None
        # The daemon's indexer drains the backlog at start.
        await apoll_until(
            lambda: _backlog(config.db_path) == set(), deadline=DEADLINE, what="backlog drained"
        )
        assert await m.agents.search_indexing() == 0
        assert await m.agents.search("TOOLMARK-1")
    assert _search_rows(config.db_path) == restored["old_rows"]


_KILLER = textwrap.dedent(
    """
    import os, signal, sqlite3, sys
    from machine.storage.tables import search_backlog

    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    real = search_backlog.index_agent
    calls = []

    def index_then_die(c, agent_id):
        added = real(c, agent_id)
        calls.append(agent_id)
        if len(calls) == 2:  # the second batch's rows are in, its commit is not
            os.kill(os.getpid(), signal.SIGKILL)
        return added

    search_backlog.index_agent = index_then_die
    while True:
        conn.execute("BEGIN IMMEDIATE")
        search_backlog.index_next(conn, budget=1)  # one agent per transaction
        conn.execute("COMMIT")
    """
)


async def test_indexer_killed_mid_way_resumes_at_start(restored: dict[str, Any]) -> None:
    config = restored["config"]
    before = _backlog(config.db_path)
    proc = subprocess.run(
        [sys.executable, "-c", _KILLER, str(config.db_path)],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    left = _backlog(config.db_path)
    # The first agent's batch committed; the second's (killed before COMMIT) did not.
    assert len(left) == AGENTS - 1 and left < before
    (done,) = before - left
    rows = _search_rows(config.db_path)
    assert {r[1] for r in rows} == {done}, "only the committed agent has search rows"
    async with open_machine(config) as m:
        await apoll_until(
            lambda: _backlog(config.db_path) == set(), deadline=DEADLINE, what="backlog drained"
        )
        assert await m.agents.search("TOOLMARK-2")
    assert _search_rows(config.db_path) == restored["old_rows"], "each agent indexed once"
