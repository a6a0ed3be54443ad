"""The machine's domain wired together: database, agents, attachments, run engine.

:func:`open_machine` is the one place that builds them, as an async context
manager, so the daemon, tests and benchmarks share the same construction and
shutdown order. The pieces it is built from live in their rooms: the machine's
ids in :mod:`machine.link.machine_ids`, the backup service and its target in
:mod:`machine.backups.wiring` (the backup folder in :mod:`machine.backups.targets.folder`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from machine.backups.engine import BackupEngine
from machine.backups.handoff import Handoff
from machine.backups.service import BackupService
from machine.backups.wiring import backup_times, build_backups, open_backups_from
from machine.config import MachineConfig
from machine.core.agents import AgentsService, SessionHomes
from machine.core.attachments import AttachmentStore, remove_partial_uploads
from machine.core.runs import RunEngine
from machine.core.search_indexer import SearchIndexer
from machine.core.streams import StreamLimits
from machine.erasure.retention import Retention
from machine.erasure.service import ErasureService
from machine.link.client import AgentRoster
from machine.link.deliveries import crash_after
from machine.link.machine_ids import joined_id, machine_ids
from machine.metrics import MachineMetrics
from machine.models import AgentState, MachineIds
from machine.runtimes import RuntimeRegistry, default_registry
from machine.schedules.service import Scheduler, SchedulesService
from machine.storage import restored, tables
from machine.storage.db import Database
from machine.storage.faults import CheckResult
from shared.atomic import ensure_private_dir, write_atomic
from shared.errors import InvalidState

__all__ = ["Machine", "MachineStatus", "open_machine"]

logger = logging.getLogger(__name__)

_PRUNE_EVERY = 3600.0


@dataclass(frozen=True)
class MachineStatus:
    """Counts for ``agents-machine status``."""

    data_dir: str
    machine_id: str
    joined: bool
    active_agents: int
    archived_agents: int
    open_runs: int
    waiting_runs: int
    runtimes: list[str]
    started_at: float
    schema_version: int
    attachment_limit: int = 0
    """The largest attachment taken, in bytes (0: not told, an older daemon)."""


@dataclass
class Machine:
    """Everything the servicer calls."""

    config: MachineConfig
    db: Database
    ids: MachineIds
    agents: AgentsService
    attachments: AttachmentStore
    runs: RunEngine
    runtimes: RuntimeRegistry
    started_at: float
    streams: StreamLimits
    metrics: MachineMetrics | None = None
    backups: BackupService | None = None
    handoff: Handoff | None = None
    erasure: ErasureService | None = None
    retention: Retention | None = None
    schedules: SchedulesService | None = None
    scheduler: Scheduler | None = None

    def require_schedules(self) -> SchedulesService:
        """Schedules (always built by :func:`open_machine`)."""
        if self.schedules is None:
            raise InvalidState("schedules", "this machine was opened without schedules")
        return self.schedules

    indexer: SearchIndexer | None = None

    @property
    def machine_id(self) -> str:
        """The canonical id: the control plane's once joined, else the local one."""
        return self.ids.canonical

    async def agent_count(self) -> int:
        """How many agents this machine holds, active or archived (one COUNT)."""
        return await self.db.read(tables.count_agents)

    async def agent_roster(self) -> AgentRoster:
        """Ids of the agents this machine runs prompts for (its own), by state,
        for the control plane (never names)."""
        agents = await self.agents.list(include_archived=True)
        mine = sorted((a for a in agents if a.local), key=lambda a: a.id)
        return AgentRoster(
            active=tuple(a.id for a in mine if a.state is AgentState.ACTIVE),
            archived=tuple(a.id for a in mine if a.state is AgentState.ARCHIVED),
        )

    async def status(self) -> MachineStatus:
        """Current counts."""

        def read(conn: sqlite3.Connection) -> tuple[int, int, int, int]:
            counts = tables.state_counts(conn, "agents")
            runs = tables.state_counts(conn, "runs")
            open_runs = sum(runs.get(s, 0) for s in ("queued", "running", "waiting_permission"))
            return (
                counts.get("active", 0),
                counts.get("archived", 0),
                open_runs,
                runs.get("waiting_permission", 0),
            )

        active, archived, open_runs, waiting = await self.db.read(read)
        return MachineStatus(
            data_dir=str(self.config.data_dir),
            machine_id=self.ids.canonical,
            joined=self.ids.joined,
            active_agents=active,
            archived_agents=archived,
            open_runs=open_runs,
            waiting_runs=waiting,
            runtimes=self.runtimes.names(),
            started_at=self.started_at,
            schema_version=self.db.schema_version,
            attachment_limit=self.config.attachment_limit,
        )

    async def check_database(self, *, full: bool = True) -> CheckResult:
        """Run an integrity check of machine.db now, full or quick (damage stops writes)."""
        result = await self.db.check(full=full)
        if self.metrics is not None:
            self.metrics.observe_check("full" if full else "quick", result.ok, result.seconds)
        return result

    def require_backups(self) -> BackupService:
        """The backup service (always built by :func:`open_machine`)."""
        if self.backups is None:
            raise InvalidState("backups", "this machine was opened without backups")
        return self.backups

    def require_handoff(self) -> Handoff:
        """Exports and imports (always built by :func:`open_machine`)."""
        if self.handoff is None:
            raise InvalidState("export", "this machine was opened without Outgoing/Incoming")
        return self.handoff

    @contextlib.asynccontextmanager
    async def backups_at(self, from_dir: str = "") -> AsyncIterator[BackupEngine]:
        """The engine on the configured target, or on ``from_dir``: a backup folder (a
        copied backup dir, perhaps of a lost machine) or ``s3://bucket/prefix``, whose
        ``machine.json`` says whose backups it holds."""
        service = self.require_backups()
        if not from_dir:
            yield service.engine
            return
        registry = self.metrics.registry if self.metrics is not None else None
        async with open_backups_from(self.config, from_dir, registry) as (target, machine_id):
            yield service.engine_for(target, machine_id)

    def require_erasure(self) -> ErasureService:
        """Agent erasure (always built by :func:`open_machine`)."""
        if self.erasure is None:
            raise InvalidState("erasure", "this machine was opened without erasure")
        return self.erasure

    async def prune(self) -> int:
        """Run the retention sweeps; return how many machine log entries went."""
        if self.retention is not None:
            return (await self.retention.sweep()).log_entries
        cutoff = time.time() - self.config.event_retention_days * 86400
        return await self.db.write(lambda c: tables.prune_log(c, cutoff))


