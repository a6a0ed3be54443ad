"""Waiting on the machine's run engine in unit tests (in-process machines)."""

from __future__ import annotations

from machine.app import Machine
from machine.models import RunRecord, RunState
from tests.helpers.poll import apoll_until

__all__ = ["RUN_DEADLINE", "wait_for_state"]

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
