"""Durability edges of the machine daemon: cancelled callers never leave a
committed write half-applied, a run whose final event is lost does not hang
its followers, the database writer always answers, leftover upload temp files
are removed, and a data folder without WAL support is refused."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from machine.app import Machine, open_machine
from machine.config import MachineConfig
from machine.models import EventKind, RunState
from machine.storage import db as db_module
from machine.storage.db import Database
from shared.errors import StoreError
from tests.helpers.poll import apoll_until
from tests.helpers.runs import break_appends, read_until, wait_for_state

DEADLINE = 10.0


class GatedWrite:
    """Replaces ``db.write`` so the next write commits, then holds its caller until
    released: the caller can be cancelled exactly while the write is committed."""

    def __init__(self, db: Database) -> None:
        self._orig = db.write
        self.committed = asyncio.Event()
        self.release = asyncio.Event()
        self._armed = True

    async def __call__(self, fn: Callable[[sqlite3.Connection], Any], **kwargs: Any) -> Any:
        if not self._armed:
            return await self._orig(fn, **kwargs)
        self._armed = False
        result = await self._orig(fn, **kwargs)
        self.committed.set()
        await self.release.wait()
        return result


async def cancel_after_commit(
    monkeypatch: pytest.MonkeyPatch, m: Machine, call: Callable[[], Awaitable[Any]]
) -> None:
    """Start ``call``; cancel it once its write has committed; expect CancelledError."""
    gate = GatedWrite(m.db)
    monkeypatch.setattr(m.db, "write", gate)

    async def run_call() -> Any:
        return await call()

    task = asyncio.ensure_future(run_call())
    await asyncio.wait_for(gate.committed.wait(), DEADLINE)
    task.cancel()
    gate.release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, DEADLINE)
    monkeypatch.undo()


# ------------------------------------------------------------------ run engine


async def test_answer_cancelled_while_committing_still_resumes_the_run(
    machine_app: Machine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = (await machine_app.agents.create(name="a", folder=str(tmp_path))).id
    stream = await machine_app.runs.prompt(agent, "/tool deploy prod")
    req = (await read_until(stream, EventKind.PERMISSION_REQUEST))[-1]

    await cancel_after_commit(
        monkeypatch,
        machine_app,
        lambda: machine_app.runs.answer(req.run_id, req.payload["request_id"], "allow_once"),
    )

    rest = await read_until(stream, EventKind.RUN_FINISHED)
    assert rest[0].kind is EventKind.PERMISSION_ANSWERED
    await wait_for_state(machine_app, req.run_id, RunState.FINISHED)
    # The agent's turn was released: a next prompt runs to its end.
    nxt = await machine_app.runs.prompt(agent, "next")
    assert (await read_until(nxt, EventKind.RUN_FINISHED))[-1].kind is EventKind.RUN_FINISHED


async def test_prompt_cancelled_while_committing_still_runs(
    machine_app: Machine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = (await machine_app.agents.create(name="a", folder=str(tmp_path))).id

    await cancel_after_commit(
        monkeypatch, machine_app, lambda: machine_app.runs.prompt(agent, "hello")
    )

    runs = await machine_app.runs.list_runs(agent)
    assert len(runs) == 1
    await wait_for_state(machine_app, runs[0].id, RunState.FINISHED)
    await machine_app.agents.archive(agent)  # nothing left in flight


async def test_lost_final_event_fails_followers_and_cancel_still_ends_the_run(
    machine_app: Machine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = (await machine_app.agents.create(name="a", folder=str(tmp_path))).id
    broken = [True]

    def fault(kind: EventKind) -> BaseException | None:
        if broken[0] and kind in (EventKind.RUN_FINISHED, EventKind.RUN_ERROR):
            return sqlite3.OperationalError("disk I/O error")
        return None

    break_appends(monkeypatch, fault)
    stream = await machine_app.runs.prompt(agent, "hello")
    seen: list[EventKind] = []

    async def consume() -> None:
        async for ev in stream:
            seen.append(ev.kind)

    with pytest.raises(StoreError, match="final event could not be stored"):
        await asyncio.wait_for(consume(), DEADLINE)
    # Every stored event came first; the run is still open and still registered.
    assert seen[0] is EventKind.RUN_STARTED and EventKind.TEXT_DELTA in seen
    run = (await machine_app.runs.list_runs(agent))[0]
    assert run.state is RunState.RUNNING
    assert run.id in machine_app.runs._active

    # Cancelling while the store still fails answers the storage error; the run
    # stays open and remembers that it was cancelled.
    with pytest.raises(StoreError, match="final event could not be stored"):
        await machine_app.runs.cancel(run.id)
    assert (await machine_app.runs.get_run(run.id)).state is RunState.RUNNING

    broken[0] = False
    cancelled = await wait_for_state(machine_app, run.id, RunState.CANCELLED)
    assert cancelled.error_code == "CANCELLED"
    assert run.id not in machine_app.runs._active
    kinds = await machine_app.db.read(
        lambda c: [r[0] for r in c.execute("SELECT kind FROM events WHERE run_id = ?", (run.id,))]
    )
    assert kinds.count("RUN_ERROR") == 1


async def test_lost_final_event_run_is_interrupted_at_restart(
    machine_config: MachineConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fault(kind: EventKind) -> BaseException | None:
        if kind in (EventKind.RUN_FINISHED, EventKind.RUN_ERROR):
            return sqlite3.OperationalError("disk I/O error")
        return None

    async with open_machine(machine_config) as m:
        agent = (await m.agents.create(name="a", folder=str(tmp_path))).id
        break_appends(monkeypatch, fault)
        stream = await m.runs.prompt(agent, "hello")
        with pytest.raises(StoreError):
            await read_until(stream, EventKind.RUN_FINISHED)
        monkeypatch.undo()
    async with open_machine(machine_config) as m:
        run = (await m.runs.list_runs(agent))[0]
        assert run.state is RunState.INTERRUPTED


# ------------------------------------------------------------------ database


@pytest.fixture
async def database(tmp_path: Path) -> AsyncIterator[Database]:
    db = await Database.open(tmp_path / "machine.db")
    try:
        yield db
    finally:
        await db.close()


def _insert(conn: sqlite3.Connection) -> int:
    return conn.execute("INSERT INTO settings VALUES ('k', 'v')").rowcount


async def test_failing_commit_observer_neither_hangs_nor_stops_the_writer(
    tmp_path: Path,
) -> None:
    calls: list[int] = []

    def observer(size: int, seconds: float) -> None:
        calls.append(size)
        raise ValueError("metrics hiccup")

    db = await Database.open(tmp_path / "machine.db", on_commit=observer)
    try:
        assert await asyncio.wait_for(db.write(_insert), DEADLINE) == 1
        assert await asyncio.wait_for(db.write(lambda c: 2), DEADLINE) == 2
        # The observer runs after the callers are answered: wait for the second call.
        await apoll_until(
            lambda: len(calls) >= 2, deadline=DEADLINE, what="the second commit observed"
        )
        value = await db.read(lambda c: c.execute("SELECT value FROM settings").fetchone()[0])
        assert value == "v"
    finally:
        await db.close()


async def test_write_raising_stop_iteration_gets_a_store_error(database: Database) -> None:
    def job(conn: sqlite3.Connection) -> Any:
        conn.execute("INSERT INTO settings VALUES ('k', 'v')")
        return next(iter(()))

    with pytest.raises(StoreError, match="StopIteration"):
        await asyncio.wait_for(database.write(job), DEADLINE)
    # Rolled back, and the writer still serves.
    assert await asyncio.wait_for(database.write(_insert), DEADLINE) == 1


async def test_unexpected_batch_failure_fails_the_batch_and_writer_carries_on(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(error: BaseException, where: Path) -> BaseException:
        raise RuntimeError("bug in the writer")

    monkeypatch.setattr(db_module, "_deliverable", broken)

    def job(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO settings VALUES ('k', 'v')")
        raise ValueError("job failed")

    with pytest.raises(StoreError):
        await asyncio.wait_for(database.write(job), DEADLINE)
    monkeypatch.undo()
    assert await asyncio.wait_for(database.write(_insert), DEADLINE) == 1


async def test_write_after_the_writer_stopped_raises(database: Database) -> None:
    database._queue.put(None)  # stop the writer thread behind the database's back
    writer = database._writer
    assert writer is not None
    await asyncio.wait_for(asyncio.to_thread(writer.join), DEADLINE)
    with pytest.raises(StoreError, match="writer has stopped"):
        await asyncio.wait_for(database.write(_insert), DEADLINE)


class _NoWal(sqlite3.Connection):
    """A connection on a filesystem where WAL is impossible: the mode stays DELETE."""

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql.replace(" ", "").upper() == "PRAGMAJOURNAL_MODE=WAL":
            sql = "PRAGMA journal_mode = DELETE"
        return super().execute(sql, *args)


@pytest.fixture
def no_wal(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    connect = sqlite3.connect

    def fake(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        kwargs["factory"] = _NoWal
        return connect(*args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", fake)
    yield


@pytest.mark.usefixtures("no_wal")
async def test_database_without_wal_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="WAL mode on the data folder's filesystem"):
        await Database.open(tmp_path / "machine.db")


# ------------------------------------------------------------------ attachments


async def test_leftover_upload_temp_files_are_removed_at_open(
    machine_config: MachineConfig,
) -> None:
    folder = machine_config.attachments_dir
    folder.mkdir(parents=True)
    leftovers = [folder / ".upload-0123456789abcdef.tmp", folder / ".upload-feedface.tmp"]
    for path in leftovers:
        path.write_bytes(b"partial")
    kept = [folder / ("a" * 64), folder / "notes.tmp"]
    for path in kept:
        path.write_bytes(b"keep")

    async with open_machine(machine_config):
        assert not any(p.exists() for p in leftovers)
        assert all(p.exists() for p in kept)
