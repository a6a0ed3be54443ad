"""The one poll-until helper of tests and benches: wait on a condition with a
deadline, never sleep as synchronisation."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["apoll_until", "poll_until"]

T = TypeVar("T")


def _timed_out(
    what: str, deadline: float, fail: Callable[[], BaseException] | None
) -> BaseException:
    return fail() if fail is not None else TimeoutError(f"{what} not within {deadline}s")


def poll_until(
    check: Callable[[], T | None],
    *,
    deadline: float,
    what: str,
    step: float = 0.05,
    fail: Callable[[], BaseException] | None = None,
) -> T:
    """Call ``check`` every ``step`` seconds until it returns a true value; return it.

    ``check`` may raise to stop early (a process that exited). After ``deadline``
    seconds, raise ``fail()`` or TimeoutError naming ``what``.
    """
    end = time.monotonic() + deadline
    while True:
        value = check()
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > end:
            raise _timed_out(what, deadline, fail)
        time.sleep(step)  # poll step under the deadline above


async def apoll_until(
    check: Callable[[], T | None | Awaitable[T | None]],
    *,
    deadline: float,
    what: str,
    step: float = 0.01,
    fail: Callable[[], BaseException] | None = None,
) -> T:
    """:func:`poll_until` inside a test's event loop: ``check`` may be sync or async,
    and the poll step sleeps without blocking the loop."""
    end = time.monotonic() + deadline
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > end:
            raise _timed_out(what, deadline, fail)
        await asyncio.sleep(step)  # poll step under the deadline above
