"""DeploymentGuard: a "not found" is believed only after a fresh look at the marker."""

from __future__ import annotations

import asyncio
import json

import pytest

from controlplane.integrity.trusted import DEPLOYMENT_KEY, DeploymentGuard, GuardedStore
from shared.errors import NotFound, StoreUnavailable, StoreUntrusted
from shared.store import MemoryStore
from tests.helpers.poll import apoll_until

CA = "ca-hash-1"


class CountingStore(MemoryStore):
    """Counts reads of the marker and misses; can hold or fail marker reads."""

    def __init__(self) -> None:
        super().__init__()
        self.marker_reads = 0
        self.misses = 0
        self.marker_down = False
        self.marker_gate = asyncio.Event()
        self.marker_gate.set()

    async def get(self, key: str) -> bytes:
        if key == DEPLOYMENT_KEY:
            self.marker_reads += 1
            await self.marker_gate.wait()
            if self.marker_down:
                raise StoreUnavailable("memory: down")
        try:
            return await super().get(key)
        except NotFound:
            self.misses += 1
            raise


async def _guarded() -> tuple[CountingStore, DeploymentGuard, GuardedStore]:
    inner = CountingStore()
    await inner.put(DEPLOYMENT_KEY, json.dumps({"ca_hash": CA}).encode())
    guard = DeploymentGuard(inner, CA, "memory://test")
    await guard.verify()
    return inner, guard, GuardedStore(inner, guard)


async def test_a_miss_right_after_a_check_still_looks_at_the_marker_again() -> None:
    inner, guard, guarded = await _guarded()
    # The store is emptied a moment after the guard's last check.
    await inner.delete(DEPLOYMENT_KEY)
    with pytest.raises(StoreUntrusted, match="deployment.json is missing"):
        await guarded.get("accounts/a/account.json")
    with pytest.raises(StoreUntrusted):
        await guarded.head("accounts/a/account.json")


async def test_a_miss_in_our_own_store_is_passed_on() -> None:
    inner, _, guarded = await _guarded()
    before = inner.marker_reads
    with pytest.raises(NotFound):
        await guarded.get("accounts/a/account.json")
    assert inner.marker_reads == before + 1


async def test_misses_at_the_same_moment_share_one_check() -> None:
    inner, _, guarded = await _guarded()
    before = inner.marker_reads
    inner.marker_gate.clear()  # the first check is still out when the others miss
    calls = asyncio.gather(
        *(guarded.get(f"accounts/a{i}/account.json") for i in range(20)),
        return_exceptions=True,
    )
    await apoll_until(lambda: inner.misses == 20, deadline=5, what="all 20 calls missed")
    inner.marker_gate.set()
    results = await calls
    assert all(isinstance(r, NotFound) for r in results), results
    # The first miss checks; the 19 that missed while it ran share one more.
    assert inner.marker_reads - before == 2


async def test_a_miss_that_cannot_be_confirmed_answers_unavailable() -> None:
    inner, guard, guarded = await _guarded()
    inner.marker_down = True
    with pytest.raises(StoreUnavailable):
        await guarded.get("accounts/a/account.json")
    assert guard.problem is None  # nothing is concluded from a store that did not answer
