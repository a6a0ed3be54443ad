"""The store's clock, as a skew check reads it.

Only a remote store has a clock of its own: S3 answers every request with a
``Date`` header, set by the server. A folder or memory store runs on our own
clock, so there is nothing to compare and :func:`store_time` says None.

Wrappers (retries, metrics, deadlines, MACs) hold the store they wrap as
``inner``; the reading goes to the innermost store that has a clock, without
retries: a check that fails is simply not a measurement.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["StoreTime", "store_time"]


@dataclass(frozen=True, slots=True)
class StoreTime:
    """One reading: the server's clock and ours at the same moment."""

    server: dt.datetime
    local: dt.datetime
    """Our clock at the middle of the request that carried ``server``."""

    @property
    def skew(self) -> float:
        """Seconds our clock is ahead of the server's (negative: behind).

        The header has whole seconds, cut down: the server's clock was
        somewhere in the second after it, so the middle of that second is
        compared. A reading is good to half a second plus half the request's
        round trip."""
        return (self.local - self.server).total_seconds() - 0.5


@runtime_checkable
class _HasClock(Protocol):
    async def server_time(self) -> StoreTime: ...


async def store_time(store: object) -> StoreTime | None:
    """Read the clock of ``store`` (or of the store it wraps); None when it has none.

    Raises what the store raises (StoreUnavailable, …) when the reading fails.
    """
    seen = 0
    while store is not None and seen < 16:  # a wrapper chain is a few deep, never a loop
        if isinstance(store, _HasClock):
            return await store.server_time()
        store = getattr(store, "inner", None)
        seen += 1
    return None
