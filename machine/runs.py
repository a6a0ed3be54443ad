"""The run engine: prompts become runs, runs become durable event streams.

Rules it keeps:

- Every event is committed (fsync'd) before anyone sees it: readers follow the
  database, helped by the in-memory :class:`~machine.feed.FeedHub`.
- One run at a time per agent; later prompts queue in arrival order. A run
  paused on a permission request keeps its agent busy (also across restarts).
- The run belongs to the daemon, not to the caller's stream: a reader going
  away does not stop it; :meth:`RunEngine.cancel` does.
- At start, runs that were queued or running are marked interrupted and get
  exactly one RUN_ERROR code RUN_INTERRUPTED (in the same transaction as the
  state change, so a second restart adds nothing). Runs waiting for a
  permission stay waiting; once answered they are driven again with
  :class:`ResumeInfo`, and what the runtime re-emits before re-asking the
  same request is not stored twice.
- A write whose caller may be cancelled (a client going away) commits together
  with its in-memory follow-up or not at all: the follow-up runs even if the
  caller is cancelled while the write commits.
- When a run's events cannot be stored (a full disk, a damaged database),
  the run ends with RUN_ERROR code STORAGE_FAILED. If even that event cannot
  be stored, its followers fail with the storage error instead of waiting for
  ever, and the run stays registered (open in the database): it is ended with
  STORAGE_FAILED as soon as the database accepts writes again (retried with
  backoff), CancelRun can still end it, and a restart interrupts it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from machine import store
from machine.attachments import AttachmentStore
from machine.db import Database
from machine.feed import FeedHub
from machine.metrics import MachineMetrics
from machine.models import (
    AgentRecord,
    AgentState,
    EventKind,
    MachineIds,
    PendingPermission,
    RunErrorCode,
    RunRecord,
    RunState,
    StoredEvent,
    validate_runtime_ref,
)
from machine.runtimes import RuntimeRegistry
from machine.runtimes.base import (
    PermissionDecision,
    PermissionOption,
    PermissionRequest,
    ResumeInfo,
    RunContext,
    RunOutcome,
    Runtime,
    RuntimeEvent,
    RuntimeFailed,
    SessionStarted,
    TextDelta,
    ToolCall,
    ToolResult,
    UsageReport,
)
from shared.errors import (
    AgentsError,
    DatabaseDamaged,
    DiskFull,
    InvalidArgument,
    InvalidState,
    StoreError,
    TooLarge,
)
from shared.ids import new_id, validate_id

__all__ = ["RunEngine"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_MAX_ATTACHMENTS = 32
_READ_BATCH = 500
# A follower holds at most one batch: bounded by bytes too, so large events
# (a long prompt, a big tool output) do not make a batch hundreds of MiB.
_READ_BYTES = 256 * 1024
# Retrying the final event of a run whose storage failed: first after this
# long, doubling up to the cap (a freed disk is noticed within the cap).
_END_RETRY_FIRST = 0.2
_END_RETRY_MAX = 5.0

_OUTCOME = {
    RunErrorCode.RUN_INTERRUPTED: RunState.INTERRUPTED,
    RunErrorCode.CANCELLED: RunState.CANCELLED,
    RunErrorCode.RUNTIME_FAILED: RunState.FAILED,
    RunErrorCode.RUNTIME_UNAVAILABLE: RunState.FAILED,
    RunErrorCode.STORAGE_FAILED: RunState.FAILED,
}


def _storage_fault(error: BaseException) -> bool:
    """Whether ``error`` is the database failing to store, not the run failing."""
    return isinstance(error, DiskFull | DatabaseDamaged | StoreError)


def _event_payload(ev: RuntimeEvent) -> tuple[EventKind, dict[str, Any]] | None:
    if isinstance(ev, TextDelta):
        return EventKind.TEXT_DELTA, {"text": ev.text}
    if isinstance(ev, ToolCall):
        return EventKind.TOOL_CALL, {
            "call_id": ev.call_id,
            "title": ev.title,
            "tool_kind": ev.kind,
            "input_json": ev.input_json,
        }
    if isinstance(ev, ToolResult):
        return EventKind.TOOL_RESULT, {
            "call_id": ev.call_id,
            "status": ev.status,
            "output": ev.output,
        }
    return None


async def _complete(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even if the caller is cancelled meanwhile.

    For a database write and its in-memory follow-up: once the write may have
    committed, the follow-up (publishing, waking waiters, spawning) must run,
    or the store and the engine disagree. A cancelled caller still sees
    CancelledError, after the work is done.
    """
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                break
            cancelled = True
        except BaseException:
            break
    if cancelled:
        if not task.cancelled() and task.exception() is not None:
            logger.debug("work of a cancelled caller failed: %r", task.exception())
        raise asyncio.CancelledError()
    return task.result()