async def _check_loop(machine: Machine) -> None:
    if machine.db.after_clean_stop:
        # The start trusted the clean-stop mark, which cannot see a disk that
        # changed bits under an unchanged inode: read every page now, while the
        # daemon already answers (see machine.storage.clean_stop).
        await _check_once(machine, full=False)
    interval = machine.config.integrity_check_seconds
    stamp = full_check_stamp(machine.db.path)
    last = await asyncio.to_thread(_read_stamp, stamp)
    while True:
        await asyncio.sleep(next_full_check_in(last, time.time(), interval))
        if await _check_once(machine, full=True):
            last = time.time()
            await asyncio.to_thread(_write_stamp, stamp, last)


def full_check_stamp(db_path: Path) -> Path:
    """Where the time of machine.db's last full integrity check is kept: the check
    is due that long after the last one, not after each start (a daemon restarted
    every day would otherwise never run it)."""
    return db_path.with_name(db_path.name + ".full-check")


def next_full_check_in(last: float | None, now: float, interval: float) -> float:
    """Seconds until the next full check: ``interval`` after the ``last`` one (at
    once when that is past); a whole ``interval`` when there was none, or when
    ``last`` lies ahead of ``now`` (the clock was set back since)."""
    if last is None or last > now:
        return interval
    return max(0.0, last + interval - now)


