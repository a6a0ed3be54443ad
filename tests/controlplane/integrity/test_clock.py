"""ClockCheck: our clock against the store's Date, and what a skew allows."""

from __future__ import annotations

import datetime as dt
import logging

import pytest
from prometheus_client import CollectorRegistry

from controlplane.integrity.clock import ClockCheck, describe_skew
from shared.errors import StoreUnavailable
from shared.store import MemoryStore
from shared.store.clock import StoreTime, store_time
from shared.store.wrappers import MeteredStore, RetryingStore
from tests.helpers.clock import FixedClock

DAY = 86400.0


class StoreClock:
    """A store's clock a test moves: answers readings, or fails with ``down``."""

    def __init__(self, clock: FixedClock) -> None:
        self.local = clock
        self.ahead = 0.0  # seconds our clock is ahead of the store's
        self.down = False
        self.reads = 0

    async def __call__(self, _store: object) -> StoreTime | None:
        self.reads += 1
        if self.down:
            raise StoreUnavailable("store s3://b: 503")
        now = self.local()
        # A Date header is cut down to its second: here, half a second.
        server = now - dt.timedelta(seconds=self.ahead + 0.5)
        return StoreTime(server=server, local=now)


def _check(clock: FixedClock, store: StoreClock, seen: list[float]) -> ClockCheck:
    return ClockCheck(object(), bound=60, clock=clock, reader=store, on_skew=seen.append)


async def test_expiries_wait_until_a_first_reading_and_while_skewed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FixedClock()
    store = StoreClock(clock)
    seen: list[float] = []
    check = _check(clock, store, seen)
    assert not check.may_expire()  # nothing measured yet
    assert await check.check() == 0.0
    assert check.may_expire()
    store.ahead = 8 * DAY
    with caplog.at_level(logging.WARNING, "controlplane.integrity.clock"):
        await check.check()
        await check.check()
    assert not check.may_expire()
    assert seen == [0.0, 8 * DAY, 8 * DAY]
    lines = [r.getMessage() for r in caplog.records]
    # One line for the change, not one per check; it names the skew and the cure.
    assert len(lines) == 1 and "8d 0h 0m ahead of the store's" in lines[0]
    assert "NTP" in lines[0]
    caplog.clear()
    store.ahead = 1.5
    with caplog.at_level(logging.WARNING, "controlplane.integrity.clock"):
        await check.check()
    assert check.may_expire()
    assert ["agrees with the store's again" in r.getMessage() for r in caplog.records] == [True]


async def test_a_failed_reading_keeps_the_last_one() -> None:
    clock = FixedClock()
    store = StoreClock(clock)
    check = _check(clock, store, [])
    store.down = True
    assert await check.check() is None
    assert not check.may_expire()  # never measured: still waiting
    store.down = False
    store.ahead = -2 * DAY
    await check.check()
    store.down = True
    await check.check()
    assert check.skew == -2 * DAY and not check.may_expire()


async def test_a_token_is_judged_by_the_later_clock() -> None:
    clock = FixedClock()
    store = StoreClock(clock)
    check = _check(clock, store, [])
    store.ahead = -DAY  # we are a day behind: the store's clock is later
    await check.check()
    assert check.latest_now() == clock() + dt.timedelta(days=1)
    store.ahead = DAY  # ahead: our own clock is the later one
    await check.check()
    assert check.latest_now() == clock()


async def test_a_store_without_a_clock_lets_expiries_run() -> None:
    wrapped = MeteredStore(RetryingStore(MemoryStore()), "agents_cp", CollectorRegistry())
    assert await store_time(wrapped) is None
    check = ClockCheck(wrapped, bound=60)
    assert await check.check() is None
    assert check.may_expire() and check.skew is None


def test_skews_read_as_a_person_says_them() -> None:
    assert describe_skew(8 * DAY + 180) == "8d 0h 3m ahead of"
    assert describe_skew(-3600) == "1h 0m 0s behind"
    assert describe_skew(-0.25) == "0.2s behind"
    assert describe_skew(125) == "2m 5s ahead of"