def _request_from(perm: PendingPermission) -> PermissionRequest:
    return PermissionRequest(
        request_id=perm.request_id,
        call_id=perm.call_id,
        title=perm.title,
        options=tuple(PermissionOption(o[0], o[1], o[2]) for o in perm.options),
    )


@dataclass
class _Active:
    """In-memory state of one open run."""

    run: RunRecord
    task: asyncio.Task[None] | None = None
    cancel_reason: str | None = None  # "user" or "shutdown"
    waiters: dict[str, asyncio.Future[PermissionDecision]] = field(default_factory=dict)
    # Answers that arrived before the run started waiting (a parked run still
    # getting its turn after a restart).
    early: dict[str, PermissionDecision] = field(default_factory=dict)
    # The run ended in the engine but its final event could not be stored.
    unended: bool = False
    # The first storage failure met while storing the run's events.
    store_error: str | None = None
    # Held while storing the final event of an unended run (retry loop or cancel).
    ending: asyncio.Lock = field(default_factory=asyncio.Lock)


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
        self._registry = runtimes
        self._attachments = attachments
        self.prompt_limit = prompt_limit
        self._metrics = metrics
        self._clock = clock
        self.feeds = FeedHub()
        self._active: dict[str, _Active] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._runtimes: dict[str, Runtime] = {}
        self._closing = False

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        """Recover after a restart; return the number of runs marked interrupted."""
        now = self._clock()

        def recover(conn: sqlite3.Connection) -> tuple[list[StoredEvent], list[RunRecord]]:
            events = []
            for run in store.runs_in_states(conn, (RunState.QUEUED, RunState.RUNNING)):
                message = (
                    "the machine daemon stopped while the run was in flight"
                    if run.state is RunState.RUNNING
                    else "the machine daemon stopped before the run started"
                )
                # The daemon's downtime is not the run's: its duration ends at
                # the last event it stored before the stop.
                events.append(
                    self._end_run_sync(
                        conn,
                        run,
                        RunErrorCode.RUN_INTERRUPTED,
                        message,
                        now,
                        started=None,
                        active_until=store.last_event_time(conn, run.id),
                    )
                )
            waiting = store.runs_in_states(conn, (RunState.WAITING_PERMISSION,))
            if events:
                store.log(conn, now, "runs.interrupted", str(len(events)))
            return events, waiting

        events, waiting = await self._db.write(recover)
        self._publish(events)
        for ev in events:
            self._count_end(RunState.INTERRUPTED)
            logger.info("run %s interrupted by a restart", ev.run_id)
        for run in waiting:
            # Park the run: it holds its agent's turn until someone answers or cancels.
            self._spawn(run, parked=True)
        return len(events)

    async def close(self, grace: float = 0.0) -> None:
        """Stop: give running runs ``grace`` seconds, then interrupt them. Runs waiting
        for a person stay waiting in the database."""
        self._closing = True
        running = [a for a in self._active.values() if a.task is not None]
        if grace > 0 and running:
            busy = [
                a.task
                for a in running
                if a.task is not None and not a.waiters and a.run.state is not RunState.QUEUED
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
        for runtime in self._runtimes.values():
            try:
                await runtime.close()
            except Exception:
                logger.exception("closing runtime %s failed", runtime.name)
        self._runtimes.clear()

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
        if not text.strip():
            raise InvalidArgument("prompt", "must not be empty")
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.prompt_limit:
            raise TooLarge("prompt", self.prompt_limit, size)
        if len(attachments) > _MAX_ATTACHMENTS:
            raise InvalidArgument("attachments", f"at most {_MAX_ATTACHMENTS} per prompt")
        if self._closing:
            raise InvalidState("prompt", "the machine daemon is shutting down")
        run_id = new_id("run")
        now = self._clock()

        def write(conn: sqlite3.Connection) -> tuple[RunRecord, int]:
            agent = store.get_agent(conn, agent_id, self.ids.own)
            self._check_runnable(agent)
            for sha in attachments:
                self._attachments.check_usable(conn, agent_id, sha)
            store.insert_run(conn, run_id, agent_id, text, attachments, now)
            for sha in attachments:
                store.add_attachment_ref(conn, sha, agent_id, run_id=run_id, now=now)
            return store.get_run(conn, run_id), agent.last_seq

        async def commit() -> tuple[RunRecord, int]:
            run, last_seq = await self._db.write(write, what=f"prompt agent {agent_id}")
            self._spawn(run, parked=False)
            return run, last_seq

        # A committed queued run must be spawned even if the caller has gone.
        return await _complete(commit())

    def _check_runnable(self, agent: AgentRecord) -> None:
        if not agent.local:
            raise InvalidState(
                f"prompt agent {agent.id}",
                f"its origin is machine {agent.origin_machine}; it is never run here",
            )
        if agent.state is not AgentState.ACTIVE:
            raise InvalidState(f"prompt agent {agent.id}", "the agent is archived")
        if agent.runtime not in self._registry.kinds:
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
        return self._follow_run(agent_id, run.id, after)

    async def _follow_run(
        self, agent_id: str, run_id: str, after: int
    ) -> AsyncIterator[StoredEvent]:
        async for ev in self.follow(agent_id, after, follow=True, run_id=run_id):
            if ev.run_id != run_id:
                continue
            yield ev
            if ev.terminal:
                return

    async def follow(
        self, agent_id: str, after_seq: int, *, follow: bool, run_id: str | None = None
    ) -> AsyncIterator[StoredEvent]:
        """Stored events with seq > after_seq; with ``follow``, then every new one.

        With ``run_id``, once every stored event has been yielded, raise the
        StoreError recorded for that run if its final event could not be stored.
        """
        feed = self.feeds.feed(agent_id)
        last = after_seq
        while True:
            ring = feed.since(last)
            if ring is not None:
                batch = ring
            else:
                batch = await self._db.read(
                    functools.partial(
                        store.read_events,
                        agent_id=agent_id,
                        after_seq=last,
                        limit=_READ_BATCH,
                        max_bytes=_READ_BYTES,
                    ),
                    what=f"replay agent {agent_id}",
                )
            for ev in batch:
                if ev.seq <= last:
                    continue
                yield ev
                last = ev.seq
            if batch:
                continue
            if not follow:
                return
            await feed.wait_after(last, run_id)

    async def replay(
        self, agent_id: str, after_seq: int = 0, *, follow: bool = False
    ) -> AsyncIterator[StoredEvent]:
        """Validate, then stream the agent's events (see :meth:`follow`)."""
        validate_id("agent", agent_id, "agent_id")
        if after_seq < 0:
            raise InvalidArgument("after_seq", "must not be negative")
        await self._db.read(
            lambda c: store.get_agent(c, agent_id, self.ids.own), what=f"replay agent {agent_id}"
        )
        return self.follow(agent_id, after_seq, follow=follow)

    # ------------------------------------------------------------ control

    async def get_run(self, run_id: str) -> RunRecord:
        """One run."""
        validate_id("run", run_id, "run_id")
        return await self._db.read(lambda c: store.get_run(c, run_id), what=f"get run {run_id}")

    async def list_runs(self, agent_id: str, limit: int = 100) -> list[RunRecord]:
        """An agent's runs, newest first."""
        validate_id("agent", agent_id, "agent_id")
        if not 0 <= limit <= 1000:
            raise InvalidArgument("limit", "must be 0 to 1000")
        what = f"list runs of agent {agent_id}"
        await self._db.read(lambda c: store.get_agent(c, agent_id, self.ids.own), what=what)
        return await self._db.read(lambda c: store.list_runs(c, agent_id, limit or 100), what=what)

    async def cancel(self, run_id: str) -> RunRecord:
        """Cancel an open run; it ends with RUN_ERROR code CANCELLED."""
        run = await self.get_run(run_id)
        active = self._active.get(run_id)
        if not run.state.open or active is None or active.task is None:
            raise InvalidState(f"cancel run {run_id}", f"the run has already ended ({run.state})")
        active.cancel_reason = "user"
        if active.unended:
            # Under the run's ending lock (shared with the retry loop): never two RUN_ERRORs.
            async with active.ending:
                if active.unended:
                    try:
                        await self._end_unended(active)
                    except AgentsError:
                        raise
                    except Exception as e:
                        raise StoreError(
                            f"cancel run {run_id}: the final event could not be stored: {e}"
                        ) from e
            return await self.get_run(run_id)
        active.task.cancel()
        await asyncio.gather(active.task, return_exceptions=True)
        return await self.get_run(run_id)

    async def answer(
        self, run_id: str, request_id: str, option_id: str, *, remember: bool = False
    ) -> RunRecord:
        """Answer a pending permission request; the run carries on."""
        validate_id("run", run_id, "run_id")
        validate_runtime_ref(request_id, "request_id")
        validate_runtime_ref(option_id, "option_id")
        now = self._clock()

        def write(conn: sqlite3.Connection) -> tuple[StoredEvent, RunRecord]:
            run = store.get_run(conn, run_id)
            perm = store.get_permission(conn, run_id, request_id)
            if perm.state != "pending" or run.state is not RunState.WAITING_PERMISSION:
                raise InvalidState(
                    f"answer permission {request_id}", f"it is not pending ({perm.state})"
                )
            kinds = {o[0]: o[2] for o in perm.options}
            if option_id not in kinds:
                raise InvalidArgument(
                    "option_id", f"{option_id!r} is not one of {', '.join(sorted(kinds))}"
                )
            store.answer_permission(conn, run_id, request_id, option_id, remember=remember, now=now)
            if remember:
                decision = _rule_for(kinds[option_id])
                if decision is not None:
                    store.remember_rule(conn, run.agent_id, perm.title, decision, now)
            ev = store.append_event(
                conn,
                run.agent_id,
                run_id,
                EventKind.PERMISSION_ANSWERED,
                {
                    "request_id": request_id,
                    "option_id": option_id,
                    "remember": remember,
                    "by_rule": False,
                },
                now,
            )
            store.set_run_state(conn, run_id, RunState.RUNNING)
            return ev, store.get_run(conn, run_id)

        async def commit() -> RunRecord:
            ev, run = await self._db.write(write)
            self._publish([ev])
            active = self._active.get(run_id)
            waiter = active.waiters.get(request_id) if active else None
            if active is not None:
                active.run = run
            if waiter is not None and not waiter.done():
                waiter.set_result(PermissionDecision(option_id))
            elif active is not None:
                active.early[request_id] = PermissionDecision(option_id)
            else:
                logger.warning("run %s: answer stored but the run is not active", run_id)
            return run

        # Once the answer commits, the run must carry on even if the caller has gone.
        return await _complete(commit())

    # ------------------------------------------------------------ driving

    def _lock(self, agent_id: str) -> asyncio.Lock:
        lock = self._locks.get(agent_id)
        if lock is None:
            lock = self._locks[agent_id] = asyncio.Lock()
        return lock

    def _spawn(self, run: RunRecord, *, parked: bool) -> None:
        active = _Active(run)
        self._active[run.id] = active
        active.task = asyncio.create_task(self._drive(active, parked), name=f"run {run.id}")
        self._update_gauges()

    def _update_gauges(self) -> None:
        if self._metrics is not None:
            self._metrics.runs_open.set(len(self._active))
            queued = sum(1 for a in self._active.values() if a.run.state is RunState.QUEUED)
            self._metrics.prompts_queued.set(queued)

    async def _drive(self, active: _Active, parked: bool) -> None:
        run = active.run
        started = run.started_at
        try:
            async with self._lock(run.agent_id):
                resume: ResumeInfo | None = None
                if parked:
                    resume = await self._wait_parked(active)
                else:
                    started = self._clock()
                    await self._start_run(active, started)
                await self._run_runtime(active, started or self._clock(), resume)
        except asyncio.CancelledError:
            try:
                await self._on_cancelled(active, started)
            except Exception as e:
                self._unended(active, e)
        except Exception as e:
            try:
                if _storage_fault(e):
                    logger.error("run %s: its events could not be stored: %s", run.id, e)
                    active.store_error = active.store_error or str(e)
                    await self._end_storage_failed(active, started)
                else:
                    logger.exception("run %s failed in the engine", run.id)
                    message = f"run failed: {type(e).__name__}"
                    await self._end(active, RunErrorCode.RUNTIME_FAILED, message, started)
            except Exception as end_error:
                self._unended(active, end_error)
        finally:
            if not active.unended:
                self._active.pop(run.id, None)
            self._update_gauges()

    def _unended(self, active: _Active, error: Exception) -> None:
        """The run's final event could not be stored: fail its followers, keep it
        registered (still open in the database) and end it once writes work again."""
        run_id = active.run.id
        logger.error("run %s: its final event could not be stored: %s", run_id, error)
        active.unended = True
        active.store_error = active.store_error or str(error)
        failure: AgentsError = (
            error
            if isinstance(error, DiskFull | DatabaseDamaged)
            else StoreError(f"run {run_id}: its final event could not be stored: {error}")
        )
        self.feeds.fail(active.run.agent_id, run_id, failure)
        if not self._closing:
            active.task = asyncio.create_task(
                self._end_when_writable(active), name=f"end run {run_id}"
            )

    async def _end_when_writable(self, active: _Active) -> None:
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

    async def _end_unended(self, active: _Active) -> None:
        """Store the final event of a run whose earlier attempt failed: CANCELLED if
        someone cancelled it, else STORAGE_FAILED. Call under ``active.ending``."""
        run_id = active.run.id
        if active.cancel_reason == "user":
            await self._end(active, RunErrorCode.CANCELLED, "cancelled by the user", None)
        else:
            await self._end_storage_failed(active, None)
        active.unended = False
        self._active.pop(run_id, None)
        self.feeds.clear_failure(active.run.agent_id, run_id)
        self._update_gauges()

    async def _end_storage_failed(self, active: _Active, started: float | None) -> None:
        message = f"the run's events could not be stored: {active.store_error or 'unknown'}"
        await self._end(active, RunErrorCode.STORAGE_FAILED, message, started)

    async def _start_run(self, active: _Active, started: float) -> None:
        run = active.run
        agent = await self._db.read(
            lambda c: store.get_agent(c, run.agent_id, self.ids.own),
            what=f"run {run.id} of agent {run.agent_id}",
        )

        def write(conn: sqlite3.Connection) -> StoredEvent:
            store.set_run_state(conn, run.id, RunState.RUNNING, started_at=started)
            return store.append_event(
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

        await self._append(run, write)
        active.run = await self._db.read(lambda c: store.get_run(c, run.id))
        self._update_gauges()
        if self._metrics is not None:
            self._metrics.runs_started.inc()

    async def _wait_parked(self, active: _Active) -> ResumeInfo:
        """A run paused before a restart: wait for its answer, then resume it."""
        run = active.run
        perms = await self._db.read(lambda c: store.run_permissions(c, run.id))
        pending = [p for p in perms if p.state == "pending"]
        if not pending:
            raise RuntimeFailedResume(f"run {run.id}: waiting but no pending request")
        perm = pending[-1] if pending else None
        if perm is None:
            # Answered between the restart and now: the answer is in the store.
            answered = [p for p in perms if p.state == "answered" and p.option_id]
            if not answered or run.id not in self._active:
                raise RuntimeFailedResume(f"run {run.id}: waiting but no request to resume")
            perm = answered[-1]
            assert perm.option_id is not None
            decision = active.early.pop(perm.request_id, PermissionDecision(perm.option_id))
            return ResumeInfo(_request_from(perm), decision)
        future: asyncio.Future[PermissionDecision] = asyncio.get_running_loop().create_future()
        active.waiters[perm.request_id] = future
        early = active.early.pop(perm.request_id, None)
        if early is not None:
            future.set_result(early)
        try:
            decision = await future
        finally:
            active.waiters.pop(perm.request_id, None)
        return ResumeInfo(_request_from(perm), decision)

    async def _run_runtime(
        self, active: _Active, started: float, resume: ResumeInfo | None
    ) -> None:
        run = active.run
        agent = await self._db.read(
            lambda c: store.get_agent(c, run.agent_id, self.ids.own),
            what=f"run {run.id} of agent {run.agent_id}",
        )
        # None until the runtime reports usage: unknown is not 0 tokens.
        usage: list[int | None] = [run.input_tokens, run.output_tokens]
        # While resuming, events the runtime re-emits up to the re-asked request
        # are already stored: drop them.
        suppressing = [resume is not None]
        answered: dict[str, PendingPermission] = {}
        if resume is not None:
            perms = await self._db.read(lambda c: store.run_permissions(c, run.id))
            answered = {p.request_id: p for p in perms if p.state == "answered"}

        async def emit(ev: RuntimeEvent) -> None:
            if isinstance(ev, UsageReport):
                usage[0] = (usage[0] or 0) + ev.input_tokens
                usage[1] = (usage[1] or 0) + ev.output_tokens
                return
            if suppressing[0]:
                return
            if isinstance(ev, SessionStarted):
                await self._db.write(lambda c: store.set_session_id(c, run.agent_id, ev.session_id))
                return
            mapped = _event_payload(ev)
            if mapped is None:
                logger.warning("run %s: ignoring unknown runtime event %r", run.id, type(ev))
                return
            kind, payload = mapped
            now = self._clock()
            try:
                await self._append(
                    run, lambda c: store.append_event(c, run.agent_id, run.id, kind, payload, now)
                )
            except Exception as e:
                if _storage_fault(e):
                    active.store_error = active.store_error or str(e)
                raise

        async def ask(req: PermissionRequest) -> PermissionDecision:
            if suppressing[0]:
                assert resume is not None
                if req.request_id == resume.pending.request_id:
                    suppressing[0] = False
                    return resume.decision
                earlier = answered.get(req.request_id)
                if earlier is not None and earlier.option_id:
                    return PermissionDecision(earlier.option_id)
                logger.warning("run %s: resumed runtime diverged at %s", run.id, req.request_id)
                suppressing[0] = False
            return await self._ask(active, req)

        try:
            runtime = self._runtime_for(agent)
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
            active.run = _with_usage(active.run, usage)
            raise
        except Exception as e:
            if active.store_error is not None:
                # The runtime failed because its events could not be stored.
                active.run = _with_usage(active.run, usage)
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
            active.run = _with_usage(active.run, usage)
            raise StoreError(active.store_error)
        await self._finish(active, outcome, started, usage)

    def _runtime_for(self, agent: AgentRecord) -> Runtime:
        runtime = self._runtimes.get(agent.id)
        if runtime is None:
            runtime = self._registry.create(
                agent.runtime, agent_id=agent.id, folder=Path(agent.folder), settings=agent.settings
            )
            self._runtimes[agent.id] = runtime
        return runtime

    async def _ask(self, active: _Active, req: PermissionRequest) -> PermissionDecision:
        run = active.run
        now = self._clock()
        options = [(o.option_id, o.name, o.kind) for o in req.options]
        request_payload = {
            "request_id": req.request_id,
            "call_id": req.call_id,
            "title": req.title,
            "options": [{"option_id": i, "name": n, "kind": k} for i, n, k in options],
        }

        def write(conn: sqlite3.Connection) -> tuple[list[StoredEvent], str | None]:
            decision = store.rule_for(conn, run.agent_id, req.title)
            chosen = _option_for_rule(req.options, decision) if decision else None
            events = [
                store.append_event(
                    conn, run.agent_id, run.id, EventKind.PERMISSION_REQUEST, request_payload, now
                )
            ]
            store.insert_permission(
                conn,
                PendingPermission(
                    run_id=run.id,
                    request_id=req.request_id,
                    agent_id=run.agent_id,
                    call_id=req.call_id,
                    title=req.title,
                    options=tuple(options),
                    seq=events[0].seq,
                    state="answered" if chosen else "pending",
                    option_id=chosen,
                    remember=False,
                ),
                requested_at=now,
                answered_at=now if chosen else None,
            )
            if chosen:
                answer = {
                    "request_id": req.request_id,
                    "option_id": chosen,
                    "remember": False,
                    "by_rule": True,
                }
                events.append(
                    store.append_event(
                        conn, run.agent_id, run.id, EventKind.PERMISSION_ANSWERED, answer, now
                    )
                )
            else:
                store.set_run_state(conn, run.id, RunState.WAITING_PERMISSION)
            return events, chosen

        future: asyncio.Future[PermissionDecision] = asyncio.get_running_loop().create_future()
        # Register before the write so an answer racing the commit finds the waiter.
        active.waiters[req.request_id] = future
        try:
            _, chosen = await self._append_many(run, write)
            if chosen:
                return PermissionDecision(chosen)
            active.run = await self._db.read(lambda c: store.get_run(c, run.id))
            return await future
        finally:
            active.waiters.pop(req.request_id, None)

    async def _finish(
        self, active: _Active, outcome: RunOutcome, started: float, usage: list[int | None]
    ) -> None:
        run = active.run
        now = self._clock()
        duration = max(0, int((now - started) * 1000))
        payload = {
            "stop_reason": outcome.stop_reason,
            "usage": {
                key: value
                for key, value in (("input_tokens", usage[0]), ("output_tokens", usage[1]))
                if value is not None
            },
            "duration_ms": duration,
        }

        def write(conn: sqlite3.Connection) -> StoredEvent:
            ev = store.append_event(
                conn, run.agent_id, run.id, EventKind.RUN_FINISHED, payload, now
            )
            store.set_run_state(
                conn,
                run.id,
                RunState.FINISHED,
                finished_at=now,
                duration_ms=duration,
                input_tokens=usage[0],
                output_tokens=usage[1],
                stop_reason=outcome.stop_reason,
            )
            return ev

        await self._append(run, write)
        self._count_end(RunState.FINISHED)

    async def _end(
        self,
        active: _Active,
        code: RunErrorCode,
        message: str,
        started: float | None,
        usage: list[int | None] | None = None,
    ) -> None:
        run = active.run
        if usage is not None:
            run = _with_usage(run, usage)
        now = self._clock()
        await self._append(run, lambda c: self._end_run_sync(c, run, code, message, now, started))
        self._count_end(_OUTCOME[code])

    def _end_run_sync(
        self,
        conn: sqlite3.Connection,
        run: RunRecord,
        code: RunErrorCode,
        message: str,
        now: float,
        started: float | None,
        active_until: float | None = None,
    ) -> StoredEvent:
        """Store a run's RUN_ERROR and end state. Its duration runs from ``started``
        (default: when it started) to ``active_until`` (default: ``now``)."""
        started = started or run.started_at
        end = now if active_until is None else min(now, active_until)
        duration = max(0, int((end - started) * 1000)) if started else 0
        ev = store.append_event(
            conn,
            run.agent_id,
            run.id,
            EventKind.RUN_ERROR,
            {"code": code.value, "message": message},
            now,
        )
        store.set_run_state(
            conn,
            run.id,
            _OUTCOME[code],
            finished_at=now,
            duration_ms=duration,
            error_code=code.value,
            input_tokens=run.input_tokens,
            output_tokens=run.output_tokens,
        )
        store.cancel_pending_permissions(conn, run.id)
        return ev

    async def _on_cancelled(self, active: _Active, started: float | None) -> None:
        run = await self._db.read(lambda c: store.get_run(c, active.run.id))
        run = _with_usage(run, [active.run.input_tokens, active.run.output_tokens])
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

    def _count_end(self, state: RunState) -> None:
        """Count a run that ended in ``state`` (the runs_finished metric)."""
        if self._metrics is not None:
            self._metrics.runs_finished.labels(state.value).inc()

    # ------------------------------------------------------------ storing

    async def _append(
        self, run: RunRecord, fn: Callable[[sqlite3.Connection], StoredEvent]
    ) -> StoredEvent:
        events, _ = await self._append_many(run, lambda c: ([fn(c)], None))
        return events[0]

    async def _append_many(
        self, run: RunRecord, fn: Callable[[sqlite3.Connection], tuple[list[StoredEvent], Any]]
    ) -> tuple[list[StoredEvent], Any]:
        """Commit a write that stores events of ``run``, then publish them. If the caller
        is cancelled meanwhile the write still commits; its events are still published."""
        start = time.perf_counter()
        what = f"store run {run.id} of agent {run.agent_id}"
        task = asyncio.ensure_future(self._db.write(fn, what=what))
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                try:
                    result = await task
                except Exception:
                    raise asyncio.CancelledError() from None
                self._publish(result[0])
            raise
        self._publish(result[0])
        if self._metrics is not None:
            self._metrics.append_seconds.observe(time.perf_counter() - start)
        return result

    def _publish(self, events: list[StoredEvent]) -> None:
        if self._metrics is not None:
            for ev in events:
                self._metrics.events_appended.labels(ev.kind.value).inc()
        self.feeds.publish(events)


class RuntimeFailedResume(RuntimeFailed):
    """A parked run's stored state does not allow resuming it."""


def _with_usage(run: RunRecord, usage: list[int | None]) -> RunRecord:
    from dataclasses import replace

    return replace(run, input_tokens=usage[0], output_tokens=usage[1])


def _rule_for(kind: str) -> str | None:
    if kind.startswith("allow"):
        return "allow"
    if kind.startswith("reject"):
        return "reject"
    return None


def _option_for_rule(options: Sequence[PermissionOption], decision: str) -> str | None:
    # Prefer the "once" option: the rule is ours, the runtime need not remember it too.
    ranked = sorted(
        (o for o in options if o.kind.startswith(decision)),
        key=lambda o: 0 if o.kind.endswith("once") else 1,
    )
    return ranked[0].option_id if ranked else None
