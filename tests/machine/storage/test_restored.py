"""A restore's histories: packed at the commit, loaded after it, at once when read."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from machine.app import Machine, open_machine
from machine.backups.engine import BackupEngine
from machine.backups.restore import restore_fetched
from machine.backups.source import DatabaseBackupSource
from machine.backups.transfer import InResult
from machine.core.search_indexer import SearchIndexer
from machine.formats.export import agent_path
from machine.models import AgentState
from machine.storage import restored
from machine.storage.db import Database
from machine.storage.tables import export as store_export
from machine.storage.tables import restore_pending
from shared.backup_target import StoreTarget
from shared.crypto import BoxKeyPair
from shared.errors import IntegrityError
from shared.ids import new_id
from shared.store.folder import FolderStore
from tests.helpers.poll import apoll_until
from tests.machine.backups.test_backup_engine import FakeSource
from tests.machine.backups.test_transfer import _backed_up, _config, _export_files, _Old


async def _pending(db: object) -> list[str]:
    rows = await db.read(  # type: ignore[attr-defined]
        lambda c: c.execute("SELECT agent_id FROM restore_pending ORDER BY agent_id").fetchall()
    )
    return [str(r[0]) for r in rows]


async def _restore(old: _Old, new: Machine, stage: Path) -> InResult:
    fetched = await old.engine.fetch(old.made.backup_id, stage, decode_agents=False)
    return await restore_fetched(
        new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
    )


async def test_a_restore_commits_records_then_each_history_loads_when_read(
    tmp_path: Path,
) -> None:
    old = await _backed_up(tmp_path, 3)
    async with open_machine(_config(tmp_path / "new")) as new:
        fetched = await old.engine.fetch(
            old.made.backup_id, tmp_path / "stage", decode_agents=False
        )
        result = await restore_fetched(
            new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
        )
        assert sorted(result.restored) == sorted(old.agents)
        # Committed: every agent listed, archived, its history still packed.
        listed = await new.agents.list(include_archived=True)
        assert sorted(a.id for a in listed) == sorted(old.agents)
        assert all(a.state is AgentState.ARCHIVED for a in listed)
        assert await _pending(new.db) == sorted(old.agents)
        (pack,) = restored.pack_dir(new.db).iterdir()
        assert pack.stat().st_size > 0
        events = await new.db.read(lambda c: c.execute("SELECT COUNT(*) FROM events").fetchone())
        assert events[0] == 0
        # Reading one agent loads that one, at once, and only it.
        first = old.agents[0]
        replayed = [ev async for ev in await new.runs.replay(first)]
        assert replayed and replayed[-1].seq == (await new.agents.get(first)).last_seq
        assert await _pending(new.db) == sorted(old.agents[1:])
        assert pack.exists()
        # The daemon's indexer counts them, then loads every other one; the pack goes.
        registry = CollectorRegistry()
        indexer = SearchIndexer(new.db, registry=registry)
        gauge = "agents_machine_restore_histories_pending_agents"
        assert await indexer.pending() == 3  # not searchable yet, loaded or not
        assert registry.get_sample_value(gauge) == 2
        await indexer.drain()
        assert registry.get_sample_value(gauge) == 0
        assert await _pending(new.db) == [] and not pack.exists()
        assert await _export_files(new, old.agents, tmp_path / "after.tar.gz") == old.before
        # Searchable once the indexer ran (after the load).
        assert await new.agents.search("MARKER-TOOL-1")


async def test_an_export_or_a_backup_loads_what_it_reads_first(tmp_path: Path) -> None:
    old = await _backed_up(tmp_path, 2)
    async with open_machine(_config(tmp_path / "new")) as new:
        await _restore(old, new, tmp_path / "stage")
        # Straight after the commit, nothing loaded yet: the export is whole.
        assert await _export_files(new, old.agents, tmp_path / "after.tar.gz") == old.before
        runs = await new.runs.list_runs(old.agents[1])
        assert len(runs) == 2
    async with open_machine(_config(tmp_path / "new2")) as new:
        await _restore(old, new, tmp_path / "stage2")
        assert len(await _pending(new.db)) == 2
        # A backup lists its agents whole: every history loads first.
        source = DatabaseBackupSource(new.db, new.config.attachments_dir, tmp_path / "work")
        assert sorted(a.agent_id for a in await source.agents()) == sorted(old.agents)
        assert await _pending(new.db) == []


async def test_start_removes_packs_no_history_is_in(tmp_path: Path) -> None:
    old = await _backed_up(tmp_path, 2)
    async with open_machine(_config(tmp_path / "new")) as new:
        await _restore(old, new, tmp_path / "stage")
        (kept,) = restored.pack_dir(new.db).iterdir()
        # A restore killed before its commit leaves a pack no row names.
        orphan = restored.pack_dir(new.db) / "killed-1-00000000.pack"
        orphan.write_bytes(b"plaintext of a restore that never committed")
        assert await restored.sweep_packs(new.db) == 1
        assert not orphan.exists() and kept.exists()


def _segment(agent: str, conversation: bytes) -> bytes:
    """An agent's segment plaintext: a well-formed tar whose record is sound."""
    record = {
        "agent_id": agent,
        "name": "bad history",
        "folder": "/tmp",
        "runtime": "echo",
        "origin_machine": new_id("machine"),
        "created_at": 1.0,
        "updated_at": 1.0,
        "last_seq": 1,
        "attachments": [],
    }
    files = {
        "record.json": json.dumps(record).encode(),
        "conversation.jsonl": conversation,
        "summaries.jsonl": b"",
        "tools.jsonl": b"",
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(agent_path(agent, name))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _engine(source: Any, target: Path, work: Path) -> tuple[BackupEngine, BoxKeyPair]:
    key = BoxKeyPair.generate()
    engine = BackupEngine(
        source,
        StoreTarget(FolderStore(target)),
        machine_id=new_id("machine"),
        naming_key=os.urandom(32),
        recipients=[key.public_key],
        keypair=key,
        work_dir=work,
    )
    return engine, key


@pytest.mark.parametrize("damage", ["not json", "seq past 64 bits", "an error not ours"])
async def test_a_history_that_does_not_load_keeps_its_record_and_says_why(
    tmp_path: Path, damage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An authentic segment (sealed with the backup's keys) whose conversation is
    malformed: the restore commits (the tar and record are sound), the load
    refuses that agent alone, clearly, and the others load; the refused history
    is kept on its own, backed up as it came, and goes with its agent."""
    source = FakeSource(tmp_path, 2)
    bad, good = sorted(source.data)
    event = {"seq": 1, "run_id": new_id("run"), "kind": "RUN_STARTED", "time": 1.0}
    line = json.dumps({**event, "payload": {}}).encode() + b"\n"
    if damage == "not json":
        source.data[bad] = _segment(bad, b"this is not json\n")
    elif damage == "seq past 64 bits":
        source.data[bad] = _segment(
            bad, line.replace(b'"seq": 1', b'"seq": ' + str(2**70).encode())
        )
    else:
        source.data[bad] = _segment(bad, line)
        real = store_export.load_history

        def load_history(conn: Any, agent_id: str, *args: Any, **kwargs: Any) -> None:
            if agent_id == bad:
                raise ValueError("an error no check of ours names")
            real(conn, agent_id, *args, **kwargs)

        monkeypatch.setattr(store_export, "load_history", load_history)
    source.data[good] = _segment(good, line)
    engine, _ = _engine(source, tmp_path / "target", tmp_path / "work")
    made = await engine.backup_now()
    async with open_machine(_config(tmp_path / "new")) as new:
        fetched = await engine.fetch(made.backup_id, tmp_path / "stage", decode_agents=False)
        result = await restore_fetched(
            new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
        )
        assert sorted(result.restored) == sorted([bad, good])
        assert await restored.ensure_loaded(new.db) == 1  # the good one
        with pytest.raises(IntegrityError, match="its restored history did not load") as e:
            await restored.ensure_loaded(new.db, bad)
        says = {
            "not json": "conversation.jsonl line 1",
            "seq past 64 bits": "bad kind or seq",
            "an error not ours": "an error no check of ours names",
        }[damage]
        assert says in str(e.value)
        with pytest.raises(IntegrityError, match="did not load"):
            await new.agents.unarchive(bad)
        why = await new.db.read(lambda c: restore_pending.failed_reason(c, bad))
        assert why is not None and says in why
        assert [ev.seq async for ev in await new.runs.replay(good)] == [1]
        # Counted as failed, not as waiting for the loader or the indexer: search
        # does not say it is still indexing an agent it never will.
        registry = CollectorRegistry()
        indexer = SearchIndexer(new.db, registry=registry)
        await indexer.drain()
        assert await indexer.pending() == 0 and await new.agents.search_indexing() == 0
        assert registry.get_sample_value("agents_machine_restore_histories_failed_agents") == 1
        assert registry.get_sample_value("agents_machine_restore_histories_pending_agents") == 0
        assert registry.get_sample_value("agents_machine_search_backlog_agents") == 0
        # The refused history alone is kept; the restore's pack (the good agent's
        # plaintext too) is gone.
        packs = restored.pack_dir(new.db)
        assert [p.name for p in packs.iterdir()] == [restored.failed_pack(bad)]
        # A backup keeps it as it came (not the record alone): restored elsewhere,
        # it is refused there for the same reason.
        if damage != "an error not ours":
            source2 = DatabaseBackupSource(new.db, new.config.attachments_dir, tmp_path / "w2")
            engine2, _ = _engine(source2, tmp_path / "target2", tmp_path / "w2")
            made2 = await engine2.backup_now()
            async with open_machine(_config(tmp_path / "third")) as third:
                fetched = await engine2.fetch(made2.backup_id, tmp_path / "s3", decode_agents=False)
                await restore_fetched(
                    third.db, fetched, attachments_dir=third.config.attachments_dir, erased=set()
                )
                with pytest.raises(IntegrityError, match=says):
                    await restored.ensure_loaded(third.db, bad)
        # Deleted, it takes its kept history with it.
        await new.require_erasure().delete(bad)
        assert list(packs.iterdir()) == []


async def test_a_restore_cancelled_while_it_commits_keeps_what_it_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client gone or a daemon stopping while the restore's transaction commits:
    the commit runs to its end, and the pack its rows name stays."""
    old = await _backed_up(tmp_path, 2)
    entered, release = threading.Event(), threading.Event()
    real_sync = restored.PackWriter.sync

    def sync(self: restored.PackWriter) -> None:
        entered.set()
        release.wait(30)
        real_sync(self)

    monkeypatch.setattr(restored.PackWriter, "sync", sync)
    async with open_machine(_config(tmp_path / "new")) as new:
        task = asyncio.ensure_future(_restore(old, new, tmp_path / "stage"))
        assert await asyncio.to_thread(entered.wait, 30)
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _pending(new.db) == sorted(old.agents)
        assert await restored.ensure_loaded(new.db) == 2
        assert await _export_files(new, old.agents, tmp_path / "after.tar.gz") == old.before


async def test_an_agent_deleted_before_its_history_loaded_leaves_no_pack(tmp_path: Path) -> None:
    old = await _backed_up(tmp_path, 2)
    async with open_machine(_config(tmp_path / "new")) as new:
        await _restore(old, new, tmp_path / "stage")
        await new.require_erasure().delete(old.agents[0])
        # The whole pack (it held the deleted agent's plaintext) is gone with the load.
        assert list(restored.pack_dir(new.db).iterdir()) == []
        assert await _pending(new.db) == []
        kept = old.agents[1]
        after = await _export_files(new, [kept], tmp_path / "after.tar.gz")
        assert {k: v for k, v in after.items() if kept in k} == {
            k: v for k, v in old.before.items() if kept in k
        }


# A load in a child process that stops for ever once it made the refused history's
# own pack (written, fsync'd, renamed), before the transaction naming it commits.
_FAIL_CHILD = r"""
import asyncio, sys, threading
from pathlib import Path

from machine.storage import restored
from machine.storage.db import Database

data = Path(sys.argv[1])


def parked(folder):
    threading.Event().wait()  # here until the test kills this process


restored.fsync_dir = parked


async def main():
    db = await Database.open(data / "machine.db")
    await restored.ensure_loaded(db)


asyncio.run(main())
"""


async def test_a_load_killed_while_it_sets_a_refused_history_apart_keeps_the_old_state(
    tmp_path: Path,
) -> None:
    """SIGKILL between the refused history's own pack and the transaction naming it:
    the next start removes that pack (no row names it), the rows still name the
    restore's pack, and the load then does it all again."""
    source = FakeSource(tmp_path, 2)
    bad, good = sorted(source.data)
    event = {"seq": 1, "run_id": new_id("run"), "kind": "RUN_STARTED", "time": 1.0}
    line = json.dumps({**event, "payload": {}}).encode() + b"\n"
    source.data[bad] = _segment(bad, b"this is not json\n")
    source.data[good] = _segment(good, line)
    engine, _ = _engine(source, tmp_path / "target", tmp_path / "work")
    made = await engine.backup_now()
    config = _config(tmp_path / "new")
    async with open_machine(config) as new:
        fetched = await engine.fetch(made.backup_id, tmp_path / "stage", decode_agents=False)
        await restore_fetched(
            new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
        )
        packs = restored.pack_dir(new.db)
        (shared,) = packs.iterdir()
    own = packs / restored.failed_pack(bad)
    child = subprocess.Popen([sys.executable, "-c", _FAIL_CHILD, str(config.data_dir)])
    try:

        def set_apart() -> bool:
            if child.poll() is not None:
                raise AssertionError(f"the load ended ({child.returncode}) before the kill")
            return own.exists()

        await apoll_until(set_apart, deadline=60, what="the refused history's own pack")
    finally:
        child.kill()
        child.wait(timeout=30)
    assert own.exists() and shared.exists()
    # What the daemon's start does first (before its indexer loads again).
    db = await Database.open(config.db_path)
    try:
        assert await restored.sweep_packs(db) == 1
        # The pack no row names is gone; nothing of the failure committed.
        assert not own.exists() and shared.exists()
        assert await db.read(lambda c: restore_pending.failed_reason(c, bad)) is None
        assert await restored.ensure_loaded(db) == 1
        assert [p.name for p in packs.iterdir()] == [own.name]
        with pytest.raises(IntegrityError, match="conversation.jsonl line 1"):
            await restored.ensure_loaded(db, bad)
        events = await db.read(
            lambda c: c.execute("SELECT seq FROM events WHERE agent_id = ?", (good,)).fetchall()
        )
        assert [e[0] for e in events] == [1]
    finally:
        await db.close()
