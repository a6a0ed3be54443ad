"""Audit records are kept ``audit_retention_days`` by the clock the sweep was given,
and a sweep stopped anywhere leaves only whole records (controlplane.integrity.audit)."""

from __future__ import annotations

import datetime as dt
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from controlplane.integrity.audit import AUDIT_PREFIX, Auditor, AuditRetention
from shared.errors import StoreUnavailable
from shared.store import FolderStore, MemoryStore
from shared.store.base import ObjectStore
from tests.helpers.clock import FixedClock
from tests.helpers.poll import poll_until

KEEP = dt.timedelta(days=400)
NOW = dt.datetime(2027, 6, 15, 12, 0, tzinfo=dt.UTC)


async def _write(store: ObjectStore, ages_in_days: list[float]) -> dict[float, str]:
    """One audit record per age, written by an Auditor whose clock says so; age -> key."""
    clock = FixedClock()
    auditor = Auditor(store, clock=clock)
    keys: dict[float, str] = {}
    for age in ages_in_days:
        clock.now = NOW - dt.timedelta(days=age)
        rec = await auditor.record("system", "test.act", f"t{age}")
        keys[age] = f"{AUDIT_PREFIX}{clock.now:%Y/%m/%d}/{rec.audit_id}.json"
    return keys


async def _kept(store: ObjectStore) -> set[str]:
    return {info.key async for info in store.list(AUDIT_PREFIX)}


async def test_records_older_than_the_retention_go_by_the_sweeps_clock() -> None:
    store = MemoryStore()
    keys = await _write(store, [700, 401, 400, 399, 1, 0])
    clock = FixedClock(NOW)
    removed: list[int] = []
    sweep = AuditRetention(store, KEEP, clock=clock, on_removed=removed.append)

    assert await sweep.sweep() == 2
    assert await _kept(store) == {keys[400], keys[399], keys[1], keys[0]}
    assert sum(removed) == 2
    # Nothing more is due until the clock moves: a second sweep removes nothing.
    assert await sweep.sweep() == 0
    clock.now += dt.timedelta(days=1)  # the 400-day-old day has now ended 400 days ago
    assert await sweep.sweep() == 1
    assert await _kept(store) == {keys[399], keys[1], keys[0]}
    clock.now += dt.timedelta(days=500)
    assert await sweep.sweep() == 3
    assert await _kept(store) == set()


async def test_a_sweep_over_many_pages_stops_at_the_first_record_kept() -> None:
    store = MemoryStore()
    ages = [500 + i for i in range(7)] + [10, 5, 0]
    keys = await _write(store, ages)
    sweep = AuditRetention(store, KEEP, clock=FixedClock(NOW), page_size=2)
    assert await sweep.sweep() == 7
    assert await _kept(store) == {keys[10], keys[5], keys[0]}


async def test_nothing_goes_for_its_age_while_the_clocks_disagree() -> None:
    store = MemoryStore()
    keys = await _write(store, [900, 0])
    agrees = False
    sweep = AuditRetention(store, KEEP, clock=FixedClock(NOW), may_expire=lambda: agrees)
    assert await sweep.sweep() == 0
    assert await _kept(store) == set(keys.values())
    agrees = True
    assert await sweep.sweep() == 1
    assert await _kept(store) == {keys[0]}


class _FailingDeletes(MemoryStore):
    """A store whose deletes fail (as an unreachable store) after ``allowed`` of them."""

    def __init__(self) -> None:
        super().__init__()
        self.allowed = 1_000_000

    async def delete(self, key: str) -> None:
        if self.allowed <= 0:
            raise StoreUnavailable(f"delete {key}: store down")
        self.allowed -= 1
        await super().delete(key)


async def _all_whole(store: ObjectStore) -> None:
    for key in await _kept(store):
        record = json.loads(await store.get(key))
        assert record["action"] == "test.act", (key, record)


async def test_a_sweep_failing_half_way_leaves_whole_records_and_the_next_one_finishes() -> None:
    store = _FailingDeletes()
    keys = await _write(store, [600, 590, 580, 570, 560, 3])
    sweep = AuditRetention(store, KEEP, clock=FixedClock(NOW), page_size=2)
    store.allowed = 3
    with pytest.raises(StoreUnavailable):
        await sweep.sweep()
    left = await _kept(store)
    assert keys[3] in left and len(left) == 3  # two old ones and the recent one
    await _all_whole(store)
    store.allowed = 1_000_000
    assert await sweep.sweep() == 2
    assert await _kept(store) == {keys[3]}


#: A sweep in its own process over a folder store whose fourth delete never
#: returns (it says so in a file first), so the test kills it mid-sweep.
_VICTIM = textwrap.dedent(
    """
    import asyncio, datetime as dt, sys
    from pathlib import Path
    from controlplane.integrity.audit import AuditRetention
    from shared.store import FolderStore

    class Stuck(FolderStore):
        deletes = 0
        async def delete(self, key):
            Stuck.deletes += 1
            if Stuck.deletes == 4:
                Path(sys.argv[2]).write_text("stuck")
                await asyncio.Event().wait()
            await super().delete(key)

    now = dt.datetime.fromisoformat(sys.argv[3])
    sweep = AuditRetention(
        Stuck(sys.argv[1]), dt.timedelta(days=400), clock=lambda: now, page_size=3
    )
    asyncio.run(sweep.sweep())
    """
)


@pytest.mark.integration
async def test_a_sweep_killed_mid_way_leaves_whole_records(tmp_path: Path) -> None:
    store = FolderStore(tmp_path / "store")
    keys = await _write(store, [800 - 10 * i for i in range(9)] + [2, 1])
    marker = tmp_path / "stuck"
    proc = subprocess.Popen(
        [sys.executable, "-c", _VICTIM, str(store.root), str(marker), NOW.isoformat()],
        cwd=Path(__file__).parents[3],
    )
    try:
        poll_until(
            lambda: marker.exists() or proc.poll() is not None, deadline=30, what="the sweep"
        )
        assert proc.poll() is None, "the sweep ended before it was stuck"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    left = await _kept(store)
    # Killed inside its second page: some old records are gone, the rest are whole.
    assert {keys[2], keys[1]} <= left and 2 < len(left) < len(keys)
    await _all_whole(store)
    assert await AuditRetention(store, KEEP, clock=FixedClock(NOW)).sweep() == len(left) - 2
    assert await _kept(store) == {keys[2], keys[1]}
