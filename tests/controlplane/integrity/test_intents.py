"""The intent-record pattern: what recovery rolls back, and what it must never touch."""

from __future__ import annotations

import datetime as dt

from controlplane.integrity.intents import WAIT_RECHECK, Intent, Intents
from shared.store import MemoryStore

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


class Clock:
    def __init__(self, now: dt.datetime) -> None:
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now


def _intents(
    store: MemoryStore,
    clock: Clock,
    rolled: list[str],
    verdict: bool = True,
    ticks: list[float] | None = None,
) -> Intents:
    at = ticks if ticks is not None else [0.0]
    intents = Intents(store, clock, monotonic=lambda: at[0])

    async def resolver(intent: Intent, age: float) -> bool:
        rolled.append(intent.intent_id)
        return verdict

    intents.register("demo", resolver)
    return intents


async def test_recover_rolls_back_only_what_an_earlier_run_left() -> None:
    store, rolled = MemoryStore(), []  # type: list[str]
    crashed = _intents(store, Clock(T0), rolled)
    left = await crashed.begin("demo", thing="a")  # the process dies here
    clock = Clock(T0 + dt.timedelta(seconds=5))
    now = _intents(store, clock, rolled)
    # A change in flight in this process, and one committed while recover was
    # looking (a stale listing): neither is rolled back.
    async with now.change("demo", thing="b"):
        stale = [i for i in await now.pending() if i.fields["thing"] == "b"]
        assert await now.recover() == 1
    assert rolled == [left.intent_id]

    async def stale_listing() -> list[Intent]:
        return stale

    now.pending = stale_listing  # type: ignore[method-assign]
    assert await now.recover() == 0
    assert rolled == [left.intent_id]


async def test_a_held_change_is_resolved_when_its_resolver_agrees() -> None:
    store, rolled = MemoryStore(), []  # type: list[str]
    intents = _intents(store, Clock(T0), rolled, verdict=False)
    async with intents.change("demo", hold=True, thing="c") as held:
        pass
    assert [i.intent_id for i in await intents.pending()] == [held.intent_id]
    assert await intents.recover() == 0  # the resolver says wait
    assert rolled == [held.intent_id]
    await intents.commit(held)
    assert await intents.pending() == []


async def test_an_error_inside_the_change_rolls_it_back_at_once() -> None:
    store, rolled = MemoryStore(), []  # type: list[str]
    intents = _intents(store, Clock(T0), rolled)
    try:
        async with intents.change("demo", thing="d") as failed:
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert rolled == [failed.intent_id]
    assert await intents.pending() == []


async def test_an_earlier_run_whose_clock_ran_ahead_is_still_recovered() -> None:
    store, rolled = MemoryStore(), []  # type: list[str]
    # The last process's clock was an hour ahead (then NTP stepped it back, or
    # the control plane was restored onto another host).
    crashed = _intents(store, Clock(T0 + dt.timedelta(hours=1)), rolled)
    left = await crashed.begin("demo", thing="a")  # the process dies here
    now = _intents(store, Clock(T0), rolled)
    assert await now.recover() == 1
    assert rolled == [left.intent_id]


async def test_the_self_check_lists_intents_only_when_something_may_have_changed() -> None:
    """recover_if_due lists intents/ (and asks a resolver) only when something may
    have changed: a waiting intent is due (WAIT_RECHECK after its resolver said
    wait), a roll-back was left to recovery, or ``every`` seconds passed. Intents
    begun here need no listing, and each record is read once. (An idle control
    plane listed it at every heartbeat tick; one with many joins waiting for
    their machines listed and read them all, and asked each resolver, at every tick.)"""
    store, rolled = MemoryStore(), []  # type: list[str]
    listings, reads = [0], [0]
    list_pages, get = store.list_pages, store.get

    def counting(prefix: str = "", **kw: object):  # type: ignore[no-untyped-def]
        if prefix.startswith("cp/intents/"):
            listings[0] += 1
        return list_pages(prefix, **kw)  # type: ignore[arg-type]

    async def counting_get(key: str) -> bytes:
        reads[0] += key.startswith("cp/intents/")
        return await get(key)

    store.list_pages = counting  # type: ignore[method-assign]
    store.get = counting_get  # type: ignore[method-assign]
    crashed = _intents(store, Clock(T0), rolled, verdict=False)
    left = await crashed.begin("demo", thing="held")  # left behind; its resolver says wait
    ticks = [0.0]
    now = _intents(store, Clock(T0), rolled, verdict=False, ticks=ticks)
    await now.recover()  # at start: listed, read, asked
    assert (listings[0], reads[0], rolled) == (1, 1, [left.intent_id])
    for second in range(1, int(WAIT_RECHECK)):
        ticks[0] = second
        assert await now.recover_if_due(every=3600) == 0
    assert (listings[0], reads[0], len(rolled)) == (1, 1, 1)  # waiting: not asked yet
    ticks[0] = WAIT_RECHECK
    await now.recover_if_due(every=3600)  # due: listed and asked, not read again
    assert (listings[0], reads[0], len(rolled)) == (2, 1, 2)
    now.register("demo", lambda intent, age: _agree(rolled, intent))
    ticks[0] = 2 * WAIT_RECHECK
    assert await now.recover_if_due(every=3600) == 1  # rolled back now: nothing left
    for _ in range(3):
        ticks[0] += 1
        assert await now.recover_if_due(every=3600) == 0
    assert listings[0] == 3  # quiet: no listing
    # A change committed here, and a held one: neither needs a listing.
    async with now.change("demo", thing="new"):
        pass
    async with now.change("demo", hold=True, thing="held here") as held:
        pass
    ticks[0] += 1
    await now.recover_if_due(every=3600)
    assert listings[0] == 3
    ticks[0] += WAIT_RECHECK  # the held one is due: asked (and rolled back)
    assert await now.recover_if_due(every=3600) == 1
    assert (listings[0], rolled[-1]) == (4, held.intent_id)
    ticks[0] += 1
    await now.recover_if_due(every=0)  # the safety net's period passed
    assert listings[0] == 5
    assert reads[0] == 1  # every record read once at most, ours never


