"""The scheduler and a wall clock that steps (injected wall and monotonic clocks)."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from machine.app import Machine, open_machine
from machine.config import MachineConfig
from machine.metrics import MachineMetrics
from machine.schedules.service import Scheduler, SchedulesService


def ts(*args: int) -> float:
    return dt.datetime(*args, tzinfo=dt.UTC).timestamp()


class Clocks:
    """A wall clock and a monotonic one: ``advance`` moves both, ``step`` the wall only."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.mono = 1000.0

    def wall(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.mono

    def advance_to(self, when: float) -> None:
        self.mono += when - self.now
        self.now = when

    def step(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
async def machine(machine_config: MachineConfig) -> AsyncIterator[Machine]:
    # The daemon's own scheduler is off: each test drives one with its clocks.
    async with open_machine(replace(machine_config, scheduler=False)) as m:
        yield m


class Rig:
    def __init__(self, m: Machine, clocks: Clocks) -> None:
        self.m = m
        self.clocks = clocks
        self.metrics = MachineMetrics(CollectorRegistry())
        self.svc = SchedulesService(
            m.db, ids=m.ids, prompt_limit=4096, default_zone="UTC", clock=clocks.wall
        )
        self.scheduler = self.new_scheduler()

    def new_scheduler(self) -> Scheduler:
        """A fresh scheduler on the same database: what a restart makes."""
        return Scheduler(
            self.m.db,
            self.m.runs,
            ids=self.m.ids,
            metrics=self.metrics,
            clock=self.clocks.wall,
            monotonic=self.clocks.monotonic,
        )

    async def fire_times(self, schedule_id: str) -> list[float]:
        """Every recorded fire time, in order (the table keeps each one once)."""
        return sorted(r.fire_time for r in await self.svc.runs(schedule_id))


@pytest.fixture
async def rig(machine: Machine) -> Rig:
    return Rig(machine, Clocks(ts(2026, 3, 27, 12, 0, 30)))


async def _quarterly(rig: Rig, tmp_path: Path) -> str:
    agent = await rig.m.agents.create(name="a", folder=str(tmp_path))
    return (await rig.svc.create(agent.id, "*/15 * * * *", "check")).id


async def test_after_a_step_back_it_fires_at_the_next_match_and_never_twice(
    rig: Rig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = await _quarterly(rig, tmp_path)
    for at in (ts(2026, 3, 27, 12, 15, 1), ts(2026, 3, 27, 12, 30, 1)):
        rig.clocks.advance_to(at)
        await rig.scheduler.fire_due()
    assert await rig.fire_times(s) == [ts(2026, 3, 27, 12, 15), ts(2026, 3, 27, 12, 30)]

    with caplog.at_level(logging.INFO, logger="machine.schedules.service"):
        rig.clocks.step(-3600)  # 11:30:01
        wait = await rig.scheduler.fire_due()
        assert wait == pytest.approx(ts(2026, 3, 27, 11, 45) - rig.clocks.now)
        steps = [r for r in caplog.records if "went back" in r.getMessage()]
        assert len(steps) == 1 and "by 3600s" in steps[0].getMessage()

        # The next match on the stepped clock fires (before: nothing until 12:30).
        for at in (ts(2026, 3, 27, 11, 45, 1), ts(2026, 3, 27, 12, 0, 1)):
            rig.clocks.advance_to(at)
            await rig.scheduler.fire_due()
        # 12:15 and 12:30 come round again: recorded already, so they do not run.
        for at in (ts(2026, 3, 27, 12, 15, 1), ts(2026, 3, 27, 12, 30, 1)):
            rig.clocks.advance_to(at)
            await rig.scheduler.fire_due()
        rig.clocks.advance_to(ts(2026, 3, 27, 12, 45, 1))
        await rig.scheduler.fire_due()
    assert await rig.fire_times(s) == [
        ts(2026, 3, 27, 11, 45),
        ts(2026, 3, 27, 12, 0),
        ts(2026, 3, 27, 12, 15),
        ts(2026, 3, 27, 12, 30),
        ts(2026, 3, 27, 12, 45),
    ]
    agent = (await rig.svc.get(s)).agent_id
    assert len(await rig.m.runs.list_runs(agent)) == 5
    assert len([r for r in caplog.records if "went back" in r.getMessage()]) == 1


async def test_a_daemon_started_after_a_step_back_says_so_and_fires(
    rig: Rig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = await _quarterly(rig, tmp_path)
    rig.clocks.advance_to(ts(2026, 3, 27, 12, 30, 1))
    await rig.scheduler.fire_due()
    # Down, then up again on a clock set back an hour and a half (11:00:01).
    rig.clocks.step(-5400)
    restarted = rig.new_scheduler()
    with caplog.at_level(logging.WARNING, logger="machine.schedules.service"):
        assert await restarted.start() == 0
        rig.clocks.advance_to(ts(2026, 3, 27, 11, 15, 1))
        await restarted.fire_due()
        rig.clocks.advance_to(ts(2026, 3, 27, 11, 30, 1))
        await restarted.fire_due()
    lines = [r.getMessage() for r in caplog.records if "clock went back" in r.getMessage()]
    assert len(lines) == 1 and s in lines[0]
    assert await rig.fire_times(s) == [
        ts(2026, 3, 27, 11, 15),
        ts(2026, 3, 27, 11, 30),
        ts(2026, 3, 27, 12, 30),
    ]


async def test_a_step_forward_is_logged_and_its_fire_times_are_missed_fires(
    rig: Rig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = await _quarterly(rig, tmp_path)
    rig.clocks.advance_to(ts(2026, 3, 27, 12, 15, 1))
    await rig.scheduler.fire_due()
    with caplog.at_level(logging.INFO, logger="machine.schedules.service"):
        rig.clocks.step(3600)  # 13:15:01: 12:30 ... 13:15 passed over
        await rig.scheduler.fire_due()
    assert "went forward by 3600s" in caplog.text
    # As before: the latest one runs once, the others are counted as missed.
    assert await rig.fire_times(s) == [ts(2026, 3, 27, 12, 15), ts(2026, 3, 27, 13, 15)]
    assert rig.metrics.schedule_missed._value.get() == 3


async def test_a_steady_clock_logs_no_step(
    rig: Rig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await _quarterly(rig, tmp_path)
    with caplog.at_level(logging.INFO, logger="machine.schedules.service"):
        for minutes in (1, 2, 3):
            rig.clocks.advance_to(ts(2026, 3, 27, 12, minutes))
            rig.clocks.step(1)  # a second of NTP slew: within the bound
            await rig.scheduler.fire_due()
    assert "wall clock" not in caplog.text
