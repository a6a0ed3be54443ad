"""Waiting on the machine's run engine in unit tests (in-process machines)."""

from __future__ import annotations

import asyncio
import time

from machine.app import Machine
from machine.models import RunRecord, RunState

__all__ = ["RUN_DEADLINE", "wait_for_state"]

RUN_DEADLINE = 10.0


async def wait_for_state(m: Machine, run_id: str, state: RunState) -> RunRecord:
    """Poll the run until it reaches ``state`` (fails after the deadline)."""
    end = time.monotonic() + RUN_DEADLINE
    while True:
        run = await m.runs.get_run(run_id)
        if run.state is state:
            return run
        assert time.monotonic() < end, f"run {run_id} stayed {run.state}, wanted {state}"
        await asyncio.sleep(0.01)  # poll step under the deadline above
