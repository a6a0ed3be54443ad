"""Waiting for an event or a timeout, whichever comes first, in a task that may be
cancelled.

``asyncio.wait_for(event.wait(), seconds)`` is the obvious way, and on Python
3.11 it loses a cancellation that arrives while the event is being set: it
returns as though woken, and a loop around it waits again instead of ending.
A daemon stopping right after the work that kicked the loop (a restore waking
the search indexer) then hangs in its shutdown. ``asyncio.timeout`` does not
lose it (3.12 rebuilt ``wait_for`` on it for that reason).
"""

from __future__ import annotations

import asyncio

__all__ = ["wait_set"]


async def wait_set(event: asyncio.Event, seconds: float) -> bool:
    """Wait until ``event`` is set or ``seconds`` pass; True when it was set.

    A cancellation of the caller always raises CancelledError here.
    """
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True
