"""machine.backups.workers.segment_workers: agent segments made in worker processes, real ones."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from machine.app import open_machine
from machine.backups.engine import BackupEngine
from machine.backups.reader import decode_checked
from machine.backups.restore import restore_fetched
from machine.backups.source import DatabaseBackupSource
from machine.backups.workers import segment_workers
from machine.backups.workers.segment_workers import SegmentWorkers
from machine.formats.backup import SegmentRef, segment_key
from shared.backup_folder import FolderTarget
from shared.backup_target import StoreTarget
from shared.crypto import BoxKeyPair
from shared.errors import NotFound, StoreError
from shared.ids import new_id
from shared.store.folder import FolderStore
from tests.helpers.poll import apoll_until
from tests.machine.backups.test_transfer import _config, _export_files, _populate

NAMING_KEY = os.urandom(32)


def _worker_pids() -> set[int]:
    """Segment worker processes whose parent is this test process."""
    return _children_named(os.getpid(), b"segment_worker_main")


def _children_named(parent_pid: int, name: bytes) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == parent_pid and name in cmdline:
            found.add(int(entry.name))
    return found


def _engine(
    source: DatabaseBackupSource, target: Path, work: Path, keys: list[BoxKeyPair]
) -> BackupEngine:
    return BackupEngine(
        source,
        StoreTarget(FolderStore(target)),
        machine_id=new_id("machine"),
        naming_key=NAMING_KEY,
        recipients=[k.public_key for k in keys],
        keypair=keys[0],
        work_dir=work,
    )


async def test_workers_make_the_daemons_segments_and_they_restore_byte_equal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    machine_key, recovery = BoxKeyPair.generate(), BoxKeyPair.generate()
    async with open_machine(_config(tmp_path / "old")) as old:
        agents = await _populate(old, tmp_path, 3)
        before = await _export_files(old, agents, tmp_path / "before.tar.gz")
        in_process = _engine(
            DatabaseBackupSource(old.db, old.config.attachments_dir, tmp_path / "w1"),
            tmp_path / "t1", tmp_path / "w1", [machine_key, recovery],
        )  # fmt: skip
        here = await in_process.backup_now()
        monkeypatch.setattr(segment_workers, "MIN_AGENTS", 1)
        with_workers = _engine(
            DatabaseBackupSource(old.db, old.config.attachments_dir, tmp_path / "w2"),
            tmp_path / "t2", tmp_path / "w2", [machine_key, recovery],
        )  # fmt: skip
        made = await with_workers.backup_now()
        assert made.uploaded == here.uploaded == 3 + 3  # three agents, three attachments
        assert not _worker_pids(), "the workers are gone once the backup is made"
    one = await in_process.open(here.backup_id, recovery)
    two = await with_workers.open(made.backup_id, recovery)
    # The same plaintext, so the same names and sizes: segments dedupe across both paths.
    assert sorted((r.name, r.plain_size) for r in one.segments) == sorted(
        (r.name, r.plain_size) for r in two.segments
    )
    async with open_machine(_config(tmp_path / "new")) as new:
        fetched = await with_workers.fetch(made.backup_id, tmp_path / "fetch", recovery)
        result = await restore_fetched(
            new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
        )
        assert sorted(result.restored) == sorted(agents)
        assert await _export_files(new, agents, tmp_path / "after.tar.gz") == before


async def test_workers_pack_a_folder_targets_segments_and_they_restore_byte_equal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    machine_key, recovery = BoxKeyPair.generate(), BoxKeyPair.generate()
    monkeypatch.setattr(segment_workers, "MIN_AGENTS", 1)
    root = tmp_path / "t"
    async with open_machine(_config(tmp_path / "old")) as old:
        agents = await _populate(old, tmp_path, 4)
        before = await _export_files(old, agents, tmp_path / "before.tar.gz")
        engine = BackupEngine(
            DatabaseBackupSource(old.db, old.config.attachments_dir, tmp_path / "w"),
            FolderTarget(FolderStore(root)),
            machine_id=new_id("machine"),
            naming_key=NAMING_KEY,
            recipients=[machine_key.public_key, recovery.public_key],
            keypair=machine_key,
            work_dir=tmp_path / "w",
        )
        made = await engine.backup_now()
        assert made.uploaded == 4 + 4  # four agents, four attachments
        assert not _worker_pids(), "the workers are gone once the backup is made"
    packs = sorted(p.name for p in (root / "packs").iterdir())
    assert packs and all(not p.startswith(".") for p in packs), "published, no temp left"
    # The agents went into packs (each worker its own); attachments are files.
    assert len(list((root / "segments").iterdir())) == 4
    async with open_machine(_config(tmp_path / "new")) as new:
        fetched = await engine.fetch(made.backup_id, tmp_path / "fetch", recovery)
        result = await restore_fetched(
            new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
        )
        assert sorted(result.restored) == sorted(agents)
        assert await _export_files(new, agents, tmp_path / "after.tar.gz") == before


@dataclasses.dataclass
class _OneAgent:
    db_path: Path
    agent: str
    stage: Path


@pytest.fixture
async def one_agent(tmp_path: Path) -> AsyncIterator[_OneAgent]:
    """A running machine with one agent, and a private stage folder."""
    async with open_machine(_config(tmp_path / "m")) as m:
        (agent,) = await _populate(m, tmp_path, 1)
        stage = tmp_path / "stage"
        stage.mkdir(mode=0o700)
        yield _OneAgent(m.db.path, agent, stage)


async def test_a_missing_agent_is_its_error_and_the_worker_goes_on(one_agent: _OneAgent) -> None:
    async with SegmentWorkers(
        one_agent.db_path, naming_key=NAMING_KEY, work_dir=one_agent.stage, count=1
    ) as workers:
        missing = new_id("agent")
        with pytest.raises(NotFound, match=f"agent {missing}: not found") as err:
            await workers(missing)
        assert err.value.kind == "agent"
        made = await workers(one_agent.agent)  # the same worker, still in step
        assert isinstance(made.stored, bytes) and made.plain_size > 0
        assert len(_worker_pids()) == 1
    assert not _worker_pids()


async def test_leaving_early_kills_the_workers_mid_agent(one_agent: _OneAgent) -> None:
    with pytest.raises(RuntimeError, match="backup cancelled"):
        async with SegmentWorkers(
            one_agent.db_path, naming_key=NAMING_KEY, work_dir=one_agent.stage, count=2
        ) as workers:
            pending = asyncio.ensure_future(workers(one_agent.agent))
            await apoll_until(lambda: len(_worker_pids()) == 2, deadline=10, what="workers")
            pending.cancel()
            raise RuntimeError("backup cancelled")
    assert not _worker_pids(), "a backup that ends early leaves no worker behind"


async def test_a_worker_that_dies_fails_its_callers_rather_than_hang(one_agent: _OneAgent) -> None:
    # And the pool's end says so too: what a worker does on its way out (a
    # pack's fsync) is then not known to have happened.
    with pytest.raises(StoreError, match="exited with status -9"):
        async with SegmentWorkers(
            one_agent.db_path, naming_key=NAMING_KEY, work_dir=one_agent.stage, count=1
        ) as workers:
            (pid,) = await apoll_until(_worker_pids, deadline=10, what="the worker")
            os.kill(pid, 9)
            with pytest.raises(StoreError, match="worker process exited"):
                await asyncio.wait_for(workers(one_agent.agent), 30)
            with pytest.raises(StoreError, match="worker process exited"):
                await asyncio.wait_for(workers(one_agent.agent), 30)  # and every call after
    assert not _worker_pids()


async def test_a_worker_gone_is_raised_once_every_worker_has_ended(one_agent: _OneAgent) -> None:
    with pytest.raises(StoreError, match="exited with status -9"):
        async with SegmentWorkers(
            one_agent.db_path, naming_key=NAMING_KEY, work_dir=one_agent.stage, count=2
        ):
            pids = await apoll_until(
                lambda: _worker_pids() if len(_worker_pids()) == 2 else None,
                deadline=10,
                what="both workers",
            )
            os.kill(min(pids), 9)
    assert not _worker_pids(), "the other worker ended too before the failure was raised"


_HOLDER = """
import asyncio, sys
from pathlib import Path
from machine.backups.workers.segment_workers import SegmentWorkers

