"""The permission broker: a run asks, waits (also while parked across a
restart), a person answers, and remembered rules answer for them.

A request is stored (with its PERMISSION_REQUEST event) before anyone waits
on it; an answer is stored (with PERMISSION_ANSWERED and the run back in
RUNNING) before the waiting run is woken. An answer that arrives before the
run waits (a parked run still getting its agent's turn) is kept until it does.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from machine.core.recorder import EventRecorder, complete
from machine.models import EventKind, PendingPermission, RunRecord, RunState, StoredEvent
from machine.models import validate_runtime_ref as _validate_ref
from machine.runtimes.base import (
    PermissionDecision,
    PermissionOption,
    PermissionRequest,
    ResumeInfo,
    RuntimeFailed,
)
from machine.storage import tables
from machine.storage.db import Database
from shared.errors import InvalidArgument, InvalidState
from shared.ids import validate_id

__all__ = ["PermissionBroker", "ResumeGate", "RuntimeFailedResume"]

logger = logging.getLogger(__name__)


class RuntimeFailedResume(RuntimeFailed):
    """A parked run's stored state does not allow resuming it."""


@dataclass
class _Parked:
    """The requests one run waits on, and answers that came before it waited."""

    waiters: dict[str, asyncio.Future[PermissionDecision]] = field(default_factory=dict)
    early: dict[str, PermissionDecision] = field(default_factory=dict)


@dataclass
class ResumeGate:
    """While a run resumes, what the runtime re-emits up to the re-asked request is
    already stored: the gate drops it, and answers requests already answered."""

    resume: ResumeInfo | None
    answered: dict[str, PendingPermission] = field(default_factory=dict)
    suppressing: bool = False

    def __post_init__(self) -> None:
        self.suppressing = self.resume is not None

    def replayed(self, run_id: str, req: PermissionRequest) -> PermissionDecision | None:
        """The stored answer to ``req`` while suppressing, else None (ask for real)."""
        if not self.suppressing:
            return None
        assert self.resume is not None
        if req.request_id == self.resume.pending.request_id:
            self.suppressing = False
            return self.resume.decision
        earlier = self.answered.get(req.request_id)
        if earlier is not None and earlier.option_id:
            return PermissionDecision(earlier.option_id)
        logger.warning("run %s: resumed runtime diverged at %s", run_id, req.request_id)
        self.suppressing = False
        return None


