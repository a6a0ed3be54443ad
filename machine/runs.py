"""The run engine: prompts become runs, runs become durable event streams.

Rules it keeps:

- Every event is committed (fsync'd) before anyone sees it: readers follow the
  database, helped by the in-memory :class:`~machine.feed.FeedHub`.
- One run at a time per agent; later prompts queue in arrival order. A run
  paused on a permission request keeps its agent busy (also across restarts).
- The run belongs to the daemon, not to the caller's stream: a reader going
  away does not stop it; :meth:`RunEngine.cancel` does.
- A prompt delivered by the control plane (:meth:`RunEngine.accept_delivery`)
  is stored as a queued run with its prompt id (unique) before it is
  acknowledged; a redelivery finds that run and starts nothing. Such a run
  still queued at a restart is started then instead of being interrupted: the
  control plane forgot it once acknowledged, so nobody would send it again.
- At start, other runs that were queued or running are marked interrupted and get
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
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from machine import store
from machine.attachments import AttachmentStore
from machine.db import Database
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
)
from machine.permissions import PermissionBroker
from machine.recorder import EventRecorder, Usage, complete, event_payload
from machine.runtimes import RuntimeRegistry
from machine.runtimes.base import (
    PermissionDecision,
    PermissionRequest,
    ResumeInfo,
    RunContext,
    Runtime,
    RuntimeEvent,
    RuntimeFailed,
    SessionStarted,
    UsageReport,
)
from shared.errors import (
    AgentsError,
    DatabaseDamaged,
    DiskFull,
    InvalidArgument,
    InvalidState,
    NotFound,
    StoreError,
    TooLarge,
)
from shared.ids import new_id, validate_id

__all__ = ["Delivered", "RunEngine"]

logger = logging.getLogger(__name__)

CancelReason = Literal["user", "shutdown"]
"""Why a run's task was cancelled: a person cancelled the run, or the daemon stops."""

_MAX_ATTACHMENTS = 32
_READ_BATCH = 500
# A follower holds at most one batch: bounded by bytes too, so large events
# (a long prompt, a big tool output) do not make a batch hundreds of MiB.
_READ_BYTES = 256 * 1024
# Retrying the final event of a run whose storage failed: first after this
# long, doubling up to the cap (a freed disk is noticed within the cap).
_END_RETRY_FIRST = 0.2
_END_RETRY_MAX = 5.0


def _storage_fault(error: BaseException) -> bool:
    """Whether ``error`` is the database failing to store, not the run failing."""
    return isinstance(error, DiskFull | DatabaseDamaged | StoreError)


