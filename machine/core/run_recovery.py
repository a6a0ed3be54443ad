"""Recovering runs: after a restart, and after their events could not be stored.

- At start, runs that were queued or running are marked interrupted and get
  exactly one RUN_ERROR code RUN_INTERRUPTED (in the same transaction as the
  state change, so a second restart adds nothing). Runs waiting for a
  permission stay waiting (once answered they resume, see
  :mod:`machine.core.permissions`); queued runs with a prompt id (acknowledged to the
  control plane) or a recorded schedule fire are started instead, since nobody
  would send them again. :func:`recover_at_start` sorts them.
- When a run's events cannot be stored (a full disk, a damaged database), the
  run ends with RUN_ERROR code STORAGE_FAILED. If even that event cannot be
  stored, its followers fail with the storage error instead of waiting for
  ever, and the run stays registered (open in the database): it is ended with
  STORAGE_FAILED as soon as the database accepts writes again (retried with
  backoff), a cancel can still end it, and a restart interrupts it.
  :class:`StorageRecovery` keeps these rules.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from machine.core.recorder import EventRecorder
from machine.models import RunErrorCode, RunRecord, RunState, StoredEvent
from machine.storage import tables
from machine.storage.db import Database
from shared.errors import AgentsError, DatabaseDamaged, DiskFull, StoreError

__all__ = [
    "ActiveRun",
    "CancelReason",
    "Recovered",
    "StorageRecovery",
    "recover_at_start",
    "storage_fault",
]

logger = logging.getLogger(__name__)

CancelReason = Literal["user", "shutdown"]
"""Why a run's task was cancelled: a person cancelled the run, or the daemon stops."""

# Retrying the final event of a run whose storage failed: first after this
# long, doubling up to the cap (a freed disk is noticed within the cap).
_END_RETRY_FIRST = 0.2
_END_RETRY_MAX = 5.0


def storage_fault(error: BaseException) -> bool:
    """Whether ``error`` is the database failing to store, not the run failing."""
    return isinstance(error, DiskFull | DatabaseDamaged | StoreError)


@dataclass
class ActiveRun:
    """In-memory state of one open run the engine drives."""

    run: RunRecord
    task: asyncio.Task[None] | None = None
    cancel_reason: CancelReason | None = None
    # The run ended in the engine but its final event could not be stored.
    unended: bool = False
    # The first storage failure met while storing the run's events.
    store_error: str | None = None
    # Held while storing the final event of an unended run (retry loop or cancel).
    ending: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True)
class Recovered:
    """What :func:`recover_at_start` found: runs to park and runs to start."""

    interrupted: int
    # Waiting for a person: parked until someone answers or cancels.
    waiting: list[RunRecord]
    # Queued and never started, but nobody would send them again: start them,
    # in creation order (each agent's prompts keep theirs).
    delivered: list[RunRecord]


async def recover_at_start(db: Database, recorder: EventRecorder, now: float) -> Recovered:
    """Interrupt the runs a stop left open; sort out the runs to park and to start."""

    def recover(
        conn: sqlite3.Connection,
    ) -> tuple[list[StoredEvent], list[RunRecord], list[RunRecord]]:
        events = []
        delivered = []
        for run in tables.runs_in_states(conn, (RunState.QUEUED, RunState.RUNNING)):
            if run.state is RunState.QUEUED and (
                run.prompt_id or tables.is_scheduled_run(conn, run.id)
            ):
                # Acknowledged, or a recorded schedule fire, but never
                # started: start it (nobody would send it again).
                delivered.append(run)
                continue
            message = (
                "the machine daemon stopped while the run was in flight"
                if run.state is RunState.RUNNING
                else "the machine daemon stopped before the run started"
            )
            # The daemon's downtime is not the run's: its duration ends at
            # the last event it stored before the stop.
            events.append(
                recorder.end_sync(
                    conn,
                    run,
                    RunErrorCode.RUN_INTERRUPTED,
                    message,
                    now,
                    started=None,
                    active_until=tables.last_event_time(conn, run.id),
                )
            )
        waiting = tables.runs_in_states(conn, (RunState.WAITING_PERMISSION,))
        if events:
            tables.log(conn, now, "runs.interrupted", str(len(events)))
        return events, waiting, delivered

    events, waiting, delivered = await db.write(recover)
    recorder.publish(events)
    for ev in events:
        recorder.count_end(RunState.INTERRUPTED)
        logger.info("run %s interrupted by a restart", ev.run_id)
    return Recovered(len(events), waiting, delivered)


class StorageRecovery:
    """Ends runs whose events could not be stored, now or once writes work again.

    ``on_ended`` is called once an unended run's final event is stored, so the
    engine forgets it.
    """

    def __init__(self, recorder: EventRecorder, *, on_ended: Callable[[ActiveRun], None]) -> None:
        self._recorder = recorder
        self._on_ended = on_ended

    async def end_storage_failed(self, active: ActiveRun, started: float | None) -> None:
        """End the run with RUN_ERROR code STORAGE_FAILED, naming the first failure."""
        message = f"the run's events could not be stored: {active.store_error or 'unknown'}"
        await self._recorder.end(active.run, RunErrorCode.STORAGE_FAILED, message, started)

    def unended(self, active: ActiveRun, error: Exception, *, retry: bool) -> None:
        """The run's final event could not be stored: fail its followers, keep it
        registered (still open in the database) and, with ``retry``, end it once
        writes work again."""
        run_id = active.run.id
        logger.error("run %s: its final event could not be stored: %s", run_id, error)
        active.unended = True
        active.store_error = active.store_error or str(error)
        failure: AgentsError = (
            error
            if isinstance(error, DiskFull | DatabaseDamaged)
            else StoreError(f"run {run_id}: its final event could not be stored: {error}")
        )
        self._recorder.feeds.fail(active.run.agent_id, run_id, failure)
        if retry:
            active.task = asyncio.create_task(
                self._end_when_writable(active), name=f"end run {run_id}"
            )

    async def end_cancelled(self, active: ActiveRun) -> None:
        """End an unended run someone cancelled, now; a StoreError if it cannot."""
        # Under the run's ending lock (shared with the retry loop): never two RUN_ERRORs.
        async with active.ending:
            if active.unended:
                try:
                    await self._end_unended(active)
                except AgentsError:
                    raise
                except Exception as e:
                    raise StoreError(
                        f"cancel run {active.run.id}: the final event could not be stored: {e}"
                    ) from e

    async def _end_when_writable(self, active: ActiveRun) -> None:
        """Retry the final event of an unended run until the database takes it."""
        delay = _END_RETRY_FIRST
        while active.unended:
            await asyncio.sleep(delay)  # backoff between attempts, not synchronisation
            delay = min(delay * 2, _END_RETRY_MAX)
            async with active.ending:
                if not active.unended:
                    return
                try:
                    await self._end_unended(active)
                except Exception as e:
                    logger.debug("run %s: final event still not stored: %s", active.run.id, e)
                else:
                    logger.info("run %s: ended now that the database takes writes", active.run.id)

    async def _end_unended(self, active: ActiveRun) -> None:
        """Store the final event of a run whose earlier attempt failed: CANCELLED if
        someone cancelled it, else STORAGE_FAILED. Call under ``active.ending``."""
        if active.cancel_reason == "user":
            await self._recorder.end(
                active.run, RunErrorCode.CANCELLED, "cancelled by the user", None
            )
        else:
            await self.end_storage_failed(active, None)
        active.unended = False
        self._recorder.feeds.clear_failure(active.run.agent_id, active.run.id)
        self._on_ended(active)