def _read_stamp(path: Path) -> float | None:
    try:
        value = float(json.loads(path.read_text())["at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if math.isfinite(value) else None


def _write_stamp(path: Path, at: float) -> None:
    try:
        write_atomic(path, json.dumps({"at": at}).encode())
    except OSError as e:  # only the next check's timing depends on it
        logger.warning("%s: cannot record the full check's time: %s", path, e)


async def _check_once(machine: Machine, *, full: bool) -> bool:
    """One check; whether it ran to its end (found damage or not)."""
    kind = "integrity check" if full else "quick check"
    try:
        result = await machine.check_database(full=full)
    except Exception:
        logger.exception("the %s of machine.db failed to run", kind)
        return False
    if result.ok:
        logger.info("%s of machine.db: ok (%.1f s)", kind, result.seconds)
    return True


class _StartSteps:
    """How long each step of a start took: a gauge per step and one log line, so a
    slow start names its step (the bench reads the same figures)."""

    def __init__(self, metrics: MachineMetrics | None) -> None:
        self._metrics = metrics
        self._began = self._last = time.perf_counter()
        self._steps: list[tuple[str, float]] = []

    def done(self, step: str) -> None:
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        self._steps.append((step, seconds))
        if self._metrics is not None:
            self._metrics.start_seconds.labels(step).set(seconds)

    def report(self) -> None:
        total = time.perf_counter() - self._began
        if self._metrics is not None:
            self._metrics.start_seconds.labels("total").set(total)
        logger.info(
            "machine open in %.2f s (%s)",
            total,
            ", ".join(f"{step} {seconds:.2f} s" for step, seconds in self._steps),
        )


async def _prune_loop(machine: Machine) -> None:
    while True:
        try:
            removed = await machine.prune()
            if removed:
                logger.info("pruned %d machine log entries", removed)
        except Exception:
            logger.exception("pruning the machine log failed")
        await asyncio.sleep(_PRUNE_EVERY)


@contextlib.asynccontextmanager
async def open_machine(
    config: MachineConfig,
    *,
    metrics: MachineMetrics | None = None,
    runtimes: RuntimeRegistry | None = None,
    clock: Callable[[], float] = time.time,
) -> AsyncIterator[Machine]:
    """Open the data folder and database, recover runs, and yield the machine.

    ``clock`` is the time the retention sweeps and erasures read (tests move it).

    On exit, runs get ``config.shutdown_grace_seconds`` to end, then are
    interrupted; runs waiting for a person stay waiting.
    """
    steps = _StartSteps(metrics)
    ensure_private_dir(config.data_dir)
    ensure_private_dir(config.attachments_dir)
    # No upload runs yet: any upload temp file is left over from a killed process.
    await asyncio.to_thread(remove_partial_uploads, config.attachments_dir)
    db = await Database.open(
        config.db_path,
        on_commit=metrics.observe_commit if metrics is not None else None,
        on_fault=metrics.observe_fault if metrics is not None else None,
    )
    steps.done("open database")
    if metrics is not None:
        metrics.db_damaged.set(0)
        if db.open_check is not None:
            metrics.observe_check("quick", db.open_check.ok, db.open_check.seconds)
        start_check = "skipped" if db.after_clean_stop else "quick" if db.open_check else "none"
        metrics.db_opens.labels(start_check).inc()
    loops: list[asyncio.Task[None]] = []
    closing: list[Callable[[], Awaitable[None]]] = []
    engine: RunEngine | None = None
    try:
        joined, link_id = await asyncio.to_thread(joined_id, config.data_dir)
        ids = await db.write(lambda c: machine_ids(c, joined, link_id))
        steps.done("machine ids")
        registry = runtimes or default_registry(
            claude_home=config.claude_home, codex_home=config.codex_home
        )
        attachments = AttachmentStore(
            db, config.attachments_dir, limit=config.attachment_limit, machine_id=ids.canonical
        )
        engine = RunEngine(
            db,
            ids=ids,
            runtimes=registry,
            attachments=attachments,
            prompt_limit=config.prompt_limit,
            metrics=metrics,
        )
        handoff = Handoff(
            db,
            machine_id=ids.canonical,
            own_ids=ids.own,
            after_load=crash_after(config.crash_in_transfer_after, "agents loaded in a transfer"),
            attachments_dir=config.attachments_dir,
            outgoing=config.outgoing_dir,
            incoming=config.incoming_dir,
            clock=clock,
            homes=SessionHomes(config.claude_home, config.codex_home),
        )
        backups = await build_backups(config, db, ids, metrics, closing)
        steps.done("backups")
        erasure = ErasureService(
            db,
            ids=ids,
            runs=engine,
            registry=registry,
            attachments_dir=config.attachments_dir,
            metrics=metrics,
            backup_times=backup_times(backups),
            clock=clock,
        )
        retention = Retention(
            db,
            attachments_dir=config.attachments_dir,
            erasure=erasure,
            handoff=handoff,
            log_days=config.event_retention_days,
            clock=clock,
        )
        machine = Machine(
            config=config,
            db=db,
            ids=ids,
            agents=AgentsService(db, ids=ids, runtimes=registry),
            attachments=attachments,
            runs=engine,
            runtimes=registry,
            started_at=clock(),
            streams=StreamLimits(
                per_client=config.max_streams_per_client,
                total=config.max_streams,
                metrics=metrics,
            ),
            metrics=metrics,
            backups=backups,
            handoff=handoff,
            erasure=erasure,
            retention=retention,
        )
        scheduler = Scheduler(
            db,
            engine,
            ids=ids,
            metrics=metrics,
            test_seconds=config.schedule_test_seconds,
        )
        machine.scheduler = scheduler
        machine.schedules = SchedulesService(
            db,
            ids=ids,
            prompt_limit=config.prompt_limit,
            default_zone=config.time_zone,
            on_change=scheduler.changed,
            test_seconds=config.schedule_test_seconds,
        )
        # Always on (not a timer but unfinished work): resumes a killed daemon's backlog
        # (restored histories to load, then to index); packs no history is in go first.
        await restored.sweep_packs(db)
        steps.done("restored packs")
        machine.indexer = SearchIndexer(
            db,
            registry=metrics.registry if metrics is not None else None,
            after_load=crash_after(config.crash_in_history_load_after, "restored histories loaded"),
        )
        if machine.backups is not None:
            machine.backups.on_restored = machine.indexer.kick
        loops.append(asyncio.create_task(machine.indexer.run(), name="machine-search-indexer"))
        # Exports and imports a killed daemon left behind for over an hour go now.
        await handoff.sweep()
        steps.done("exports and imports")
        # Bytes a delete left behind (a crash after its commit), then every
        # retention rule: exports and imports a killed daemon left for over an
        # hour, unnamed attachments, old log and erased-list entries.
        await erasure.finish_pending()
        steps.done("erasures")
        await retention.sweep()
        steps.done("retention")
        await erasure.refresh_gauges()
        steps.done("erasure gauges")
        interrupted = await engine.start()
        steps.done("runs")
        if interrupted:
            logger.warning(
                "%d run(s) were in flight at the last stop: marked interrupted", interrupted
            )
        if config.scheduler:
            # After the engine's recovery: a fire's run recorded before a crash is
            # started by the engine, and the scheduler sees the fire as recorded.
            loops.append(asyncio.create_task(scheduler.run(), name="machine-scheduler"))
        # Not a periodic job: queued runtime erasures get their one try per start.
        loops.append(asyncio.create_task(erasure.queue.run(), name="machine-erasure-queue"))
        if config.background_loops:
            loops.append(asyncio.create_task(_prune_loop(machine), name="machine-log-prune"))
            loops.append(asyncio.create_task(_check_loop(machine), name="machine-db-check"))
            if machine.backups is not None:
                loops.append(
                    asyncio.create_task(machine.backups.run_daily(), name="machine-backup-daily")
                )
                if machine.backups.interval is not None:
                    loops.append(
                        asyncio.create_task(
                            machine.backups.run_continuous(), name="machine-backup-continuous"
                        )
                    )
        steps.report()
        yield machine
    finally:
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        if engine is not None:
            await engine.close(config.shutdown_grace_seconds)
        for close in closing:
            await close()
        await db.close()