@dataclass
class _Active:
    """In-memory state of one open run."""

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
        self._registry = runtimes
        self._attachments = attachments
        self.prompt_limit = prompt_limit
        self._metrics = metrics
        self._clock = clock
        self._recorder = EventRecorder(db, metrics=metrics, clock=clock)
        self.feeds = self._recorder.feeds
        self._permissions = PermissionBroker(db, self._recorder, track=self._track, clock=clock)
        self._active: dict[str, _Active] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._runtimes: dict[str, Runtime] = {}
        self._closing = False
        # run id -> called with the start time when that run starts (schedule lag).
        self._start_hooks: dict[str, Callable[[float], None]] = {}

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        """Recover after a restart; return the number of runs marked interrupted."""
        now = self._clock()

        def recover(
            conn: sqlite3.Connection,
        ) -> tuple[list[StoredEvent], list[RunRecord], list[RunRecord]]:
            events = []
            delivered = []
            for run in store.runs_in_states(conn, (RunState.QUEUED, RunState.RUNNING)):
                if run.state is RunState.QUEUED and (
                    run.prompt_id or store.is_scheduled_run(conn, run.id)
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
                    self._recorder.end_sync(
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
            return events, waiting, delivered

        events, waiting, delivered = await self._db.write(recover)
        self._recorder.publish(events)
        for ev in events:
            self._recorder.count_end(RunState.INTERRUPTED)
            logger.info("run %s interrupted by a restart", ev.run_id)
        for run in waiting:
            # Park the run: it holds its agent's turn until someone answers or cancels.
            self._spawn(run, parked=True)
        for run in delivered:  # in creation order: each agent's prompts keep theirs
            self._spawn(run, parked=False)
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
        for runtime in self._runtimes.values():
            try:
                await runtime.close()
            except Exception:
                logger.exception("closing runtime %s failed", runtime.name)
        self._runtimes.clear()

    async def release_runtime(self, agent_id: str) -> None:
        """Stop the agent's runtime (its process, if any) and forget it; the agent
        must have no open run (an archived one has none)."""
        runtime = self._runtimes.pop(agent_id, None)
        if runtime is not None:
            await runtime.close()

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
            existing = store.run_for_prompt(conn, prompt_id)
            if existing is not None:
                return existing, False, ""
            try:
                validate_id("agent", agent_id, "agent_id")
                size = len(text.encode("utf-8", "surrogatepass"))
                if size > self.prompt_limit:
                    raise TooLarge("prompt", self.prompt_limit, size)
                if not text.strip():
                    raise InvalidArgument("prompt", "must not be empty")
                self._check_runnable(store.get_agent(conn, agent_id, self.ids.own))
            except (InvalidArgument, InvalidState, NotFound) as e:
                return None, False, str(e)
            store.insert_run(conn, run_id, agent_id, text, (), now, prompt_id=prompt_id)
            return store.get_run(conn, run_id), True, ""

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
                    resume = await self._permissions.wait_parked(active.run)
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
                self._forget(run.id)
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

    def _forget(self, run_id: str) -> None:
        self._active.pop(run_id, None)
        self._start_hooks.pop(run_id, None)
        self._permissions.forget(run_id)

    async def _end_unended(self, active: _Active) -> None:
        """Store the final event of a run whose earlier attempt failed: CANCELLED if
        someone cancelled it, else STORAGE_FAILED. Call under ``active.ending``."""
        run_id = active.run.id
        if active.cancel_reason == "user":
            await self._end(active, RunErrorCode.CANCELLED, "cancelled by the user", None)
        else:
            await self._end_storage_failed(active, None)
        active.unended = False
        self._forget(run_id)
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

        await self._recorder.append(run, write)
        hook = self._start_hooks.pop(run.id, None)
        if hook is not None:
            hook(started)
        active.run = await self._db.read(lambda c: store.get_run(c, run.id))
        self._update_gauges()
        if self._metrics is not None:
            self._metrics.runs_started.inc()

    async def _run_runtime(
        self, active: _Active, started: float, resume: ResumeInfo | None
    ) -> None:
        run = active.run
        agent = await self._db.read(
            lambda c: store.get_agent(c, run.agent_id, self.ids.own),
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
                await self._db.write(lambda c: store.set_session_id(c, run.agent_id, ev.session_id))
                return
            mapped = event_payload(ev)
            if mapped is None:
                logger.warning("run %s: ignoring unknown runtime event %r", run.id, type(ev))
                return
            try:
                await self._recorder.record(run, *mapped)
            except Exception as e:
                if _storage_fault(e):
                    active.store_error = active.store_error or str(e)
                raise

        async def ask(req: PermissionRequest) -> PermissionDecision:
            replayed = gate.replayed(run.id, req)
            if replayed is not None:
                return replayed
            return await self._permissions.ask(active.run, req)

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

    def _runtime_for(self, agent: AgentRecord) -> Runtime:
        runtime = self._runtimes.get(agent.id)
        if runtime is None:
            runtime = self._registry.create(
                agent.runtime, agent_id=agent.id, folder=Path(agent.folder), settings=agent.settings
            )
            self._runtimes[agent.id] = runtime
        return runtime

    async def _end(
        self,
        active: _Active,
        code: RunErrorCode,
        message: str,
        started: float | None,
        usage: Usage | None = None,
    ) -> None:
        run = active.run if usage is None else usage.applied(active.run)
        await self._recorder.end(run, code, message, started)

    async def _on_cancelled(self, active: _Active, started: float | None) -> None:
        run = await self._db.read(lambda c: store.get_run(c, active.run.id))
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