async def test_a_waiting_intent_is_asked_again_after_the_configured_recheck() -> None:
    """``recheck`` (config intent_recheck_seconds) replaces WAIT_RECHECK: a held
    change and one an earlier process left are asked again that long after they
    said wait, not before."""
    store, rolled = MemoryStore(), []  # type: list[str]
    crashed = _intents(store, Clock(T0), rolled, verdict=False)
    left = await crashed.begin("demo", thing="left")
    ticks = [0.0]
    intents = Intents(store, Clock(T0), monotonic=lambda: ticks[0], recheck=0.5)
    asked: list[str] = []

    async def wait(intent: Intent, age: float) -> bool:
        asked.append(intent.intent_id)
        return False

    intents.register("demo", wait)
    await intents.recover()  # at start: asked once, it says wait
    async with intents.change("demo", hold=True, thing="held") as held:
        pass
    assert asked == [left.intent_id]
    ticks[0] = 0.4
    await intents.recover_if_due(every=3600)
    assert asked == [left.intent_id]  # neither is due yet
    ticks[0] = 0.5
    await intents.recover_if_due(every=3600)
    assert sorted(asked) == sorted([left.intent_id, left.intent_id, held.intent_id])


async def test_an_intent_committed_while_its_resolver_ran_leaves_no_recheck() -> None:
    """A held join confirmed (committed) while recovery asked its resolver: the
    resolver's "wait" must not leave a recheck of nothing behind, which would be
    due for ever and list intents/ at every tick."""
    store, rolled = MemoryStore(), []  # type: list[str]
    ticks = [0.0]
    intents = _intents(store, Clock(T0), rolled, verdict=False, ticks=ticks)
    async with intents.change("demo", hold=True, thing="join") as held:
        pass

    async def commits_meanwhile(intent: Intent, age: float) -> bool:
        await intents.commit(held)  # the machine connected
        return False  # what the resolver saw: not confirmed yet

    intents.register("demo", commits_meanwhile)
    ticks[0] = WAIT_RECHECK
    await intents.recover_if_due(every=3600)
    listings = [0]
    list_pages = store.list_pages

    def counting(prefix: str = "", **kw: object):  # type: ignore[no-untyped-def]
        listings[0] += 1
        return list_pages(prefix, **kw)  # type: ignore[arg-type]

    store.list_pages = counting  # type: ignore[method-assign]
    for second in range(1, 100):
        ticks[0] = WAIT_RECHECK + second
        await intents.recover_if_due(every=3600)
    assert listings[0] == 0


async def _agree(rolled: list[str], intent: Intent) -> bool:
    rolled.append(intent.intent_id)
    return True


async def test_replicas_leave_a_live_peers_intents_to_it() -> None:
    store, rolled = MemoryStore(), []  # type: list[str]
    peer = _intents(store, Clock(T0), rolled)
    mine = await peer.begin("demo", thing="in flight at a live replica")
    here = _intents(store, Clock(T0 + dt.timedelta(seconds=5)), rolled)
    alive, holding = {peer.owner}, [False]
    here.share_with(lambda owner: holding[0] and owner not in alive)
    assert await here.recover() == 0, "a live replica's change is its own"
    holding[0] = True
    assert await here.recover() == 0, "also for the lease holder"
    alive.clear()  # the peer died
    here.mark_changed()
    assert await here.recover_if_due() == 1
    assert rolled == [mine.intent_id]


async def test_a_held_change_committed_by_another_replica_stops_the_listings() -> None:
    store, rolled = MemoryStore(), []  # type: list[str]
    listings = [0]
    list_pages = store.list_pages

    def counting(prefix: str = "", **kw: object):  # type: ignore[no-untyped-def]
        listings[0] += prefix.startswith("cp/intents/")
        return list_pages(prefix, **kw)  # type: ignore[arg-type]

    store.list_pages = counting  # type: ignore[method-assign]
    ticks = [0.0]
    here = _intents(store, Clock(T0), rolled, verdict=False, ticks=ticks)
    async with here.change("demo", hold=True, thing="a join") as held:
        pass
    # The machine linked to another replica, which confirmed (committed) it.
    await _intents(store, Clock(T0), rolled).commit_id(held.intent_id)
    ticks[0] = WAIT_RECHECK
    await here.recover_if_due(every=3600)  # due: listed once, found gone
    for _ in range(3):
        ticks[0] += 1
        await here.recover_if_due(every=3600)
    assert listings[0] == 1, "before: listed again at every tick"
    assert rolled == []
