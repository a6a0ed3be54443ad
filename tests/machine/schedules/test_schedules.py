"""machine.schedules.service with an injected clock: fires, DST, missed fires, pause, archive."""

from __future__ import annotations

import datetime as dt
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from machine.app import Machine, open_machine
from machine.config import MachineConfig
from machine.metrics import MachineMetrics
from machine.models import RunState, ScheduleRecord, ScheduleRunRecord
from machine.schedules.service import Scheduler, SchedulesService
from machine.storage import tables
from machine.storage.tables.schedules import load_schedules
from shared.errors import DiskFull, InvalidArgument, InvalidState, NotFound, TooLarge
from shared.ids import new_id
from tests.helpers.runs import wait_for_state


def ts(*args: int) -> float:
    return dt.datetime(*args, tzinfo=dt.UTC).timestamp()


class Clock:
    """Unix seconds a test moves by hand."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def machine(machine_config: MachineConfig) -> AsyncIterator[Machine]:
    # The daemon's own scheduler is off: each test drives one with its clock.
    async with open_machine(replace(machine_config, scheduler=False)) as m:
        yield m


class Rig:
    def __init__(self, m: Machine, clock: Clock) -> None:
        self.m = m
        self.clock = clock
        self.metrics = MachineMetrics(CollectorRegistry())
        self.svc = SchedulesService(
            m.db, ids=m.ids, prompt_limit=4096, default_zone="Europe/Berlin", clock=clock
        )
        self.scheduler = self.new_scheduler()

    def new_scheduler(self) -> Scheduler:
        """A fresh scheduler on the same database: what a restart makes."""
        return Scheduler(
            self.m.db, self.m.runs, ids=self.m.ids, metrics=self.metrics, clock=self.clock
        )

    def fires(self, result: str) -> float:
        return self.metrics.schedule_fires.labels(result)._value.get()

    async def runs(self, schedule_id: str) -> list[tuple[float, str, str]]:
        got = await self.svc.runs(schedule_id)
        return sorted((r.fire_time, r.result, r.run_id) for r in got)


@pytest.fixture
async def rig(machine: Machine, tmp_path: Path) -> Rig:
    return Rig(machine, Clock(ts(2026, 3, 27, 12)))


async def _agent(m: Machine, tmp_path: Path) -> str:
    return (await m.agents.create(name="a", folder=str(tmp_path))).id


async def test_fires_a_run_recorded_as_a_schedule_run(rig: Rig, tmp_path: Path) -> None:
    agent = await _agent(rig.m, tmp_path)
    s = await rig.svc.create(agent, "0 7 * * *", "morning summary")
    assert s.time_zone == "Europe/Berlin" and s.enabled and s.missed == "skip"
    assert rig.svc.next_fire(s) == ts(2026, 3, 28, 6)
    assert await rig.scheduler.fire_due() == pytest.approx(ts(2026, 3, 28, 6) - rig.clock.now)
    assert await rig.runs(s.id) == []  # nothing due yet

    rig.clock.now = ts(2026, 3, 28, 6, 0, 1)
    await rig.scheduler.fire_due()
    [(fire, result, run_id)] = await rig.runs(s.id)
    assert (fire, result) == (ts(2026, 3, 28, 6), "fired")
    run = await wait_for_state(rig.m, run_id, RunState.FINISHED)
    assert run.prompt == "morning summary" and run.agent_id == agent
    assert rig.fires("fired") == 1
    assert rig.metrics.schedule_lag._sum.get() >= 1.0  # started a second after the fire time

    # The same fire time is never fired twice, whatever asks.
    await rig.scheduler.fire_due()
    assert not await rig.scheduler.fire(s, ts(2026, 3, 28, 6), "fired")
    assert len(await rig.m.runs.list_runs(agent)) == 1


async def test_daily_fire_follows_dst_in_its_zone(rig: Rig, tmp_path: Path) -> None:
    agent = await _agent(rig.m, tmp_path)
    # 02:30 Berlin does not exist on 2026-03-29: it fires once, at the jump (01:00 UTC).
    s = await rig.svc.create(agent, "30 2 * * *", "check", time_zone="Europe/Berlin")
    for day in (28, 29, 30):
        rig.clock.now = ts(2026, 3, day, 12)
        await rig.scheduler.fire_due()
    fires = [f for f, _, _ in await rig.runs(s.id)]
    assert fires == [ts(2026, 3, 28, 1, 30), ts(2026, 3, 29, 1, 0), ts(2026, 3, 30, 0, 30)]


@pytest.mark.parametrize(("policy", "caught_up"), [("skip", False), ("once", True)])
async def test_fire_times_missed_while_down(
    rig: Rig, tmp_path: Path, policy: str, caught_up: bool
) -> None:
    agent = await _agent(rig.m, tmp_path)
    s = await rig.svc.create(agent, "0 * * * *", "hourly", time_zone="UTC", missed=policy)
    rig.clock.now = ts(2026, 3, 27, 13, 0, 5)
    await rig.scheduler.fire_due()
    assert [f for f, _, _ in await rig.runs(s.id)] == [ts(2026, 3, 27, 13)]

    # Down from 13:00:05 to 16:30: 14:00, 15:00 and 16:00 were missed.
    rig.clock.now = ts(2026, 3, 27, 16, 30)
    restarted = rig.new_scheduler()
    assert await restarted.start() == (1 if caught_up else 0)
    got = await rig.runs(s.id)
    if caught_up:
        assert [(f, r) for f, r, _ in got] == [
            (ts(2026, 3, 27, 13), "fired"),
            (ts(2026, 3, 27, 16), "caught_up"),  # the latest missed one, once
        ]
    else:
        assert len(got) == 1
    assert rig.metrics.schedule_missed._value.get() == 3
    assert rig.fires("caught_up") == (1 if caught_up else 0)
    # A second restart at the same time adds nothing; the next hour fires normally.
    assert await rig.new_scheduler().start() == 0
    rig.clock.now = ts(2026, 3, 27, 17, 0, 1)
    await restarted.fire_due()
    got = await rig.runs(s.id)
    assert got[-1][:2] == (ts(2026, 3, 27, 17), "fired")
    assert len(got) == (3 if caught_up else 2)


async def test_after_days_asleep_the_latest_fire_time_fires_once(rig: Rig, tmp_path: Path) -> None:
    agent = await _agent(rig.m, tmp_path)
    s = await rig.svc.create(agent, "* * * * *", "every minute", time_zone="UTC")
    rig.clock.now = ts(2026, 3, 27, 13, 0, 5)
    await rig.scheduler.fire_due()
    # The machine slept two days (a laptop lid): 2,880 fire times passed, more
    # than one pass counts.
    rig.clock.now = ts(2026, 3, 29, 13, 0, 30)
    await rig.scheduler.fire_due()
    assert [f for f, _, _ in await rig.runs(s.id)][-1] == ts(2026, 3, 29, 13, 0)
    await rig.scheduler.fire_due()  # and not again
    assert len(await rig.runs(s.id)) == 2


async def test_paused_schedule_does_not_fire_and_resumes_from_now(rig: Rig, tmp_path: Path) -> None:
    agent = await _agent(rig.m, tmp_path)
    s = await rig.svc.create(agent, "0 * * * *", "hourly", time_zone="UTC", missed="once")
    paused = await rig.svc.set_enabled(s.id, False)
    assert not paused.enabled and rig.svc.next_fire(paused) is None
    rig.clock.now = ts(2026, 3, 27, 15, 30)
    await rig.scheduler.fire_due()
    await rig.new_scheduler().start()
    assert await rig.runs(s.id) == []
    # Resumed: hours passed while paused are not caught up, even with `once`.
    await rig.svc.set_enabled(s.id, True)
    await rig.new_scheduler().start()
    assert await rig.runs(s.id) == []
    rig.clock.now = ts(2026, 3, 27, 16, 0, 1)
    await rig.scheduler.fire_due()
    assert [f for f, _, _ in await rig.runs(s.id)] == [ts(2026, 3, 27, 16)]


async def test_archiving_the_agent_pauses_its_schedules(rig: Rig, tmp_path: Path) -> None:
    agent = await _agent(rig.m, tmp_path)
    s = await rig.svc.create(agent, "0 * * * *", "hourly", time_zone="UTC")
    await rig.m.agents.archive(agent)
    assert not (await rig.svc.get(s.id)).enabled
    rig.clock.now = ts(2026, 3, 27, 15, 30)
    await rig.scheduler.fire_due()
    assert await rig.runs(s.id) == []
    with pytest.raises(InvalidState, match="archived"):
        await rig.svc.set_enabled(s.id, True)
    with pytest.raises(InvalidState, match="archived"):
        await rig.svc.create(agent, "0 * * * *", "x")
    # Unarchiving leaves it paused for a person to resume.
    await rig.m.agents.unarchive(agent)
    assert not (await rig.svc.get(s.id)).enabled


async def test_fire_for_an_agent_that_cannot_run_is_recorded_refused(
    rig: Rig, tmp_path: Path
) -> None:
    agent = await _agent(rig.m, tmp_path)
    s = await rig.svc.create(agent, "0 * * * *", "hourly", time_zone="UTC")

    def remove_its_runtime(conn: sqlite3.Connection) -> None:
        conn.execute("UPDATE agents SET runtime = 'gone' WHERE id = ?", (agent,))

    await rig.m.db.write(remove_its_runtime)
    rig.clock.now = ts(2026, 3, 27, 13, 0, 1)
    await rig.scheduler.fire_due()
    [(fire, result, run_id)] = await rig.runs(s.id)
    assert (result, run_id) == ("refused", "")
    assert rig.fires("refused") == 1
    assert await rig.m.runs.list_runs(agent) == []


async def _stored_by_an_older_version(rig: Rig, agent: str, cron: str, zone: str) -> str:
    """An enabled schedule with a rule this version refuses, written as an older one did;
    created an hour ago, so the scheduler comes to it before the test's others."""
    record = ScheduleRecord(
        id=new_id("schedule"),
        agent_id=agent,
        cron=cron,
        time_zone=zone,
        prompt="old",
        enabled=True,
        missed="once",
        created_at=rig.clock.now - 3600,
        updated_at=rig.clock.now - 3600,
        last_fire=None,
    )
    await rig.m.db.write(lambda conn: tables.insert_schedule(conn, record))
    return record.id


