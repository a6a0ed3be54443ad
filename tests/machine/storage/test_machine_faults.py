"""The machine under faults: failed reads, damaged databases, full disks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from machine.api import codec
from machine.app import Machine, full_check_stamp, next_full_check_in, open_machine
from machine.config import MachineConfig
from machine.core.streams import StreamLimits
from machine.metrics import MachineMetrics
from machine.models import EventKind, RunErrorCode, RunState
from machine.runtimes import RuntimeKind, RuntimeRegistry, echo
from machine.runtimes.base import RunContext, RunOutcome, TextDelta
from machine.storage import tables
from machine.storage.db import Database
from shared.errors import DatabaseDamaged, DiskFull, IntegrityError, QuotaExceeded
from shared.rpc import status_for
from tests.helpers.poll import apoll_until
from tests.helpers.runs import break_appends, wait_for_state

DEADLINE = 10.0


# ------------------------------------------------------------------ failed reads


async def test_read_that_raises_mid_iteration_leaves_no_stale_snapshot(tmp_path: Path) -> None:
    db = await Database.open(tmp_path / "m.db")
    try:
        await db.write(lambda c: c.execute("CREATE TABLE t (x TEXT)"))
        await db.write(
            lambda c: c.executemany("INSERT INTO t VALUES (?)", [(f"v{i}",) for i in range(10)])
        )
        await db.write(lambda c: c.execute("INSERT INTO t VALUES (CAST(X'FF' AS TEXT))"))
        await db.write(lambda c: c.execute("INSERT INTO t VALUES ('after')"))

        def read_all(conn: sqlite3.Connection) -> list[str]:
            cur = conn.execute("SELECT x FROM t ORDER BY rowid")
            return [row[0] for row in cur]

        # Keeping the exception keeps its traceback, and so the reader's half-read
        # cursor, alive: exactly what a logged or re-raised failure does.
        with pytest.raises(IntegrityError, match="not valid UTF-8") as failed:
            await db.read(read_all)
        await db.write(lambda c: c.execute("INSERT INTO t VALUES ('new')"))
        count = await db.read(lambda c: c.execute("SELECT COUNT(*) FROM t").fetchone()[0])
        assert count == 13
        assert failed.value is not None
    finally:
        await db.close()


async def test_undecodable_event_does_not_break_later_prompts_and_replays(
    machine_config: MachineConfig, tmp_path: Path
) -> None:
    async with open_machine(machine_config) as m:
        damaged = await m.agents.create(name="a", folder=str(tmp_path), runtime="echo")
        [ev async for ev in await m.runs.prompt(damaged.id, "one two three")]
        [ev async for ev in await m.runs.prompt(damaged.id, "four five six")]
    conn = sqlite3.connect(machine_config.db_path)
    with conn:
        conn.execute(
            "UPDATE events SET payload_json = CAST(X'7B2274657874223A2022FF227D' AS TEXT)"
            " WHERE agent_id = ? AND seq = 3",
            (damaged.id,),
        )
    conn.close()
    # Reopened: the feeds are empty, so replay reads the database.
    async with open_machine(machine_config) as m:
        with pytest.raises(IntegrityError, match=f"replay agent {damaged.id}") as failed:
            [ev async for ev in await m.runs.replay(damaged.id)]
        other = await m.agents.create(name="b", folder=str(tmp_path), runtime="echo")
        events = [ev async for ev in await m.runs.prompt(other.id, "hello")]
        assert events[-1].kind is EventKind.RUN_FINISHED
        more = [ev async for ev in await m.runs.prompt(damaged.id, "again")]
        assert more[-1].kind is EventKind.RUN_FINISHED
        after = [ev async for ev in await m.runs.replay(damaged.id, 3)]
        assert [ev.seq for ev in after] == list(range(4, more[-1].seq + 1))
        assert failed.value is not None


# ------------------------------------------------------------------ full disk


def disk_full() -> sqlite3.OperationalError:
    """What SQLite raises when the disk is full (SQLITE_FULL)."""
    error = sqlite3.OperationalError("database or disk is full")
    error.sqlite_errorcode = 13  # type: ignore[attr-defined]
    return error


async def test_run_whose_events_cannot_be_stored_ends_storage_failed_once_writes_work(
    machine_app: Machine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = (await machine_app.agents.create(name="a", folder=str(tmp_path))).id
    full = [False]
    filled = [False]

    def fault(kind: EventKind) -> BaseException | None:
        if full[0]:
            return disk_full()
        if kind is EventKind.TEXT_DELTA and not filled[0]:
            full[0] = filled[0] = True  # the disk fills up after the first delta
        return None

    break_appends(monkeypatch, fault)
    stream = await machine_app.runs.prompt(agent, "one two three four")
    seen: list[EventKind] = []

    async def consume() -> None:
        async for ev in stream:
            seen.append(ev.kind)

    with pytest.raises(DiskFull, match=f"data folder {machine_app.config.data_dir}"):
        await asyncio.wait_for(consume(), DEADLINE)
    # The run's events are committed in batches: a batch that meets the full disk
    # commits none of its events, so what was published is the prefix committed
    # before it (RUN_STARTED and the first delta, or less when they shared it).
    assert seen == [EventKind.RUN_STARTED, EventKind.TEXT_DELTA][: len(seen)]
    run = (await machine_app.runs.list_runs(agent))[0]
    assert run.state is (RunState.RUNNING if seen else RunState.QUEUED)

    full[0] = False  # space freed: no restart, no cancel
    ended = await wait_for_state(machine_app, run.id, RunState.FAILED)
    assert ended.error_code is RunErrorCode.STORAGE_FAILED
    events = [ev async for ev in await machine_app.runs.replay(agent)]
    # Nothing after the lost event was stored: what was published, then the end.
    assert [ev.kind for ev in events] == [*seen, EventKind.RUN_ERROR]
    assert events[-1].payload["code"] == "STORAGE_FAILED"
    assert "no space left" in events[-1].payload["message"]
    # And the machine carries on.
    again = [ev async for ev in await machine_app.runs.prompt(agent, "hello")]
    assert again[-1].kind is EventKind.RUN_FINISHED


async def test_full_disk_answers_disk_full_naming_the_data_folder(
    machine_app: Machine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = (await machine_app.agents.create(name="a", folder=str(tmp_path))).id

    def insert_fails(*args: Any, **kwargs: Any) -> None:
        raise disk_full()

    monkeypatch.setattr(tables, "insert_agent", insert_fails)
    with pytest.raises(DiskFull) as failed:
        await machine_app.agents.create(name="b", folder=str(tmp_path))
    assert str(machine_app.config.data_dir) in failed.value.message
    assert status_for(failed.value) is grpc.StatusCode.RESOURCE_EXHAUSTED
    monkeypatch.undo()
    assert (await machine_app.agents.get(agent)).id == agent


# ------------------------------------------------------------------ unreported usage


class _Silent:
    """A runtime that replies and never reports usage."""

    name = "silent"

    async def run(self, ctx: RunContext) -> RunOutcome:
        await ctx.emit(TextDelta("done"))
        return RunOutcome("end_turn")

    async def close(self) -> None:
        """Nothing to stop."""

    async def delete_session(self, session_id: str) -> None:
        """No sessions."""


async def test_usage_a_runtime_does_not_report_is_unknown_not_zero(
    machine_config: MachineConfig, tmp_path: Path
) -> None:
    kinds = {
        "silent": RuntimeKind("silent", lambda s: dict(s), lambda **kw: _Silent()),
        "echo": RuntimeKind("echo", echo.validate_settings, echo.create_runtime),
    }
    async with open_machine(machine_config, runtimes=RuntimeRegistry(kinds)) as m:
        silent = await m.agents.create(name="s", folder=str(tmp_path), runtime="silent")
        events = [ev async for ev in await m.runs.prompt(silent.id, "hi")]
        finished = events[-1]
        assert finished.kind is EventKind.RUN_FINISHED and finished.payload["usage"] == {}
        message = codec.event_to_pb(finished).run_finished.usage
        assert not message.HasField("input_tokens") and not message.HasField("output_tokens")
        run = await m.runs.get_run(finished.run_id)
        assert run.input_tokens is None and run.output_tokens is None
        assert not codec.run_to_pb(run).usage.HasField("input_tokens")

        # A failed run that never reported usage: unknown too.
        talker = await m.agents.create(name="e", folder=str(tmp_path), runtime="echo")
        failed = [ev async for ev in await m.runs.prompt(talker.id, "/fail now")]
        assert (await m.runs.get_run(failed[-1].run_id)).input_tokens is None
        # Reported usage is kept, including a real 0.
        done = [ev async for ev in await m.runs.prompt(talker.id, "two words")]
        run = await m.runs.get_run(done[-1].run_id)
        assert (run.input_tokens, run.output_tokens) == (2, 3)
        assert codec.run_to_pb(run).usage.HasField("input_tokens")


# ------------------------------------------------------------------ damage found by the timer


def damage_middle_page(db: Path) -> None:
    """Overwrite the middle page of ``db`` with bytes no b-tree page starts with."""
    size = db.stat().st_size
    with db.open("r+b") as f:
        f.seek((size // 2) // 4096 * 4096)
        f.write(b"\xff" * 4096)


async def test_timer_integrity_check_finds_damage_and_stops_writes(
    machine_config: MachineConfig, tmp_path: Path
) -> None:
    async with open_machine(machine_config) as m:
        agent = await m.agents.create(name="a", folder=str(tmp_path))
        for n in range(4):
            [ev async for ev in await m.runs.prompt(agent.id, f"{n} " + "word " * 150)]
    # Closed cleanly: the start trusts the clean-stop mark, and the quick check
    # runs just after it, in the background.
    config = replace(machine_config, background_loops=True, integrity_check_seconds=0.05)
    metrics = MachineMetrics(CollectorRegistry())
    async with open_machine(config, metrics=metrics) as m:
        assert sample(metrics, "agents_machine_db_opens_total", start_check="skipped") == 1
        await apoll_until(
            lambda: sample(metrics, "agents_machine_db_checks_total", kind="quick", result="ok"),
            deadline=DEADLINE,
            what="the quick check after a start that skipped it",
            step=0.02,
        )
        damage_middle_page(config.db_path)
        await apoll_until(
            lambda: m.db.damaged is not None,
            deadline=DEADLINE,
            what="the timer finding the damage",
            step=0.02,
        )
        assert sample(metrics, "agents_machine_db_damaged") == 1
        assert sample(metrics, "agents_machine_db_checks_total", kind="full", result="damaged")
        with pytest.raises(DatabaseDamaged) as refused:
            await m.runs.submit(agent.id, "hello")
        assert status_for(refused.value) is grpc.StatusCode.DATA_LOSS
        assert f"prompt agent {agent.id}" in refused.value.message
        assert "restore" in refused.value.message


async def test_damaged_file_is_refused_at_open(
    machine_config: MachineConfig, tmp_path: Path
) -> None:
    async with open_machine(machine_config) as m:
        agent = await m.agents.create(name="a", folder=str(tmp_path))
        for n in range(4):
            [ev async for ev in await m.runs.prompt(agent.id, f"{n} " + "word " * 150)]
    damage_middle_page(machine_config.db_path)
    before = machine_config.db_path.read_bytes()
    with pytest.raises(DatabaseDamaged, match="is damaged"):
        async with open_machine(machine_config):
            pass
    assert machine_config.db_path.read_bytes() == before


def sample(metrics: MachineMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


# ------------------------------------------------------------------ stream limits


def test_stream_limits_per_client_and_in_total() -> None:
    metrics = MachineMetrics(CollectorRegistry())
    limits = StreamLimits(per_client=2, total=3, metrics=metrics)
    with contextlib.ExitStack() as held:
        held.enter_context(limits.opened("a"))
        held.enter_context(limits.opened("a"))
        with pytest.raises(QuotaExceeded, match="streams of this client: limit of 2"):
            held.enter_context(limits.opened("a"))
        held.enter_context(limits.opened("b"))
        with pytest.raises(QuotaExceeded, match="served by this machine: limit of 3"):
            held.enter_context(limits.opened("c"))
        assert limits.open_streams == 3
        assert sample(metrics, "agents_machine_streams_open") == 3
    assert limits.open_streams == 0
    assert sample(metrics, "agents_machine_streams_open") == 0
    assert sample(metrics, "agents_machine_streams_refused_total", limit="client") == 1
    assert sample(metrics, "agents_machine_streams_refused_total", limit="total") == 1
    with limits.opened("a"):  # slots come back
        pass


async def test_undecodable_value_in_a_write_fails_only_that_write(tmp_path: Path) -> None:
    db = await Database.open(tmp_path / "m.db")
    try:
        await db.write(lambda c: c.execute("CREATE TABLE t (x TEXT)"))
        await db.write(lambda c: c.execute("INSERT INTO t VALUES (CAST(X'FF' AS TEXT))"))

        def read_back(conn: sqlite3.Connection) -> list[str]:
            return [r[0] for r in conn.execute("SELECT x FROM t")]

        bad = asyncio.ensure_future(db.write(read_back, what="read back"))
        good = asyncio.ensure_future(db.write(lambda c: c.execute("INSERT INTO t VALUES ('ok')")))
        with pytest.raises(IntegrityError, match="read back: a value stored"):
            await bad
        await good
        assert db.damaged is None
        assert await db.read(lambda c: c.execute("SELECT COUNT(*) FROM t").fetchone()[0]) == 2
    finally:
        await db.close()


# ------------------------------------------------------------------ full check schedule


def test_the_full_check_is_due_after_the_last_one_not_after_each_start() -> None:
    day = 86400.0
    assert next_full_check_in(None, 1_000_000.0, day) == day  # never checked
    assert next_full_check_in(1_000_000.0 - 3600, 1_000_000.0, day) == day - 3600
    assert next_full_check_in(1_000_000.0 - 3 * day, 1_000_000.0, day) == 0.0  # overdue
    # The clock was set back: not never, not at once; a whole interval.
    assert next_full_check_in(1_000_000.0 + day, 1_000_000.0, day) == day


async def test_an_overdue_full_check_runs_at_start_and_records_its_time(
    machine_config: MachineConfig,
) -> None:
    async with open_machine(machine_config):
        pass
    stamp = full_check_stamp(machine_config.db_path)
    two_days_ago = time.time() - 2 * 86400
    stamp.write_text(json.dumps({"at": two_days_ago}))
    config = replace(machine_config, background_loops=True, integrity_check_seconds=86400.0)
    metrics = MachineMetrics(CollectorRegistry())
    async with open_machine(config, metrics=metrics):
        await apoll_until(
            lambda: sample(metrics, "agents_machine_db_checks_total", kind="full", result="ok"),
            deadline=DEADLINE,
            what="the overdue full check",
            step=0.02,
        )
        await apoll_until(
            lambda: json.loads(stamp.read_text())["at"] > two_days_ago,
            deadline=DEADLINE,
            what="the full check's time recorded",
            step=0.02,
        )