class PermissionBroker:
    """Stores permission requests and answers and wakes the runs waiting on them.

    ``track`` hands the engine a run's new record after a request or an answer
    changed its state, and says whether the engine still drives that run.
    """

    def __init__(
        self,
        db: Database,
        recorder: EventRecorder,
        *,
        track: Callable[[RunRecord], bool],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._db = db
        self._recorder = recorder
        self._track = track
        self._clock = clock
        self._runs: dict[str, _Parked] = {}

    def waiting(self, run_id: str) -> bool:
        """Whether the run is waiting for a person now."""
        parked = self._runs.get(run_id)
        return parked is not None and bool(parked.waiters)

    def forget(self, run_id: str) -> None:
        """Drop what is kept for a run that the engine no longer drives."""
        self._runs.pop(run_id, None)

    def _parked(self, run_id: str) -> _Parked:
        return self._runs.setdefault(run_id, _Parked())

    async def gate(self, run: RunRecord, resume: ResumeInfo | None) -> ResumeGate:
        """The gate for a run driven (again) with ``resume``."""
        if resume is None:
            return ResumeGate(None)
        perms = await self._db.read(lambda c: tables.run_permissions(c, run.id))
        return ResumeGate(resume, {p.request_id: p for p in perms if p.state == "answered"})

    async def ask(self, run: RunRecord, req: PermissionRequest) -> PermissionDecision:
        """Store the request; answer it by a remembered rule or wait for a person."""
        now = self._clock()
        options = [(o.option_id, o.name, o.kind) for o in req.options]
        request_payload = {
            "request_id": req.request_id,
            "call_id": req.call_id,
            "title": req.title,
            "options": [{"option_id": i, "name": n, "kind": k} for i, n, k in options],
        }

        def write(conn: sqlite3.Connection) -> tuple[list[StoredEvent], str | None]:
            decision = tables.rule_for(conn, run.agent_id, req.title)
            chosen = _option_for_rule(req.options, decision) if decision else None
            events = [
                tables.append_event(
                    conn, run.agent_id, run.id, EventKind.PERMISSION_REQUEST, request_payload, now
                )
            ]
            tables.insert_permission(
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
                    tables.append_event(
                        conn, run.agent_id, run.id, EventKind.PERMISSION_ANSWERED, answer, now
                    )
                )
            else:
                tables.set_run_state(conn, run.id, RunState.WAITING_PERMISSION)
            return events, chosen

        future: asyncio.Future[PermissionDecision] = asyncio.get_running_loop().create_future()
        # Register before the write so an answer racing the commit finds the waiter.
        parked = self._parked(run.id)
        parked.waiters[req.request_id] = future
        try:
            _, chosen = await self._recorder.append_many(run, write)
            if chosen:
                return PermissionDecision(chosen)
            self._track(await self._db.read(lambda c: tables.get_run(c, run.id)))
            return await future
        finally:
            parked.waiters.pop(req.request_id, None)

    async def wait_parked(self, run: RunRecord) -> ResumeInfo:
        """A run paused before a restart: wait for its answer, then resume it."""
        perms = await self._db.read(lambda c: tables.run_permissions(c, run.id))
        pending = [p for p in perms if p.state == "pending"]
        if not pending:
            raise RuntimeFailedResume(f"run {run.id}: waiting but no pending request")
        perm = pending[-1]
        parked = self._parked(run.id)
        future: asyncio.Future[PermissionDecision] = asyncio.get_running_loop().create_future()
        parked.waiters[perm.request_id] = future
        early = parked.early.pop(perm.request_id, None)
        if early is not None:
            future.set_result(early)
        try:
            decision = await future
        finally:
            parked.waiters.pop(perm.request_id, None)
        return ResumeInfo(_request_from(perm), decision)

    async def answer(
        self, run_id: str, request_id: str, option_id: str, *, remember: bool = False
    ) -> RunRecord:
        """Answer a pending permission request; the run carries on."""
        validate_id("run", run_id, "run_id")
        _validate_ref(request_id, "request_id")
        _validate_ref(option_id, "option_id")
        now = self._clock()

        def write(conn: sqlite3.Connection) -> tuple[StoredEvent, RunRecord]:
            run = tables.get_run(conn, run_id)
            perm = tables.get_permission(conn, run_id, request_id)
            if perm.state != "pending" or run.state is not RunState.WAITING_PERMISSION:
                raise InvalidState(
                    f"answer permission {request_id}", f"it is not pending ({perm.state})"
                )
            kinds = {o[0]: o[2] for o in perm.options}
            if option_id not in kinds:
                raise InvalidArgument(
                    "option_id", f"{option_id!r} is not one of {', '.join(sorted(kinds))}"
                )
            tables.answer_permission(
                conn, run_id, request_id, option_id, remember=remember, now=now
            )
            if remember:
                decision = _rule_for(kinds[option_id])
                if decision is not None:
                    tables.remember_rule(conn, run.agent_id, perm.title, decision, now)
            ev = tables.append_event(
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
            tables.set_run_state(conn, run_id, RunState.RUNNING)
            return ev, tables.get_run(conn, run_id)

        async def commit() -> RunRecord:
            ev, run = await self._db.write(write)
            self._recorder.publish([ev])
            active = self._track(run)
            parked = self._runs.get(run_id)
            waiter = parked.waiters.get(request_id) if parked else None
            if waiter is not None and not waiter.done():
                waiter.set_result(PermissionDecision(option_id))
            elif active:
                self._parked(run_id).early[request_id] = PermissionDecision(option_id)
            else:
                logger.warning("run %s: answer stored but the run is not active", run_id)
            return run

        # Once the answer commits, the run must carry on even if the caller has gone.
        return await complete(commit())


def _request_from(perm: PendingPermission) -> PermissionRequest:
    return PermissionRequest(
        request_id=perm.request_id,
        call_id=perm.call_id,
        title=perm.title,
        options=tuple(PermissionOption(o[0], o[1], o[2]) for o in perm.options),
    )


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