@pytest.mark.parametrize(
    ("cron", "zone"),
    [
        ("0 0 31 2 *", "UTC"),  # never fires: croniter raised CroniterBadDateError
        ("61 * * * *", "UTC"),  # croniter cannot read it
        ("0 7 * * *", "Mars/Olympus"),  # a zone this machine does not know
    ],
)
async def test_a_stored_schedule_that_cannot_fire_holds_up_no_other(
    rig: Rig, tmp_path: Path, cron: str, zone: str
) -> None:
    agent = await _agent(rig.m, tmp_path)
    bad = await _stored_by_an_older_version(rig, agent, cron, zone)
    good = await rig.svc.create(agent, "0 * * * *", "hourly", time_zone="UTC", missed="once")

    # Listed (so it can be found and deleted), without a next fire time.
    listed = await rig.svc.list()
    assert [s.id for s in listed] == [bad, good.id]
    assert [rig.svc.next_fire(s) for s in listed] == [None, ts(2026, 3, 27, 13)]

    assert await rig.scheduler.start() == 0
    assert rig.scheduler.next_fire_at == ts(2026, 3, 27, 13)
    rig.clock.now = ts(2026, 3, 27, 13, 0, 5)
    await rig.scheduler.fire_due()
    # Down from 13:00:05 to 15:30: the restart still catches the good one up.
    rig.clock.now = ts(2026, 3, 27, 15, 30)
    assert await rig.new_scheduler().start() == 1
    assert [(f, r) for f, r, _ in await rig.runs(good.id)] == [
        (ts(2026, 3, 27, 13), "fired"),
        (ts(2026, 3, 27, 15), "caught_up"),
    ]
    assert await rig.runs(bad) == []

    # It cannot be resumed as it is; it can be deleted.
    await rig.svc.set_enabled(bad, False)
    with pytest.raises(InvalidState, match="delete the schedule and add it again"):
        await rig.svc.set_enabled(bad, True)
    await rig.svc.delete(bad)
    assert [s.id for s in await rig.svc.list()] == [good.id]


