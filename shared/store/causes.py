"""Why a store request was made: a cause carried by the context, counted by MeteredStore.

A daemon's store requests come from a few kinds of work (a heartbeat, the
periodic self-check, a join, an admin call). Each entry point names its kind
once with :func:`store_cause`, and every store call made under it, in the same
task or in tasks it starts (asyncio copies the context into a new task),
carries that cause::

    with store_cause("self_check"):
        await guard.verify()

:class:`~shared.store.wrappers.MeteredStore` counts each operation by cause
(``<namespace>_store_requests_total{cause, operation}``) when it was given the
daemon's list of causes; a cause not on that list counts as ``other``, so the
label set stays fixed whatever a caller sets. The innermost cause wins: work
that is its own kind wherever it is started from (a presence write) names
itself, inside whatever started it.
"""

from __future__ import annotations

import contextvars
from typing import Final

__all__ = ["OTHER", "current_cause", "set_cause", "store_cause"]

#: The cause of a request made outside every named entry point.
OTHER: Final = "other"

_CAUSE: contextvars.ContextVar[str] = contextvars.ContextVar("store_cause", default=OTHER)


def current_cause() -> str:
    """The cause store requests made here are counted under."""
    return _CAUSE.get()


class store_cause:  # lower case: read as a function, ``with store_cause("x"):``
    """Count the store requests made inside the block (and in tasks started in it)
    under ``cause``.

    A class rather than a generator-based context manager: the link enters one
    for every heartbeat, and this costs a tenth as much.
    """

    __slots__ = ("_cause", "_token")

    def __init__(self, cause: str) -> None:
        self._cause = cause

    def __enter__(self) -> None:
        self._token = _CAUSE.set(self._cause)

    def __exit__(self, *exc: object) -> None:
        _CAUSE.reset(self._token)


def set_cause(cause: str) -> None:
    """Name the cause for the rest of the current task.

    For a task's own entry point (an RPC handler, a background loop), where the
    task's context is its own and ends with it; elsewhere use :func:`store_cause`.
    """
    _CAUSE.set(cause)
