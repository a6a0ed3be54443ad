"""wait_set: an event or a timeout, never a lost cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from shared.wakeups import wait_set


async def _loop_until_cancelled(
    wait: Callable[[asyncio.Event], Awaitable[object]], deadline: float = 10
) -> str:
    """A background loop as the daemons write them: wait for a kick, work, again.
    Cancelled the moment it is kicked, does it end?"""
    kick = asyncio.Event()
    waiting = asyncio.Event()

    async def loop() -> None:
        while True:
            kick.clear()
            waiting.set()
            await wait(kick)

    task = asyncio.create_task(loop())
    await waiting.wait()
    kick.set()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=deadline)
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=5)
        return "kept running"
    return "cancelled" if task.cancelled() else "ended otherwise"


async def test_a_cancellation_as_the_event_is_set_ends_the_loop() -> None:
    assert await _loop_until_cancelled(lambda ev: wait_set(ev, 3600)) == "cancelled"


async def test_set_or_timeout() -> None:
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    event.set()
    assert await wait_set(event, 3600) is True


@pytest.mark.skipif(
    __import__("sys").version_info >= (3, 12), reason="3.12's wait_for keeps the cancellation"
)
async def test_why_not_wait_for_it_loses_that_cancellation_on_311() -> None:
    async def wait_for(event: asyncio.Event) -> None:
        try:
            await asyncio.wait_for(event.wait(), 3600)
        except TimeoutError:
            pass

    # Still waiting a second later: the loop went round instead of ending.
    assert await _loop_until_cancelled(wait_for, deadline=1) == "kept running"
