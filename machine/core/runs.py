"""The run engine: prompts become runs, runs become durable event streams.

Rules it keeps:

- Every event is committed (fsync'd) before anyone sees it: readers follow the
  database, helped by the in-memory :class:`~machine.core.feed.FeedHub`.
- One run at a time per agent; later prompts queue in arrival order. A run
  paused on a permission request keeps its agent busy (also across restarts).
- The run belongs to the daemon, not to the caller's stream: a reader going
  away does not stop it; :meth:`RunEngine.cancel` does.
- A prompt delivered by the control plane (:meth:`RunEngine.accept_delivery`)
  is stored as a queued run with its prompt id (unique) before it is
  acknowledged; a redelivery finds that run and starts nothing. Such a run
  still queued at a restart is started then instead of being interrupted: the
  control plane forgot it once acknowledged, so nobody would send it again.
- A write whose caller may be cancelled (a client going away) commits together
  with its in-memory follow-up or not at all: the follow-up runs even if the
  caller is cancelled while the write commits.
- Restarts and storage failures are recovered as :mod:`machine.core.run_recovery`
  describes: open runs are interrupted (or started, or parked again), and a
  run whose events cannot be stored ends with STORAGE_FAILED, once the
  database takes writes again if need be.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from machine.core.attachments import AttachmentStore
from machine.core.permissions import PermissionBroker
from machine.core.recorder import EventRecorder, Usage, complete, event_payload
from machine.core.run_reader import RunReader
from machine.core.run_recovery import ActiveRun, StorageRecovery, recover_at_start, storage_fault
from machine.core.runtime_cache import RuntimeCache
from machine.metrics import MachineMetrics
from machine.models import (
    AgentRecord,
    AgentState,
    EventKind,
    MachineIds,
    RunErrorCode,
    RunRecord,
    RunState,
    StoredEvent,
    check_prompt,
)
from machine.runtimes import RuntimeRegistry
from machine.runtimes.base import (
    PermissionDecision,
    PermissionRequest,
    ResumeInfo,
    RunContext,
    RuntimeEvent,
    RuntimeFailed,
    SessionStarted,
    UsageReport,
)
from machine.storage import tables
from machine.storage.db import Database
from shared.errors import InvalidArgument, InvalidState, NotFound, StoreError
from shared.ids import new_id, validate_id

__all__ = ["Delivered", "RunEngine"]

logger = logging.getLogger(__name__)

_MAX_ATTACHMENTS = 32


@dataclass(frozen=True)
class Delivered:
    """What a delivered prompt became: a run, or a refusal with its reason."""

    prompt_id: str
    run_id: str
    refused: str


class RunEngine:
    """Drives runs through their runtimes and stores every event first."""

    def __init__(
        self,
        db: Database,
        *,
        ids: MachineIds,
        runtimes: RuntimeRegistry,
        attachments: AttachmentStore,
        prompt_limit: int,
        metrics: MachineMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._db = db
        self.ids = ids
        self._runtimes = RuntimeCache(runtimes)
        self._attachments = attachments
        self.prompt_limit = prompt_limit
        self._metrics = metrics
        self._clock = clock
        self._recorder = EventRecorder(db, metrics=metrics, clock=clock)
        self.feeds = self._recorder.feeds
        self._reader = RunReader(db, self.feeds, ids=ids)
        self._permissions = PermissionBroker(db, self._recorder, track=self._track, clock=clock)
        self._active: dict[str, ActiveRun] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._recovery = StorageRecovery(self._recorder, on_ended=self._ended_late)
        self._closing = False
        # run id -> called with the start time when that run starts (schedule lag).
        self._start_hooks: dict[str, Callable[[float], None]] = {}

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        """Recover after a restart; return the number of runs marked interrupted."""
        found = await recover_at_start(self._db, self._recorder, self._clock())
        for run in found.waiting:
            # Park the run: it holds its agent's turn until someone answers or cancels.
            self._spawn(run, parked=True)
        for run in found.delivered:
            self._spawn(run, parked=False)
        return found.interrupted

    async def close(self, grace: float = 0.0) -> None:
        """Stop: give running runs ``grace`` seconds, then interrupt them. Runs waiting
        for a person stay waiting in the database."""
        self._closing = True
        running = [a for a in self._active.values() if a.task is not None]
        if grace > 0 and running:
            busy = [
                a.task
                for a in running
                if a.task is not None
                and not self._permissions.waiting(a.run.id)
                and a.run.state is not RunState.QUEUED
            ]
            if busy:
                await asyncio.wait(busy, timeout=grace)
        for active in list(self._active.values()):
            if active.task is not None and not active.task.done():
                active.cancel_reason = active.cancel_reason or "shutdown"
                active.task.cancel()
        tasks = [a.task for a in self._active.values() if a.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._runtimes.close()

    async def release_runtime(self, agent_id: str) -> None:
        """Stop the agent's runtime (its process, if any) and forget it; the agent
        must have no open run (an archived one has none)."""
        await self._runtimes.release(agent_id)

    def interrupt_now(self) -> None:
        """Interrupt every open run at once (the second stop signal)."""
        self._closing = True
        for active in self._active.values():
            if active.task is not None and not active.task.done():
                active.cancel_reason = active.cancel_reason or "shutdown"
                active.task.cancel()

    # ------------------------------------------------------------ prompts

    async def submit(
        self, agent_id: str, text: str, attachments: Sequence[str] = ()
    ) -> tuple[RunRecord, int]:
        """Validate and queue a prompt; return the run and the conversation's seq at
        that moment (the run's events all come after it)."""
        validate_id("agent", agent_id, "agent_id")
        check_prompt(text, self.prompt_limit)
        if len(attachments) > _MAX_ATTACHMENTS:
            raise InvalidArgument("attachments", f"at most {_MAX_ATTACHMENTS} per prompt")
        if self._closing:
            raise InvalidState("prompt", "the machine daemon is shutting down")
        run_id = new_id("run")
        now = self._clock()

        def write(conn: sqlite3.Connection) -> tuple[RunRecord, int]:
            agent = tables.get_agent(conn, agent_id, self.ids.own)
            self._check_runnable(agent)
            for sha in attachments:
                self._attachments.check_usable(conn, agent_id, sha)
            tables.insert_run(conn, run_id, agent_id, text, attachments, now)
            for sha in attachments:
                tables.add_attachment_ref(conn, sha, agent_id, run_id=run_id, now=now)
            return tables.get_run(conn, run_id), agent.last_seq

        async def commit() -> tuple[RunRecord, int]:
            run, last_seq = await self._db.write(write, what=f"prompt agent {agent_id}")
            self._spawn(run, parked=False)
            return run, last_seq

        # A committed queued run must be spawned even if the caller has gone.
        return await complete(commit())

    async def accept_delivery(self, prompt_id: str, agent_id: str, text: str) -> Delivered:
        """Store a delivered prompt as a queued run, at most once per prompt id.

        The commit of the run row (with its unique prompt id) is what the
        machine acknowledges; a redelivered id answers the run it already made
        and starts nothing. A prompt this machine will never run (unknown or
        archived agent, runtime missing, too large) answers a refusal reason,
        which is acknowledged too, so the control plane stops sending it.
        """
        validate_id("prompt", prompt_id, "prompt_id")
        run_id = new_id("run")
        now = self._clock()

        def write(conn: sqlite3.Connection) -> tuple[RunRecord | None, bool, str]:
            existing = tables.run_for_prompt(conn, prompt_id)
            if existing is not None:
                return existing, False, ""
            try:
                validate_id("agent", agent_id, "agent_id")
                check_prompt(text, self.prompt_limit)
                self._check_runnable(tables.get_agent(conn, agent_id, self.ids.own))
            except (InvalidArgument, InvalidState, NotFound) as e:
                return None, False, str(e)
            tables.insert_run(conn, run_id, agent_id, text, (), now, prompt_id=prompt_id)
            return tables.get_run(conn, run_id), True, ""

        async def commit() -> Delivered:
            run, new, refused = await self._db.write(write, what=f"delivery {prompt_id}")
            if run is None:
                return Delivered(prompt_id, "", refused)
            if new and not self._closing:
                self._spawn(run, parked=False)
            return Delivered(prompt_id, run.id, "")

        # Like submit: a committed queued run is spawned even if the caller has gone.
        return await complete(commit())

    def check_runnable(self, agent: AgentRecord) -> None:
        """InvalidState unless ``agent`` may run here now (for writers of queued runs)."""
        self._check_runnable(agent)

    def start_queued(self, run: RunRecord, on_start: Callable[[float], None] | None = None) -> None:
        """Drive a queued run another writer committed (a schedule's fire), in its
        agent's turn; ``on_start`` is called with the time it starts."""
        if on_start is not None:
            self._start_hooks[run.id] = on_start
        if not self._closing:
            self._spawn(run, parked=False)

    def _check_runnable(self, agent: AgentRecord) -> None:
        if not agent.local:
            raise InvalidState(
                f"prompt agent {agent.id}",
                f"its origin is machine {agent.origin_machine}; it is never run here",
            )
        if agent.state is not AgentState.ACTIVE:
            raise InvalidState(f"prompt agent {agent.id}", "the agent is archived")
        if not self._runtimes.available(agent.runtime):
            raise InvalidState(
                f"prompt agent {agent.id}",
                f"runtime {agent.runtime!r} is not available on this machine",
            )

    async def prompt(
        self, agent_id: str, text: str, attachments: Sequence[str] = ()
    ) -> AsyncIterator[StoredEvent]:
        """Submit a prompt and stream its run's events until the run ends.

        Validation happens before the first event is produced, so bad input
        raises on the first ``__anext__``.
        """
        run, after = await self.submit(agent_id, text, attachments)
        return self._reader.follow_run(agent_id, run.id, after)

    def follow(
        self, agent_id: str, after_seq: int, *, follow: bool, run_id: str | None = None
    ) -> AsyncIterator[StoredEvent]:
        """See :meth:`RunReader.follow <machine.core.run_reader.RunReader.follow>`."""
        return self._reader.follow(agent_id, after_seq, follow=follow, run_id=run_id)

    async def replay(
        self, agent_id: str, after_seq: int = 0, *, follow: bool = False
    ) -> AsyncIterator[StoredEvent]:
        """Validate, then stream the agent's events (see :meth:`follow`)."""
        return await self._reader.replay(agent_id, after_seq, follow=follow)

    # ------------------------------------------------------------ control

    async def get_run(self, run_id: str) -> RunRecord:
        """One run."""
        return await self._reader.get_run(run_id)

    async def list_runs(self, agent_id: str, limit: int = 100) -> list[RunRecord]:
        """An agent's runs, newest first."""
        return await self._reader.list_runs(agent_id, limit)

    async def cancel(self, run_id: str) -> RunRecord:
        """Cancel an open run; it ends with RUN_ERROR code CANCELLED."""
        run = await self.get_run(run_id)
        active = self._active.get(run_id)
        if not run.state.open or active is None or active.task is None:
            raise InvalidState(f"cancel run {run_id}", f"the run has already ended ({run.state})")
        active.cancel_reason = "user"
        if active.unended:
            await self._recovery.end_cancelled(active)
            return await self.get_run(run_id)
        active.task.cancel()
        await asyncio.gather(active.task, return_exceptions=True)
        return await self.get_run(run_id)

    async def answer(
        self, run_id: str, request_id: str, option_id: str, *, remember: bool = False
    ) -> RunRecord:
        """Answer a pending permission request; the run carries on."""
        return await self._permissions.answer(run_id, request_id, option_id, remember=remember)

    def _track(self, run: RunRecord) -> bool:
        """Keep the engine's record of ``run`` current; whether the engine drives it."""
        active = self._active.get(run.id)
        if active is not None:
            active.run = run
        return active is not None

    # ------------------------------------------------------------ driving

    def _lock(self, agent_id: str) -> asyncio.Lock:
        lock = self._locks.get(agent_id)
        if lock is None:
            lock = self._locks[agent_id] = asyncio.Lock()
        return lock

    def _spawn(self, run: RunRecord, *, parked: bool) -> None:
        active = ActiveRun(run)
        self._active[run.id] = active
        active.task = asyncio.create_task(self._drive(active, parked), name=f"run {run.id}")
        self._update_gauges()

    def _update_gauges(self) -> None:
        if self._metrics is not None:
            self._metrics.runs_open.set(len(self._active))
            queued = sum(1 for a in self._active.values() if a.run.state is RunState.QUEUED)
            self._metrics.prompts_queued.set(queued)

    async def _drive(self, active: ActiveRun, parked: bool) -> None:
        run = active.run
        started = run.started_at
        try:
            async with self._lock(run.agent_id):
                self._recorder.open_stream(run)
                resume: ResumeInfo | None = None
                agent: AgentRecord | None = None
                if parked:
                    resume = await self._permissions.wait_parked(active.run)
                else:
                    started = self._clock()
                    agent = await self._start_run(active, started)
                await self._run_runtime(active, started or self._clock(), resume, agent)
        except asyncio.CancelledError:
            try:
                await self._on_cancelled(active, started)
            except Exception as e:
                self._recovery.unended(active, e, retry=not self._closing)
        except Exception as e:
            try:
                if storage_fault(e):
                    logger.error("run %s: its events could not be stored: %s", run.id, e)
                    active.store_error = active.store_error or str(e)
                    await self._recovery.end_storage_failed(active, started)
                else:
                    logger.exception("run %s failed in the engine", run.id)
                    message = f"run failed: {type(e).__name__}"
                    await self._end(active, RunErrorCode.RUNTIME_FAILED, message, started)
            except Exception as end_error:
                self._recovery.unended(active, end_error, retry=not self._closing)
        finally:
            self._recorder.close_stream(run.id)
            if not active.unended:
                self._forget(run.id)
            self._update_gauges()

    def _forget(self, run_id: str) -> None:
        self._active.pop(run_id, None)
        self._start_hooks.pop(run_id, None)
        self._permissions.forget(run_id)

    def _ended_late(self, active: ActiveRun) -> None:
        """An unended run's final event is stored at last: forget the run."""
        self._forget(active.run.id)
        self._update_gauges()

    async def _start_run(self, active: ActiveRun, started: float) -> AgentRecord:
        """Queue the run's RUN_STARTED (the runtime starts without waiting for its
        commit: its first events share it); return the agent."""
        run = active.run
        agent = await self._db.read(
            lambda c: tables.get_agent(c, run.agent_id, self.ids.own),
            what=f"run {run.id} of agent {run.agent_id}",
        )

        def write(conn: sqlite3.Connection) -> list[StoredEvent]:
            tables.set_run_state(conn, run.id, RunState.RUNNING, started_at=started)
            return [
                tables.append_event(
                    conn,
                    run.agent_id,
                    run.id,
                    EventKind.RUN_STARTED,
                    {
                        "prompt": run.prompt,
                        "attachments": list(run.attachments),
                        "runtime": agent.runtime,
                    },
                    started,
                )
            ]

        await self._recorder.queue(run, write)
        hook = self._start_hooks.pop(run.id, None)
        if hook is not None:
            hook(started)
        active.run = replace(run, state=RunState.RUNNING, started_at=started)
        self._update_gauges()
        if self._metrics is not None:
            self._metrics.runs_started.inc()
        return agent

    async def _run_runtime(
        self,
        active: ActiveRun,
        started: float,
        resume: ResumeInfo | None,
        agent: AgentRecord | None = None,
    ) -> None:
        run = active.run
        if agent is None:
            agent = await self._db.read(
                lambda c: tables.get_agent(c, run.agent_id, self.ids.own),
                what=f"run {run.id} of agent {run.agent_id}",
            )
        usage = Usage.of(run)
        gate = await self._permissions.gate(run, resume)

        async def emit(ev: RuntimeEvent) -> None:
            if isinstance(ev, UsageReport):
                usage.add(ev.input_tokens, ev.output_tokens)
                return
            if gate.suppressing:
                return
            if isinstance(ev, SessionStarted):
                session_id = ev.session_id

                def remember(conn: sqlite3.Connection) -> list[StoredEvent]:
                    tables.set_session_id(conn, run.agent_id, session_id)
                    return []

                await self._recorder.queue(run, remember)
                return
            mapped = event_payload(ev)
            if mapped is None:
                logger.warning("run %s: ignoring unknown runtime event %r", run.id, type(ev))
                return
            try:
                await self._recorder.record(run, *mapped)
            except Exception as e:
                if storage_fault(e):
                    active.store_error = active.store_error or str(e)
                raise

        async def ask(req: PermissionRequest) -> PermissionDecision:
            replayed = gate.replayed(run.id, req)
            if replayed is not None:
                return replayed
            return await self._permissions.ask(active.run, req)

        try:
            runtime = self._runtimes.get(agent)
        except Exception as e:
            logger.warning("run %s: runtime unavailable: %s", run.id, e)
            await self._end(active, RunErrorCode.RUNTIME_UNAVAILABLE, str(e), started)
            return
        ctx = RunContext(
            agent_id=agent.id,
            run_id=run.id,
            folder=Path(agent.folder),
            prompt=run.prompt,
            settings=agent.settings,
            emit=emit,
            ask_permission=ask,
            session_id=agent.session_id,
            attachments=tuple(self._attachments.folder / sha for sha in run.attachments),
            resume=resume,
        )
        try:
            outcome = await runtime.run(ctx)
        except asyncio.CancelledError:
            active.run = usage.applied(active.run)
            raise
        except Exception as e:
            if active.store_error is not None:
                # The runtime failed because its events could not be stored.
                active.run = usage.applied(active.run)
                raise StoreError(active.store_error) from e
            if isinstance(e, RuntimeFailed):
                await self._end(active, RunErrorCode.RUNTIME_FAILED, e.message, started, usage)
                return
            logger.exception("run %s: runtime %s crashed", run.id, runtime.name)
            message = f"runtime {runtime.name} failed: {type(e).__name__}"
            await self._end(active, RunErrorCode.RUNTIME_FAILED, message, started, usage)
            return
        if active.store_error is not None:
            # Some of its events are missing: the run did not finish as stored.
            active.run = usage.applied(active.run)
            raise StoreError(active.store_error)
        await self._recorder.finish(active.run, outcome, started, usage)

    async def _end(
        self,
        active: ActiveRun,
        code: RunErrorCode,
        message: str,
        started: float | None,
        usage: Usage | None = None,
    ) -> None:
        run = active.run if usage is None else usage.applied(active.run)
        await self._recorder.end(run, code, message, started)

    async def _on_cancelled(self, active: ActiveRun, started: float | None) -> None:
        run = await self._db.read(lambda c: tables.get_run(c, active.run.id))
        run = Usage.of(active.run).applied(run)
        active.run = run
        if not run.state.open:
            return
        if active.cancel_reason == "user":
            await self._end(active, RunErrorCode.CANCELLED, "cancelled by the user", started)
        elif run.state is RunState.WAITING_PERMISSION:
            logger.info("run %s stays waiting for a person across the restart", run.id)
        else:
            await self._end(
                active,
                RunErrorCode.RUN_INTERRUPTED,
                "the machine daemon stopped while the run was in flight",
                started,
            )
