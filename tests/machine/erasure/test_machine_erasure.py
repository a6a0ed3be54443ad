"""Erasure and retention rules, in process with an injectable clock: the queue
limit, the erased list's bound, the 7-day retry window, a crash after the commit,
and every retention sweep."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from machine.app import Machine, open_machine
from machine.config import MachineConfig
from machine.erasure.service import ErasureService
from machine.metrics import MachineMetrics
from machine.runtimes import RuntimeKind, RuntimeRegistry, echo
from machine.runtimes.base import RunContext, RunOutcome, RuntimeFailed
from machine.storage import tables
from machine.storage.tables import erasures as store_erasures
from shared.errors import InvalidState, QuotaExceeded
from tests.helpers.poll import apoll_until

DAY = 86400.0


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


class _Eraser:
    """A runtime whose erase_session blocks (``stuck``) or fails (``failing``)."""

    name = "fake"
    blocked = asyncio.Event()

    def __init__(self, mode: str) -> None:
        self.mode = mode

    async def run(self, ctx: RunContext) -> RunOutcome:
        return RunOutcome()

    async def close(self) -> None:
        pass

    async def delete_session(self, session_id: str) -> None:
        pass

    async def erase_session(self, session_id: str | None, folder: Path) -> tuple[str, str]:
        if self.mode == "stuck":
            await asyncio.Event().wait()
        raise RuntimeFailed("the runtime does not answer")


def _registry() -> RuntimeRegistry:
    def kind(mode: str) -> RuntimeKind:
        return RuntimeKind(mode, dict, lambda **_: _Eraser(mode))

    return RuntimeRegistry(
        {
            "echo": RuntimeKind("echo", echo.validate_settings, echo.create_runtime),
            "stuck": kind("stuck"),
            "failing": kind("failing"),
        }
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def opened(machine_config: MachineConfig, clock: Clock) -> Iterator[Any]:
    """``async with opened() as m``: the machine on one data folder, with the clock."""

    def make() -> Any:
        metrics = MachineMetrics(CollectorRegistry())  # one registry per daemon start
        return open_machine(machine_config, runtimes=_registry(), clock=clock, metrics=metrics)

    yield make


async def _archived(m: Machine, folder: Path, runtime: str = "echo") -> str:
    agent = await m.agents.create(name="a", folder=str(folder), runtime=runtime)
    await m.agents.archive(agent.id)
    return agent.id


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _sample(m: Machine, name: str, labels: dict[str, str] | None = None) -> float:
    assert m.metrics is not None
    value = m.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


def _erasure(m: Machine) -> ErasureService:
    return m.require_erasure()


async def test_a_full_queue_refuses_a_delete_and_deletes_nothing(
    opened: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("machine.erasure.service.QUEUE_MAX", 2)
    async with opened() as m:
        ids = [await _archived(m, tmp_path, "stuck") for _ in range(3)]
        for agent_id in ids[:2]:
            assert (await _erasure(m).delete(agent_id)).runtime_erasure_queued
        assert _sample(m, "agents_machine_erasure_queue_length") == 2
        with pytest.raises(QuotaExceeded) as err:
            await _erasure(m).delete(ids[2])
        assert "runtime erasure queue" in str(err.value)
        assert (await m.agents.get(ids[2])).id == ids[2]
        assert await _erasure(m).erased_ids() == set(ids[:2])


async def test_an_active_agent_is_refused(opened: Any, tmp_path: Path) -> None:
    async with opened() as m:
        agent = await m.agents.create(name="a", folder=str(tmp_path))
        with pytest.raises(InvalidState):
            await _erasure(m).delete(agent.id)
        assert (await m.agents.get(agent.id)).id == agent.id
        assert await _erasure(m).erased_ids() == set()


async def test_the_erased_list_drops_the_oldest_when_full(
    machine_app: Machine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_erasures, "ERASED_MAX", 3)

    def write(conn: Any) -> list[str]:
        for n in range(5):
            store_erasures.add_erased(conn, f"ag_{n}", 1000.0 + n)
        return [r["agent_id"] for r in store_erasures.erased_rows(conn)]

    assert await machine_app.db.write(write) == ["ag_2", "ag_3", "ag_4"]


async def test_a_runtime_not_answering_is_given_up_after_7_days(
    opened: Any, tmp_path: Path, clock: Clock
) -> None:
    async with opened() as m:
        agent = await _archived(m, tmp_path, "failing")
        await _erasure(m).delete(agent)

        async def tried() -> Any:
            r = {v.agent_id: v for v in await _erasure(m).receipts()}[agent]
            return r if r.attempts == 1 else None

        first = await apoll_until(tried, deadline=10, what="first try")
        assert first.state == "queued" and "try 1 of 3 failed" in first.detail
        assert _sample(m, "agents_machine_erasure_failures_total") == 1
        clock.now += 3600
        # Pending for an hour: the oldest-age gauge tells (the ErasureStuck alert reads it).
        assert _sample(m, "agents_machine_erasure_queue_oldest_age_seconds") >= 3600
    clock.now += 8 * DAY
    async with opened() as m:

        async def given_up() -> Any:
            r = {v.agent_id: v for v in await _erasure(m).receipts()}[agent]
            return r if r.state != "queued" else None

        r = await apoll_until(given_up, deadline=10, what="given up")
        assert (r.state, r.runtime_copy, r.attempts) == ("failed", "failed", 1)
        assert "not erased within 7 days" in r.detail
        logged = await m.db.read(
            lambda c: [row[0] for row in c.execute("SELECT kind FROM machine_log ORDER BY id")]
        )
        assert "erasure.given_up" in logged
        assert _sample(m, "agents_machine_erasures_total", {"result": "failed"}) == 1
        assert _sample(m, "agents_machine_erasure_queue_oldest_age_seconds") == 0


async def test_a_crash_after_the_commit_is_finished_at_the_next_start(
    opened: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = b"attached words " * 10
    async with opened() as m:
        agent = (await m.agents.create(name="a", folder=str(tmp_path))).id
        rec = await m.attachments.upload(
            agent_id=agent, file_name="f", declared_size=len(data), chunks=_chunks(data)
        )
        await m.agents.archive(agent)

        async def crash(self: ErasureService, *args: Any) -> None:
            raise KeyboardInterrupt  # the process dies between the commit and the bytes

        monkeypatch.setattr(ErasureService, "scrub", crash)
        with pytest.raises(KeyboardInterrupt):
            await _erasure(m).delete(agent)
        monkeypatch.undo()
        path = m.config.attachments_dir / rec.sha256
        assert path.exists()
        r = {v.agent_id: v for v in await _erasure(m).receipts()}[agent]
        assert (r.machine_data, r.attachments) == ("pending", "pending")
    async with opened() as m:
        assert not path.exists()
        r = {v.agent_id: v for v in await _erasure(m).receipts()}[agent]
        assert (r.machine_data, r.attachments) == ("done", "done")


async def test_retention_sweeps_follow_the_clock(opened: Any, tmp_path: Path, clock: Clock) -> None:
    async with opened() as m:
        agent = (await m.agents.create(name="a", folder=str(tmp_path))).id
        named = await m.attachments.upload(
            agent_id=agent, file_name="f", declared_size=3, chunks=_chunks(b"abc")
        )
        unnamed = m.config.attachments_dir / hashlib.sha256(b"left").hexdigest()
        unnamed.write_bytes(b"left")
        outgoing = m.config.outgoing_dir / "export-1.tar.gz"
        outgoing.parent.mkdir(exist_ok=True)
        outgoing.write_bytes(b"x")
        real = time.time()
        for path in (unnamed, outgoing):
            os.utime(path, (real, real))

        def seed(conn: Any) -> None:
            store_erasures.add_erased(conn, "ag_old", clock.now - 399 * DAY)
            tables.log(conn, clock.now - 6 * DAY, "test.old", "")

        await m.db.write(seed)
        assert m.retention is not None
        first = await m.retention.sweep()
        assert first.attachments == first.handoff_files == first.erased_entries == 0
        assert unnamed.exists() and outgoing.exists()

        clock.now = real + 2 * DAY  # an hour and more later; the erased entry is 401 days old
        second = await m.retention.sweep()
        assert (second.attachments, second.handoff_files, second.erased_entries) == (1, 1, 1)
        assert second.log_entries == 1
        assert not unnamed.exists() and not outgoing.exists()
        assert (m.config.attachments_dir / named.sha256).exists()
        assert await _erasure(m).erased_ids() == set()


async def test_the_restore_check_counts_an_erased_agent_as_accounted_for(
    opened: Any, tmp_path: Path, clock: Clock
) -> None:
    async with opened() as m:
        agent = await _archived(m, tmp_path)
        backups = m.require_backups()
        await backups.backup_now()
        clock.now = time.time() + 1  # the delete comes after the backup
        await _erasure(m).delete(agent)
        check = await backups.restore_check()
        assert check.ok, check.problem
        receipt = {v.agent_id: v for v in await _erasure(m).receipts()}[agent]
        assert receipt.backups == "pending"  # the backup made before still holds it


async def test_deleting_an_agent_deletes_its_schedules_and_their_fires(
    opened: Any, tmp_path: Path
) -> None:
    async with opened() as m:
        agent = await m.agents.create(name="a", folder=str(tmp_path))
        other = await m.agents.create(name="b", folder=str(tmp_path))
        schedules = m.require_schedules()
        mine = await schedules.create(agent.id, "0 7 * * *", "morning summary")
        kept = await schedules.create(other.id, "0 7 * * *", "morning summary")
        await m.agents.archive(agent.id)
        await _erasure(m).delete(agent.id)
        assert [s.id for s in await schedules.list()] == [kept.id]
        rows = await m.db.read(
            lambda c: c.execute(
                "SELECT count(*) FROM schedules WHERE id = ?", (mine.id,)
            ).fetchone()[0]
        )
        assert rows == 0


async def test_an_agent_from_another_machine_is_erased_without_running_its_runtime(
    opened: Any, tmp_path: Path
) -> None:
    async with opened() as m:
        agent = await _archived(m, tmp_path, "stuck")

        def move(conn: Any) -> None:  # as if restored from another machine's backup
            conn.execute("UPDATE agents SET origin_machine = 'mc_other' WHERE id = ?", (agent,))

        await m.db.write(move)
        result = await _erasure(m).delete(agent)
        assert not result.runtime_erasure_queued
        r = {v.agent_id: v for v in await _erasure(m).receipts()}[agent]
        assert (r.state, r.machine_data, r.runtime_copy) == ("unsupported", "done", "unsupported")
        assert "mc_other" in r.detail
        assert _sample(m, "agents_machine_erasure_queue_length") == 0
