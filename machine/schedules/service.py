"""Schedules: an agent's prompt on a cron, fired as ordinary runs, each fire recorded.

Rules it keeps:

- A fire submits a normal queued run of the schedule's agent (so it waits its
  turn behind that agent's earlier prompts, like any prompt), and the
  ``schedule_runs`` row naming schedule, fire time and run commits in the
  same transaction as the run. ``(schedule_id, fire_time)`` is unique: a
  crash before the commit leaves neither (the fire is still due at the
  restart), a crash after it leaves both (the restart sees the fire recorded,
  and starts its run if it never started). A fire time never runs twice.
- At start, fire times that passed while the daemon was down are missed:
  ``skip`` drops them, ``once`` runs the latest one now as a catch-up.
  While the daemon runs, a fire found late (the loop was asleep past several
  fire times, a suspended laptop) runs its latest fire time once.
- A paused schedule never fires; resuming it plans from the resume time
  (fire times passed while paused are not caught up). Archiving an agent
  pauses its schedules; unarchiving leaves them paused for a person to resume.
- Fire times come from :mod:`machine.formats.cron` (DST rules there); nothing here
  reads the wall clock except through the injected ``clock``.
- The wall clock may step (NTP correcting it, a person setting it). Each pass
  compares it with the time elapsed on the monotonic clock since the pass
  before. A step back of more than :data:`_STEP` seconds is logged once, and
  a schedule whose last fire (or creation) now lies ahead of the wall clock
  fires again from the wall clock's next match after the step, instead of
  firing nothing until the clock is back where it was; a fire time already in
  ``schedule_runs`` (the hour replayed) still never runs twice. A schedule
  found so at start (the daemon restarted after the step) is logged and goes
  on from now. A step forward is logged, and the fire times it passed over
  are missed fires like any others (the latest one runs once).
"""

from __future__ import annotations

import asyncio
import builtins
import datetime as dt
import functools
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Final, cast

from machine.core.recorder import complete
from machine.core.runs import RunEngine
from machine.formats.cron import (
    MissedPolicy,
    fires_between,
    latest_fire,
    next_fire,
    plan_start,
    validate_cron,
)
from machine.formats.cron import validate_zone as _zone
from machine.metrics import MachineMetrics
from machine.models import (
    AgentRecord,
    AgentState,
    MachineIds,
    RunRecord,
    ScheduleRecord,
    ScheduleRunRecord,
    check_prompt,
)
from machine.storage import restored, tables
from machine.storage.db import Database
from shared.errors import InvalidArgument, InvalidState, NotFound
from shared.ids import new_id, validate_id
from shared.wakeups import wait_set

__all__ = ["MISSED_POLICIES", "Scheduler", "SchedulesService", "cron_expr"]

logger = logging.getLogger(__name__)

MISSED_POLICIES: Final = ("skip", "once")
#: The loop re-reads the schedules at least this often (a clock that jumped,
#: a change made by another writer such as a restore).
_MAX_WAIT = 60.0
_MAX_RUNS_LISTED = 1000
#: Seconds until a fire that failed (a full disk) is tried again.
_RETRY = 5.0
#: Fire times counted in one pass of fire_due (the missed ones go to a metric).
_COUNTED = 1000
#: Seconds the wall clock may move against the monotonic one between two passes
#: before it counts as a step: more than NTP's slewing does in a minute
#: (_MAX_WAIT), less than anyone setting a clock by hand.
_STEP = 5.0


def _utc(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, dt.UTC)


def cron_expr(cron: str, test_seconds: int) -> str:
    """The expression actually planned: with the test hook, a sixth (seconds) field,
    so ``* * * * *`` fires every ``test_seconds`` seconds."""
    return f"{cron} */{test_seconds}" if test_seconds else cron


def _check_agent_schedulable(
    conn: sqlite3.Connection, agent_id: str, ids: MachineIds, op: str
) -> AgentRecord:
    agent = tables.get_agent(conn, agent_id, ids.own)
    if not agent.local:
        raise InvalidState(
            op, f"agent {agent_id}'s origin is machine {agent.origin_machine}; it never runs here"
        )
    if agent.state is not AgentState.ACTIVE:
        raise InvalidState(op, f"agent {agent_id} is archived")
    return agent