async def test_an_export_with_a_rule_this_version_refuses_still_loads_paused(
    rig: Rig, tmp_path: Path
) -> None:
    agent = await _agent(rig.m, tmp_path)

    def row(cron: str) -> dict[str, object]:
        return {
            "id": new_id("schedule"),
            "cron": cron,
            "time_zone": "UTC",
            "prompt": "p",
            "missed": "skip",
            "enabled": True,
            "created_at": 1.0,
            "updated_at": 1.0,
            "last_fire": None,
            "runs": [],
        }

    # Written by an older version: a backup with them must still restore.
    rows = [row("0 0 31 2 *"), row("5/15 * * * *")]
    loaded = await rig.m.db.write(lambda c: load_schedules(c, agent, rows, "x.jsonl"))
    assert loaded == 2
    got = await rig.svc.list(agent)
    # (Both made in one millisecond: their order is their ids' random part.)
    assert sorted((s.cron, s.enabled) for s in got) == [
        ("0 0 31 2 *", False),
        ("5/15 * * * *", False),
    ]
    with pytest.raises(InvalidState, match="a step follows"):
        await rig.svc.set_enabled(next(s.id for s in got if s.cron == "5/15 * * * *"), True)
    # What croniter cannot read at all is refused, as before.
    with pytest.raises(InvalidArgument, match="x.jsonl line 1"):
        await rig.m.db.write(lambda c: load_schedules(c, agent, [row("61 * * * *")], "x.jsonl"))


