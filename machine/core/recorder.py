"""The event recorder: every event of a run is committed, then published.

It appends a run's events (and the state changes that go with them),
publishes them to the :class:`~machine.core.feed.FeedHub` once committed, and
writes a run's last event: RUN_FINISHED or RUN_ERROR with the run's end state.
A write whose caller is cancelled still commits and is still published (see
:func:`complete`).

While the engine drives a run, its writes go through a :class:`RunStream`:
the runtime's events are queued to the database writer without waiting for
each commit, so the events a runtime produces during one commit's fsync share
the next one (group commit inside a run, as the writer already does across
runs). Queue order is commit order and publication order, so followers and
Replay still see each event only once it is durable, in seq order. The first
event that fails to store breaks the stream: every later write of the run is
refused in the writer thread itself, in the same batch or the next, so a run
never stores an event after a missing one nor RUN_FINISHED after a loss.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from machine.core.feed import FeedHub
from machine.metrics import MachineMetrics
from machine.models import EventKind, RunErrorCode, RunRecord, RunState, StoredEvent
from machine.runtimes.base import RunOutcome, RuntimeEvent, TextDelta, ToolCall, ToolResult
from machine.storage import tables
from machine.storage.db import Database
from shared.errors import StoreError

__all__ = ["OUTCOME", "EventRecorder", "RunStream", "Usage", "complete", "event_payload"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Events of one run queued and not yet committed before the runtime is made to
#: wait (back-pressure on a runtime faster than the disk).
MAX_PENDING = 256

OUTCOME = {
    RunErrorCode.RUN_INTERRUPTED: RunState.INTERRUPTED,
    RunErrorCode.CANCELLED: RunState.CANCELLED,
    RunErrorCode.RUNTIME_FAILED: RunState.FAILED,
    RunErrorCode.RUNTIME_UNAVAILABLE: RunState.FAILED,
    RunErrorCode.STORAGE_FAILED: RunState.FAILED,
}
"""The end state of a run that ends with each RUN_ERROR code."""


@dataclass
class Usage:
    """Tokens a run has used so far; None until the runtime reports usage
    (unknown is not 0 tokens)."""

    input_tokens: int | None
    output_tokens: int | None

    @classmethod
    def of(cls, run: RunRecord) -> Usage:
        """The usage already stored for ``run``."""
        return cls(run.input_tokens, run.output_tokens)

    def add(self, input_tokens: int, output_tokens: int) -> None:
        """Count a usage report of the runtime."""
        self.input_tokens = (self.input_tokens or 0) + input_tokens
        self.output_tokens = (self.output_tokens or 0) + output_tokens

    def applied(self, run: RunRecord) -> RunRecord:
        """``run`` carrying this usage."""
        return replace(run, input_tokens=self.input_tokens, output_tokens=self.output_tokens)

    def payload(self) -> dict[str, int]:
        """The reported counts, as RUN_FINISHED carries them."""
        pairs = (("input_tokens", self.input_tokens), ("output_tokens", self.output_tokens))
        return {key: value for key, value in pairs if value is not None}


def event_payload(ev: RuntimeEvent) -> tuple[EventKind, dict[str, Any]] | None:
    """The stored kind and payload of a runtime event, or None for one not stored."""
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


async def complete(work: Awaitable[T]) -> T:
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


_Write = Callable[[sqlite3.Connection], list[StoredEvent]]
_Event = tuple[EventKind, dict[str, Any], float]


class _Coalesced:
    """Writes of one run gathered into one database job until the writer takes it.

    The loop thread adds writes (and plain events, stored in bulk) while the job
    waits in the writer's queue; the writer thread seals it when it runs it,
    and a write that comes later starts a new job. One job (one future, one
    savepoint, one answer) per run per commit instead of one per event.
    """

    def __init__(self, run: RunRecord, first: _Write | _Event) -> None:
        self._agent_id = run.agent_id
        self._run_id = run.id
        self._lock = threading.Lock()
        self._items: list[_Write | _Event] = [first]
        self._sealed = False

    @property
    def size(self) -> int:
        return len(self._items)

    def add(self, item: _Write | _Event) -> bool:
        """Add ``item`` unless the writer has taken the job already."""
        with self._lock:
            if self._sealed:
                return False
            self._items.append(item)
            return True

    def seal(self) -> list[_Write | _Event]:
        with self._lock:
            self._sealed = True
            return self._items

    def __call__(self, conn: sqlite3.Connection) -> tuple[list[StoredEvent], None]:
        items = self.seal()
        stored: list[StoredEvent] = []
        events: list[_Event] = []
        for item in items:
            if isinstance(item, tuple):
                events.append(item)
                continue
            if events:
                stored.extend(tables.append_events(conn, self._agent_id, self._run_id, events))
                events = []
            stored.extend(item(conn))
        if events:
            stored.extend(tables.append_events(conn, self._agent_id, self._run_id, events))
        return stored, None


class RunStream:
    """One run's writes, queued in order without waiting for each commit.

    :meth:`submit` hands a write to the database writer at once and publishes
    its events when it commits; :meth:`queue` adds the runtime's events to the
    job still waiting in the writer's queue, if there is one. The writer thread
    marks the stream broken the moment one of its writes will not commit (see
    ``on_abort`` of :meth:`Database.submit`); every write queued after that
    raises instead of running, so the stored run has no event after a missing one.
    """

    def __init__(self, recorder: EventRecorder, run: RunRecord) -> None:
        self._recorder = recorder
        self._run = run
        self.run_id = run.id
        self._what = f"store run {run.id} of agent {run.agent_id}"
        self._pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        #: Set in the writer thread: why a write of this run did not commit.
        self._broken: BaseException | None = None
        #: The first failure seen on the event loop (what :meth:`check` raises).
        self.error: BaseException | None = None
        self._unpublished: list[StoredEvent] = []
        #: The job :meth:`queue` adds to while the writer has not taken it.
        self._open: _Coalesced | None = None
        #: Writes queued and not yet answered (events, mostly): back-pressure.
        self._queued = 0

    def _abort(self, error: BaseException) -> None:
        if self._broken is None:
            self._broken = error

    def submit(
        self,
        fn: Callable[[sqlite3.Connection], tuple[list[StoredEvent], T]],
        *,
        guarded: bool = True,
    ) -> asyncio.Future[tuple[list[StoredEvent], T]]:
        """Queue ``fn``; its events are published once it commits. ``guarded``
        (the default) refuses to run it if an earlier write of the stream failed."""

        def job(conn: sqlite3.Connection) -> tuple[list[StoredEvent], T]:
            broken = self._broken
            if guarded and broken is not None:
                raise StoreError(f"{self._what}: an earlier event was not stored ({broken})")
            return fn(conn)

        self._open = None  # what comes after this write is not folded in before it
        return self._submit(job, 1)

    def queue(self, item: _Write | _Event) -> None:
        """Queue a write or an event (kind, payload, time), guarded as :meth:`submit`:
        into the job still waiting in the writer's queue if there is one, else as a
        new job."""
        if self._open is not None and self._open.add(item):
            self._queued += 1
            return
        job = self._open = _Coalesced(self._run, item)

        def guarded(conn: sqlite3.Connection) -> tuple[list[StoredEvent], None]:
            broken = self._broken
            if broken is not None:
                job.seal()  # nothing more joins a job that will not run
                raise StoreError(f"{self._what}: an earlier event was not stored ({broken})")
            return job(conn)

        self._submit(guarded, 1, job)

    def _submit(
        self,
        fn: Callable[[sqlite3.Connection], tuple[list[StoredEvent], T]],
        count: int,
        coalesced: _Coalesced | None = None,
    ) -> asyncio.Future[tuple[list[StoredEvent], T]]:
        start = time.perf_counter()
        future = self._recorder.db.submit(
            fn,
            what=self._what,
            on_abort=self._abort,
            on_done=lambda f: self._settled(f, start, coalesced),
        )
        self._queued += count
        self._pending.append(future)
        return future

    def _settled(
        self, future: asyncio.Future[Any], start: float, coalesced: _Coalesced | None
    ) -> None:
        self._pending.remove(future)
        self._queued -= coalesced.size if coalesced is not None else 1
        if future.cancelled():  # nobody here cancels them; its failure is unknown
            return
        error = future.exception()
        if error is not None:
            if self.error is None:
                self.error = error
            return
        # The events of one commit are published together, once the loop has
        # taken every answer of the batch (one wake-up of the followers).
        if not self._unpublished:
            asyncio.get_running_loop().call_soon(self.publish)
        self._unpublished.extend(future.result()[0])
        self._recorder.observe_append(start)

    def publish(self) -> None:
        """Hand the committed, not yet published events to their followers."""
        events, self._unpublished = self._unpublished, []
        if events:
            self._recorder.publish(events)

    def check(self) -> None:
        """Raise the first failure of this stream, if any."""
        if self.error is not None:
            raise self.error

    async def room(self) -> None:
        """Wait while too many writes are queued (the runtime outruns the disk)."""
        while self._queued >= MAX_PENDING and self._pending:
            await asyncio.wait([self._pending[0]])

    async def drain(self) -> None:
        """Wait until every queued write has committed or failed (even if the
        caller is cancelled meanwhile: they are answered either way); raise the
        first failure."""
        while self._pending:
            pending = list(self._pending)
            try:
                await asyncio.wait(pending)
            except asyncio.CancelledError:
                await asyncio.shield(asyncio.wait(pending))
                self.publish()
                raise
        self.publish()  # what this caller waited for is published when it returns
        self.check()


class EventRecorder:
    """Appends, publishes and ends runs' event streams."""

    def __init__(
        self,
        db: Database,
        *,
        metrics: MachineMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db = db
        self._metrics = metrics
        self._clock = clock
        self.feeds = FeedHub()
        self._streams: dict[str, RunStream] = {}

    def open_stream(self, run: RunRecord) -> RunStream:
        """Route ``run``'s writes through a :class:`RunStream` until :meth:`close_stream`."""
        stream = self._streams[run.id] = RunStream(self, run)
        return stream

    def close_stream(self, run_id: str) -> None:
        """Back to one commit per write for ``run_id`` (its queued writes stand)."""
        self._streams.pop(run_id, None)

    def observe_append(self, start: float) -> None:
        """Count a committed append's latency (the append_seconds metric)."""
        if self._metrics is not None:
            self._metrics.append_seconds.observe(time.perf_counter() - start)

    async def queue(self, run: RunRecord, item: _Write | _Event) -> None:
        """Store a write (or an event: kind, payload, time) in ``run``'s order without
        waiting for its commit (through the run's stream; a run without one waits).
        Raises the stream's first failure, and waits while too many writes are queued."""
        stream = self._streams.get(run.id)
        if stream is None:
            if isinstance(item, tuple):
                kind, payload, now = item
                await self.append(
                    run, lambda c: tables.append_event(c, run.agent_id, run.id, kind, payload, now)
                )
            else:
                write = item
                await self.append_many(run, lambda c: (write(c), None))
            return
        stream.check()
        await stream.room()
        stream.queue(item)

    async def append(
        self, run: RunRecord, fn: Callable[[sqlite3.Connection], StoredEvent]
    ) -> StoredEvent:
        """Commit a write that stores one event of ``run``, then publish it."""
        events, _ = await self.append_many(run, lambda c: ([fn(c)], None))
        return events[0]

    async def append_many(
        self, run: RunRecord, fn: Callable[[sqlite3.Connection], tuple[list[StoredEvent], T]]
    ) -> tuple[list[StoredEvent], T]:
        """Commit a write that stores events of ``run``, then publish them. If the caller
        is cancelled meanwhile the write still commits; its events are still published.
        Through the run's stream if it has one: after its queued writes, and refused
        if one of them failed."""
        stream = self._streams.get(run.id)
        if stream is not None:
            stream.check()
            future = stream.submit(fn)
            await stream.drain()  # this write's future among them
            return future.result()
        start = time.perf_counter()
        what = f"store run {run.id} of agent {run.agent_id}"
        task = asyncio.ensure_future(self.db.write(fn, what=what))
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                try:
                    result = await task
                except Exception:
                    raise asyncio.CancelledError() from None
                self.publish(result[0])
            raise
        self.publish(result[0])
        self.observe_append(start)
        return result

    def publish(self, events: list[StoredEvent]) -> None:
        """Hand committed events to their followers."""
        if self._metrics is not None:
            for ev in events:
                self._metrics.events_appended.labels(ev.kind.value).inc()
        self.feeds.publish(events)

    async def record(self, run: RunRecord, kind: EventKind, payload: dict[str, Any]) -> None:
        """Store and publish one event of a running run (in its stream's order: the
        event is published once committed; this returns once it is queued)."""
        await self.queue(run, (kind, payload, self._clock()))

    async def finish(
        self, run: RunRecord, outcome: RunOutcome, started: float, usage: Usage
    ) -> None:
        """End ``run`` with RUN_FINISHED."""
        now = self._clock()
        duration = max(0, int((now - started) * 1000))
        payload = {
            "stop_reason": outcome.stop_reason,
            "usage": usage.payload(),
            "duration_ms": duration,
        }

        def write(conn: sqlite3.Connection) -> StoredEvent:
            ev = tables.append_event(
                conn, run.agent_id, run.id, EventKind.RUN_FINISHED, payload, now
            )
            tables.set_run_state(
                conn,
                run.id,
                RunState.FINISHED,
                finished_at=now,
                duration_ms=duration,
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
                stop_reason=outcome.stop_reason,
            )
            return ev

        await self.append(run, write)
        self.count_end(RunState.FINISHED)

    async def end(
        self, run: RunRecord, code: RunErrorCode, message: str, started: float | None
    ) -> None:
        """End ``run`` (carrying its usage) with RUN_ERROR ``code``: after every write
        queued in its stream, even when one of those failed (this is how such a run
        ends)."""
        stream = self._streams.pop(run.id, None)
        if stream is not None:
            try:
                await stream.drain()
            except Exception as e:
                logger.debug("run %s: ending after a failed write: %s", run.id, e)
        now = self._clock()
        await self.append(run, lambda c: self.end_sync(c, run, code, message, now, started))
        self.count_end(OUTCOME[code])

    def end_sync(
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
        ev = tables.append_event(
            conn,
            run.agent_id,
            run.id,
            EventKind.RUN_ERROR,
            {"code": code.value, "message": message},
            now,
        )
        tables.set_run_state(
            conn,
            run.id,
            OUTCOME[code],
            finished_at=now,
            duration_ms=duration,
            error_code=code.value,
            input_tokens=run.input_tokens,
            output_tokens=run.output_tokens,
        )
        tables.cancel_pending_permissions(conn, run.id)
        return ev

    def count_end(self, state: RunState) -> None:
        """Count a run that ended in ``state`` (the runs_finished metric)."""
        if self._metrics is not None:
            self._metrics.runs_finished.labels(state.value).inc()