def _check_rule_current(schedule: ScheduleRecord, op: str) -> None:
    """InvalidState when ``schedule``'s rule, stored by an older version (or read from
    its export), is one this version no longer accepts: it must be written anew."""
    try:
        validate_cron(schedule.cron)
        _zone(schedule.time_zone)
    except InvalidArgument as e:
        raise InvalidState(
            op, f"{e.reason}; delete the schedule and add it again with a rule accepted now"
        ) from None


class SchedulesService:
    """Create, list, pause, resume and delete schedules, and list their fires."""

    def __init__(
        self,
        db: Database,
        *,
        ids: MachineIds,
        prompt_limit: int,
        default_zone: str,
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.time,
        test_seconds: int = 0,
    ) -> None:
        self._db = db
        self._ids = ids
        self._test_seconds = test_seconds
        self._prompt_limit = prompt_limit
        self._default_zone = default_zone
        self._on_change = on_change
        self._clock = clock

    async def create(
        self, agent_id: str, cron: str, prompt: str, *, time_zone: str = "", missed: str = ""
    ) -> ScheduleRecord:
        """Add an enabled schedule to an active agent of this machine."""
        validate_id("agent", agent_id, "agent_id")
        cron = validate_cron(cron)
        zone = time_zone.strip() or self._default_zone
        _zone(zone)
        missed = missed or "skip"
        if missed not in MISSED_POLICIES:
            raise InvalidArgument("missed", f"must be skip or once, got {missed[:20]!r}")
        check_prompt(prompt, self._prompt_limit)
        now = self._clock()
        record = ScheduleRecord(
            id=new_id("schedule"),
            agent_id=agent_id,
            cron=cron,
            time_zone=zone,
            prompt=prompt,
            enabled=True,
            missed=missed,
            created_at=now,
            updated_at=now,
            last_fire=None,
        )

        def write(conn: sqlite3.Connection) -> None:
            _check_agent_schedulable(conn, agent_id, self._ids, "create schedule")
            tables.insert_schedule(conn, record)
            tables.log(conn, now, "schedule.created", record.id)

        await self._db.write(write, what=f"create schedule for agent {agent_id}")
        logger.info("schedule %s created for agent %s (%s %s)", record.id, agent_id, cron, zone)
        self._on_change()
        return record

    def next_fire(self, schedule: ScheduleRecord) -> float | None:
        """When ``schedule`` fires next (None when paused or never again)."""
        if not schedule.enabled:
            return None
        expr = cron_expr(schedule.cron, self._test_seconds)
        try:
            upcoming = next_fire(expr, _zone(schedule.time_zone), _utc(self._clock()))
        except InvalidArgument as e:
            # A rule or zone stored by an older version that this one cannot read:
            # the schedule is still listed (so it can be found and deleted), timeless.
            logger.warning("schedule %s: no next fire time: %s", schedule.id, e)
            return None
        return None if upcoming is None else upcoming.timestamp()

    async def get(self, schedule_id: str) -> ScheduleRecord:
        """One schedule; NotFound when missing."""
        validate_id("schedule", schedule_id, "schedule_id")
        return await self._db.read(lambda c: tables.get_schedule(c, schedule_id))

    async def list(self, agent_id: str = "") -> builtins.list[ScheduleRecord]:
        """Schedules of one agent (NotFound for an unknown one), or all, oldest first."""
        if not agent_id:
            await restored.ensure_loaded(self._db)  # restored schedules come with histories
            return await self._db.read(tables.list_schedules)
        validate_id("agent", agent_id, "agent_id")
        await restored.ensure_loaded(self._db, agent_id)

        def read(conn: sqlite3.Connection) -> builtins.list[ScheduleRecord]:
            tables.get_agent(conn, agent_id, self._ids.own)
            return tables.list_schedules(conn, agent_id)

        return await self._db.read(read)

    async def set_enabled(self, schedule_id: str, enabled: bool) -> ScheduleRecord:
        """Pause or resume. Resuming plans from now: fire times passed while paused are
        not caught up; a schedule of an archived agent cannot be resumed."""
        validate_id("schedule", schedule_id, "schedule_id")
        now = self._clock()
        op = f"{'resume' if enabled else 'pause'} schedule {schedule_id}"

        def write(conn: sqlite3.Connection) -> ScheduleRecord:
            current = tables.get_schedule(conn, schedule_id)
            if current.enabled == enabled:
                return current
            if enabled:
                _check_agent_schedulable(conn, current.agent_id, self._ids, op)
                _check_rule_current(current, op)
            tables.set_schedule_enabled(conn, schedule_id, enabled, now, now if enabled else None)
            tables.log(conn, now, "schedule.resumed" if enabled else "schedule.paused", schedule_id)
            return tables.get_schedule(conn, schedule_id)

        got = await self._db.write(write, what=op)
        self._on_change()
        return got

    async def delete(self, schedule_id: str) -> None:
        """Delete a schedule and its fire records (the runs stay in the conversation)."""
        validate_id("schedule", schedule_id, "schedule_id")
        now = self._clock()

        def write(conn: sqlite3.Connection) -> None:
            tables.get_schedule(conn, schedule_id)
            tables.delete_schedule(conn, schedule_id)
            tables.log(conn, now, "schedule.deleted", schedule_id)

        await self._db.write(write, what=f"delete schedule {schedule_id}")
        self._on_change()

    async def runs(self, schedule_id: str, limit: int = 100) -> builtins.list[ScheduleRunRecord]:
        """A schedule's fires, newest first."""
        validate_id("schedule", schedule_id, "schedule_id")
        if not 0 <= limit <= _MAX_RUNS_LISTED:
            raise InvalidArgument("limit", f"must be 0 to {_MAX_RUNS_LISTED}")

        def read(conn: sqlite3.Connection) -> builtins.list[ScheduleRunRecord]:
            tables.get_schedule(conn, schedule_id)
            return tables.list_schedule_runs(conn, schedule_id, limit or 100)

        return await self._db.read(read)


