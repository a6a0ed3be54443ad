"""Waiting on the machine's run engine, and breaking its event writes, in unit tests
(in-process machines)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from machine.app import Machine
from machine.models import EventKind, RunRecord, RunState, StoredEvent
from machine.storage import tables
from tests.helpers.poll import apoll_until

__all__ = ["RUN_DEADLINE", "break_appends", "read_until", "wait_for_state"]

RUN_DEADLINE = 10.0


async def wait_for_state(m: Machine, run_id: str, state: RunState) -> RunRecord:
    """Poll the run until it reaches ``state`` (fails after the deadline)."""
    last: list[RunRecord] = []

    async def reached() -> RunRecord | None:
        last[:] = [await m.runs.get_run(run_id)]
        return last[0] if last[0].state is state else None

    def stayed() -> AssertionError:
        return AssertionError(f"run {run_id} stayed {last[0].state}, wanted {state}")

    return await apoll_until(reached, deadline=RUN_DEADLINE, what=f"run {run_id}", fail=stayed)


async def read_until(events: AsyncIterator[StoredEvent], kind: EventKind) -> list[StoredEvent]:
    """Read a stream up to and including the first event of ``kind`` (with a deadline)."""
    seen: list[StoredEvent] = []

    async def read() -> None:
        async for ev in events:
            seen.append(ev)
            if ev.kind is kind:
                return

    await asyncio.wait_for(read(), RUN_DEADLINE)
    return seen


def break_appends(
    monkeypatch: pytest.MonkeyPatch, fault: Callable[[EventKind], BaseException | None]
) -> None:
    """Make storing an event raise what ``fault(kind)`` returns (None: store it)."""
    original = tables.append_event

    # Positional as the engine calls it: (conn, agent_id, run_id, kind, payload, now).
    def append_event(*args: Any) -> StoredEvent:
        error = fault(args[3])
        if error is not None:
            raise error
        return original(*args)

    monkeypatch.setattr(tables, "append_event", append_event)
    original_many = tables.append_events

    # The run stream stores a run's text deltas in bulk: (conn, agent_id, run_id, items).
    def append_events(*args: Any) -> list[StoredEvent]:
        for kind, _, _ in args[3]:
            error = fault(kind)
            if error is not None:
                raise error
        return original_many(*args)

    monkeypatch.setattr(tables, "append_events", append_events)
