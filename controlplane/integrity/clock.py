"""Our clock against the store's: expiries wait while the two disagree.

A control plane started with its clock days ahead (a bad NTP step, a VM
restored from a snapshot) would otherwise expire every queued prompt and
idempotency key at the first read, and a clock behind keeps expired tokens
alive. The store is a second opinion that the operator does not set by hand:
S3 stamps every answer with its own ``Date``. :class:`ClockCheck` reads it at
start and then every ``interval`` seconds (one one-key listing each time).

While the skew is beyond ``bound`` (or not measured yet on a store that has a
clock), nothing is deleted for its age: :meth:`ClockCheck.may_expire` says
False, and the queue keeps prompts and idempotency keys until the clocks agree
again. Whatever grants access is judged the other way: a token's validity uses
the later of the two clocks (:meth:`ClockCheck.latest_now`), so a clock behind
never stretches a token's life. A folder store shares our clock: there is
nothing to compare, and expiries run as always.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Awaitable, Callable
from typing import Final

from shared.errors import AgentsError
from shared.store.causes import set_cause
from shared.store.clock import StoreTime, store_time
from shared.timestamps import Clock, utc_now

__all__ = ["DEFAULT_BOUND", "ClockCheck", "describe_skew"]

logger = logging.getLogger(__name__)

#: Seconds of disagreement tolerated: the Date header has whole seconds, and a
#: slow answer adds its round trip; an NTP-synced host is within milliseconds.
DEFAULT_BOUND: Final = 60.0


def describe_skew(seconds: float) -> str:
    """``8d 0h 3m ahead`` / ``1h 0m 0s behind``: a skew as a person reads it."""
    side = "ahead of" if seconds >= 0 else "behind"
    left = round(abs(seconds))
    days, left = divmod(left, 86400)
    hours, left = divmod(left, 3600)
    minutes, secs = divmod(left, 60)
    if days:
        amount = f"{days}d {hours}h {minutes}m"
    elif hours:
        amount = f"{hours}h {minutes}m {secs}s"
    else:
        amount = f"{minutes}m {secs}s" if minutes else f"{abs(seconds):.1f}s"
    return f"{amount} {side}"


class ClockCheck:
    """The last measured skew of our clock against the store's, and what it allows."""

    def __init__(
        self,
        store: object,
        *,
        bound: float = DEFAULT_BOUND,
        clock: Clock = utc_now,
        reader: Callable[[object], Awaitable[StoreTime | None]] = store_time,
        on_skew: Callable[[float], None] | None = None,
    ) -> None:
        self._store = store
        self._bound = bound
        self._clock = clock
        self._reader = reader
        self._on_skew = on_skew
        self._has_clock: bool | None = None  # None: not asked yet
        self.skew: float | None = None
        """Seconds our clock is ahead of the store's at the last reading (None: none yet)."""

    @property
    def agrees(self) -> bool:
        """Whether our clock may be trusted for expiries: the store has no clock,
        or the last reading was within the bound."""
        if self._has_clock is False:
            return True
        return self.skew is not None and abs(self.skew) <= self._bound

    def may_expire(self) -> bool:
        """Whether data may be deleted for its age now (see the module's docstring)."""
        return self.agrees

    def latest_now(self) -> dt.datetime:
        """The later of our clock and the store's (as of the last reading): what a
        grant's expiry is judged by, so a clock behind keeps nothing alive."""
        now = self._clock()
        if self.skew is not None and self.skew < 0:
            return now - dt.timedelta(seconds=self.skew)
        return now

    async def check(self) -> float | None:
        """Read the store's clock once; log when agreement changes. Returns the
        skew (None: the store has no clock, or the reading failed)."""
        was = self.agrees if self._has_clock is not None else None
        try:
            reading = await self._reader(self._store)
        except AgentsError as e:
            # Not a measurement: the last one stands (none yet: expiries wait).
            logger.debug("clock check: the store's time could not be read: %s", e)
            return None
        if reading is None:
            self._has_clock = False
            return None
        self._has_clock = True
        self.skew = reading.skew
        if self._on_skew is not None:
            self._on_skew(reading.skew)
        now = self.agrees
        if not now and was is not False:
            logger.error(
                "clock: this control plane's clock is %s the store's (its Date header "
                "says %s); expiries of queued prompts and idempotency keys wait until "
                "the two agree within %.0f s: check NTP on this host",
                describe_skew(reading.skew),
                reading.server.isoformat(timespec="seconds"),
                self._bound,
            )
        elif now and was is False:
            logger.warning(
                "clock: this control plane's clock agrees with the store's again "
                "(%s); expiries resume",
                describe_skew(reading.skew),
            )
        return reading.skew

    async def run(self, interval: float) -> None:
        """Check every ``interval`` seconds until cancelled (its own task)."""
        set_cause("clock")
        while True:
            await asyncio.sleep(interval)  # a period, not synchronisation
            await self.check()