async def test_a_fire_that_fails_holds_up_no_other_and_is_tried_again(
    rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = await _agent(rig.m, tmp_path)
    first = await rig.svc.create(agent, "0 * * * *", "one", time_zone="UTC")
    rig.clock.now += 1
    second = await rig.svc.create(agent, "0 * * * *", "two", time_zone="UTC")
    fire = rig.scheduler.fire

    async def disk_full_for_the_first(s: ScheduleRecord, fire_time: float, result: str) -> bool:
        if s.id == first.id:
            raise DiskFull("fire schedule", "/data")
        return await fire(s, fire_time, result)

    monkeypatch.setattr(rig.scheduler, "fire", disk_full_for_the_first)
    rig.clock.now = ts(2026, 3, 27, 13, 0, 5)
    assert await rig.scheduler.fire_due() == 5.0, "tried again in 5 s, not at 14:00"
    assert await rig.runs(first.id) == []
    assert [f for f, _, _ in await rig.runs(second.id)] == [ts(2026, 3, 27, 13)]
    monkeypatch.setattr(rig.scheduler, "fire", fire)
    rig.clock.now += 5
    await rig.scheduler.fire_due()
    assert [f for f, _, _ in await rig.runs(first.id)] == [ts(2026, 3, 27, 13)]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"cron": "61 * * * *"}, InvalidArgument, "cron"),
        ({"cron": "* * * *"}, InvalidArgument, "cron"),
        ({"cron": "0 0 31 2 *"}, InvalidArgument, "cron: '0 0 31 2 \\*' never fires"),
        ({"cron": "R * * * *"}, InvalidArgument, "cron: 'R \\* \\* \\* \\*': minute field"),
        ({"time_zone": "Mars/Olympus"}, InvalidArgument, "time_zone"),
        ({"missed": "twice"}, InvalidArgument, "missed"),
        ({"prompt": "x" * 5000}, TooLarge, "prompt"),
        ({"prompt": "  "}, InvalidArgument, "prompt"),
    ],
)
async def test_bad_input_is_refused_and_nothing_written(
    rig: Rig, tmp_path: Path, kwargs: dict[str, str], error: type[Exception], match: str
) -> None:
    agent = await _agent(rig.m, tmp_path)
    args = {"cron": "0 7 * * *", "prompt": "hi", **kwargs}
    with pytest.raises(error, match=match):
        await rig.svc.create(
            agent,
            args["cron"],
            args["prompt"],
            time_zone=args.get("time_zone", ""),
            missed=args.get("missed", ""),
        )
    assert await rig.svc.list() == []


async def test_unknown_ids(rig: Rig) -> None:
    with pytest.raises(NotFound):
        await rig.svc.create("ag_" + "0" * 26, "0 7 * * *", "hi")
    with pytest.raises(NotFound):
        await rig.svc.delete("sch_" + "0" * 26)
    with pytest.raises(InvalidArgument, match="schedule_id"):
        await rig.svc.runs("../x")


async def test_delete_agent_schedules_in_the_callers_transaction(rig: Rig, tmp_path: Path) -> None:
    agent = await _agent(rig.m, tmp_path)
    s = await rig.svc.create(agent, "0 * * * *", "hourly", time_zone="UTC")
    rig.clock.now = ts(2026, 3, 27, 13, 0, 1)
    await rig.scheduler.fire_due()

    def erase(conn: sqlite3.Connection) -> int:
        return tables.delete_agent_schedules(conn, agent)

    assert await rig.m.db.write(erase) == 1
    assert await rig.svc.list() == []
    left = await rig.m.db.read(
        lambda c: c.execute(
            "SELECT COUNT(*) FROM schedule_runs WHERE schedule_id = ?", (s.id,)
        ).fetchone()[0]
    )
    assert left == 0


async def test_fire_recorded_just_before_a_crash_runs_at_the_restart(
    machine_config: MachineConfig, tmp_path: Path
) -> None:
    config = replace(machine_config, scheduler=False)
    async with open_machine(config) as m:
        agent = await _agent(m, tmp_path)
        svc = SchedulesService(m.db, ids=m.ids, prompt_limit=4096, default_zone="UTC")
        s = await svc.create(agent, "0 * * * *", "hourly")

        def committed_then_crashed(conn: sqlite3.Connection) -> None:
            # What a fire commits; the daemon dies before it drives the run.
            tables.insert_run(conn, "run_" + "1" * 26, agent, "hourly", (), 1.0)
            tables.insert_schedule_run(
                conn, ScheduleRunRecord(s.id, 3600.0, "run_" + "1" * 26, "fired", "", 1.0)
            )
            tables.insert_run(conn, "run_" + "2" * 26, agent, "a prompt", (), 2.0)

        await m.db.write(committed_then_crashed)
    async with open_machine(config) as m:
        # The recorded fire's run starts (nobody would fire it again); an ordinary
        # queued prompt is interrupted, as before.
        await wait_for_state(m, "run_" + "1" * 26, RunState.FINISHED)
        assert (await m.runs.get_run("run_" + "2" * 26)).state is RunState.INTERRUPTED