async def main():
    stage = Path(sys.argv[1])
    async with SegmentWorkers(Path(sys.argv[2]), naming_key=bytes(32), work_dir=stage, count=2):
        print("started", flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_workers_die_with_a_sigkilled_daemon(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "m")) as m:
        db_path = m.db.path
    stage = tmp_path / "stage"
    stage.mkdir(mode=0o700)
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLDER, str(stage), str(db_path), stdout=asyncio.subprocess.PIPE
    )
    assert holder.stdout is not None
    assert await asyncio.wait_for(holder.stdout.readline(), 30) == b"started\n"

    def workers() -> set[int]:
        return _children_named(holder.pid, b"segment_worker_main")

    started = await apoll_until(lambda: len(workers()) == 2 and workers(), deadline=20, what="2")
    holder.kill()
    await holder.wait()
    await apoll_until(
        lambda: not any(Path(f"/proc/{pid}").exists() for pid in started),
        deadline=20,
        what="the workers gone with their daemon",
    )


def test_a_segment_past_the_pipe_is_written_to_a_file_and_decodes(
    one_agent: _OneAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Encrypted a chunk at a time into the file, not whole in memory first.
    monkeypatch.setattr(segment_workers, "_IN_PIPE", 64 * 1024 + 1)
    conn = sqlite3.connect(f"file:{one_agent.db_path}?mode=ro", uri=True, isolation_level=None)
    conn.row_factory = sqlite3.Row
    try:
        answer, data = segment_workers._make(
            conn, one_agent.agent, NAMING_KEY, one_agent.stage, one_agent.stage / "packs"
        )
    finally:
        conn.close()
    assert data == b"" and "path" in answer
    stored = Path(answer["path"]).read_bytes()
    name = answer["name"]
    ref = SegmentRef(
        name, segment_key(NAMING_KEY, name), "agent", one_agent.agent, len(stored), answer["plain"]
    )
    out = io.BytesIO()
    decode_checked(ref, NAMING_KEY, [stored], out)
    assert len(out.getvalue()) == answer["plain"] > 0


def test_a_worker_process_does_not_load_grpc_nor_the_daemons_configuration() -> None:
    # Each worker is a process of its own: gRPC would add about 13 MiB and a
    # tenth of a second to every one (the backup format's readers import
    # shared.limits, not shared.rpc); the daemon's configuration (imported by
    # the machine package once) pulled in TLS, metrics and the backup service,
    # a quarter of a second of CPU per worker.
    heavy = ("grpc", "prometheus_client", "machine.config", "machine.backups.service")
    code = (
        "import sys, machine.backups.workers.segment_worker_main;"
        f" print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