class Scheduler:
    """Fires due schedules as runs of the run engine (see the module docstring)."""

    def __init__(
        self,
        db: Database,
        engine: RunEngine,
        *,
        ids: MachineIds,
        metrics: MachineMetrics | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        test_seconds: int = 0,
    ) -> None:
        self._db = db
        self._engine = engine
        self._ids = ids
        self._metrics = metrics
        self._clock = clock
        self._monotonic = monotonic
        self._test_seconds = test_seconds
        self._last_read: tuple[float, float] | None = None
        """(wall, monotonic) at the last pass: what a clock step is measured against."""
        self._resume_from: dict[str, float] = {}
        """Schedules whose last fire lies ahead of the wall clock (it stepped back):
        the wall time they fire again after (see the module docstring)."""
        self._changed = asyncio.Event()
        self._unplannable: set[str] = set()
        """Schedules whose fire times could not be computed, logged once each."""
        self.next_fire_at: float | None = None
        """The soonest fire time of any enabled schedule (for the heartbeat), or None."""
        self.on_next_fire: Callable[[float | None], None] = lambda _: None
        """Called when :attr:`next_fire_at` changes."""

    def changed(self) -> None:
        """Schedules changed: re-plan now."""
        self._changed.set()

    def _expr(self, cron: str) -> str:
        return cron_expr(cron, self._test_seconds)

    async def start(self) -> int:
        """Plan every enabled schedule after a (re)start: count the fire times missed
        while down and run one catch-up for ``once``; return the runs started."""
        now = self._clock()
        schedules = await self._db.read(tables.enabled_schedules)
        started = 0
        for s in schedules:
            try:
                started += await self._start_one(s, now)
            except Exception:
                # One schedule that cannot be planned never keeps the others from theirs.
                logger.exception("schedule %s: planning it at start failed; skipped", s.id)
        await self.fire_due()
        return started

    async def _start_one(self, s: ScheduleRecord, now: float) -> int:
        plan = plan_start(
            self._expr(s.cron),
            _zone(s.time_zone),
            cast(MissedPolicy, s.missed),
            _utc(s.last_fire) if s.last_fire is not None else None,
            _utc(s.created_at),
            _utc(now),
        )
        started = 0
        if plan.missed and self._metrics is not None:
            self._metrics.schedule_missed.inc(plan.missed)
        if plan.catch_up is not None:
            logger.info(
                "schedule %s: %d fire(s) missed while down; running %s once",
                s.id,
                plan.missed,
                plan.catch_up.isoformat(),
            )
            if await self.fire(s, plan.catch_up.timestamp(), "caught_up"):
                started += 1
        if plan.missed:
            # Whatever the policy, the missed fire times are handled now.
            await self._db.write(
                functools.partial(tables.set_last_fire, schedule_id=s.id, fire_time=now)
            )
            if plan.catch_up is None:
                logger.info("schedule %s: %d missed fire(s) skipped", s.id, plan.missed)
        return started

    async def fire_due(self) -> float | None:
        """Fire every schedule whose fire time has come (its latest one, once);
        return the seconds until the next fire time, or None when none comes.

        Each schedule on its own: one whose fire times cannot be computed is
        logged (once) and skipped; one whose fire failed is tried again in
        :data:`_RETRY` seconds. Neither holds up the others.
        """
        now = self._clock()
        stepped_to = self._clock_step(now)
        schedules = await self._db.read(tables.enabled_schedules)
        soonest: float | None = None
        retry = False
        unplannable: set[str] = set()
        ahead: list[str] = []
        for s in schedules:
            try:
                expr, zone = self._expr(s.cron), _zone(s.time_zone)
                since = _utc(self._since(s, now, stepped_to, ahead))
                due = fires_between(expr, zone, since, _utc(now), limit=_COUNTED)
                if len(due) == _COUNTED:
                    # More were due than counted (a daemon asleep for days): the
                    # time that fires is still the latest, not the 1,000th.
                    due[-1] = latest_fire(expr, zone, _utc(now)) or due[-1]
                upcoming = next_fire(expr, zone, _utc(now))
            except Exception as e:
                self._skip(s, f"its fire times cannot be computed: {e!r}", unplannable)
                continue
            if upcoming is None:
                # Only a rule stored by an older version (31 February) has no fire time.
                self._skip(s, f"{s.cron!r} never fires", unplannable)
            if due:
                if len(due) > 1 and self._metrics is not None:
                    self._metrics.schedule_missed.inc(len(due) - 1)
                try:
                    await self.fire(s, due[-1].timestamp(), "fired")
                except Exception:
                    logger.exception("schedule %s: firing failed; trying again soon", s.id)
                    retry = True
            if upcoming is not None:
                at = upcoming.timestamp()
                soonest = at if soonest is None else min(soonest, at)
        self._unplannable = unplannable
        if ahead and stepped_to is None:
            # No step seen by this process (it started after it): say it once here.
            logger.warning(
                "schedule(s) %s last fired after the wall clock's now (%s): the clock went"
                " back; they fire again from its next match, and no fire time already"
                " recorded runs twice",
                ", ".join(ahead),
                _utc(now).isoformat(timespec="seconds"),
            )
        if self._metrics is not None:
            self._metrics.schedules_enabled.set(len(schedules))
        if soonest != self.next_fire_at:
            self.next_fire_at = soonest
            self.on_next_fire(soonest)
        wait = None if soonest is None else max(0.0, soonest - self._clock())
        if retry:
            wait = _RETRY if wait is None else min(wait, _RETRY)
        return wait

    def _clock_step(self, now: float) -> float | None:
        """Log a step of the wall clock since the last pass; after a step back, the
        wall time (on the new clock) from which schedules fire again, else None."""
        mono = self._monotonic()
        last, self._last_read = self._last_read, (now, mono)
        if last is None:
            return None
        elapsed = mono - last[1]
        jump = now - (last[0] + elapsed)
        if jump < -_STEP:
            # The wall time of the last pass, read on the new clock: the step came
            # after it, so matches from there on were never due before.
            resume = min(now, now - elapsed)
            logger.warning(
                "the wall clock went back by %.0fs (it said %s, now %s): schedules fire"
                " again from its next match, and no fire time already recorded runs twice",
                -jump,
                _utc(last[0] + elapsed).isoformat(timespec="seconds"),
                _utc(now).isoformat(timespec="seconds"),
            )
            self._resume_from.clear()
            return resume
        if jump > _STEP:
            logger.info(
                "the wall clock went forward by %.0fs (set ahead, or this machine slept):"
                " fire times it passed over count as missed; the latest one runs once",
                jump,
            )
        return None

    def _since(
        self, s: ScheduleRecord, now: float, stepped_to: float | None, ahead: list[str]
    ) -> float:
        """The wall time after which ``s``'s fire times are due now."""
        since = max(s.last_fire or s.created_at, s.created_at)
        if since <= now + _STEP:
            self._resume_from.pop(s.id, None)
            return since
        # Its last fire lies ahead of the clock: only a step back does that.
        if s.id not in self._resume_from:
            self._resume_from[s.id] = now if stepped_to is None else stepped_to
            if stepped_to is None:
                ahead.append(s.id)
        return self._resume_from[s.id]

    def _skip(self, s: ScheduleRecord, why: str, skipped: set[str]) -> None:
        """Log (once while it lasts) that enabled schedule ``s`` cannot fire."""
        skipped.add(s.id)
        if s.id not in self._unplannable:
            logger.error("schedule %s: %s; it is skipped (delete it and add it again)", s.id, why)

    async def fire(self, schedule: ScheduleRecord, fire_time: float, result: str) -> bool:
        """Submit ``schedule``'s run for ``fire_time`` unless that fire is recorded
        already or the schedule is no longer enabled; whether a run was made."""
        run_id = new_id("run")
        now = self._clock()
        limit = self._engine.prompt_limit

        def write(conn: sqlite3.Connection) -> tuple[RunRecord | None, str]:
            if tables.schedule_run_at(conn, schedule.id, fire_time) is not None:
                return None, ""  # recorded before a restart: never twice
            try:
                current = tables.get_schedule(conn, schedule.id)
            except NotFound:
                return None, ""  # deleted meanwhile
            if not current.enabled:
                return None, ""
            row = ScheduleRunRecord(schedule.id, fire_time, run_id, result, "", now)
            try:
                agent = tables.get_agent(conn, current.agent_id, self._ids.own)
                self._engine.check_runnable(agent)
                check_prompt(current.prompt, limit)
            except (InvalidArgument, InvalidState, NotFound) as e:
                row = replace(row, run_id="", result="refused", detail=str(e)[:500])
                tables.insert_schedule_run(conn, row)
                tables.set_last_fire(conn, schedule.id, fire_time)
                return None, row.detail
            tables.insert_run(conn, run_id, current.agent_id, current.prompt, (), now)
            tables.insert_schedule_run(conn, row)
            tables.set_last_fire(conn, schedule.id, fire_time)
            tables.log(conn, now, "schedule.fired", f"{schedule.id} {run_id}")
            return tables.get_run(conn, run_id), ""

        async def commit() -> tuple[RunRecord | None, str]:
            # Commit point: the run, its schedule_runs row and last_fire together.
            run, refused = await self._db.write(write, what=f"fire schedule {schedule.id}")
            if run is not None:
                self._engine.start_queued(run, on_start=self._lag_observer(fire_time))
            return run, refused

        run, refused = await complete(commit())
        if self._metrics is not None and (run is not None or refused):
            self._metrics.schedule_fires.labels("refused" if refused else result).inc()
        if refused:
            logger.warning("schedule %s: fire refused: %s", schedule.id, refused)
        elif run is not None:
            logger.info("schedule %s fired run %s", schedule.id, run.id)
        return run is not None

    def _lag_observer(self, fire_time: float) -> Callable[[float], None]:
        def observe(started: float) -> None:
            if self._metrics is not None:
                self._metrics.schedule_lag.observe(max(0.0, started - fire_time))

        return observe

    async def run(self) -> None:
        """Plan at start, then fire schedules as their times come, until cancelled."""
        try:
            await self.start()
        except Exception:
            logger.exception("planning the schedules at start failed")
        while True:
            self._changed.clear()
            try:
                wait = await self.fire_due()
            except Exception:
                logger.exception("firing schedules failed; retrying")
                wait = _RETRY
            # A little past the fire time: the loop's timer may wake a hair early.
            timeout = _MAX_WAIT if wait is None else min(wait + 0.01, _MAX_WAIT)
            # Wakes at the next fire time, or at once when a schedule changes.
            await wait_set(self._changed, timeout)
