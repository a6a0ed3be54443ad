"""PromptQueue over MemoryStore: sealing, order, limits, idempotency, expiry, visibility."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Sequence

import pytest

from controlplane.access.accounts import AccountService
from controlplane.access.principals import Principal
from controlplane.access.tokens import TokenService
from controlplane.integrity.audit import Auditor
from controlplane.integrity.records import roster_key
from controlplane.machines.fleet import FleetView
from controlplane.machines.links import Ack
from controlplane.machines.pairing import Pairing
from controlplane.machines.presence import DeliveryNotice, PresenceRegistry, Session
from controlplane.machines.registry import MachineInfo, MachineRegistry
from controlplane.machines.rosters import AgentRosters
from controlplane.queue.acks import AckBatcher
from controlplane.queue.delivery import PromptDelivery
from controlplane.queue.idempotency import acked_prefix
from controlplane.queue.prompts import PromptQueue, QueueLimits, queue_prefix
from shared import tls
from shared.crypto import BoxKeyPair, open_bytes, prompt_aad
from shared.errors import (
    InvalidArgument,
    InvalidState,
    NotFound,
    QuotaExceeded,
    StoreUnavailable,
    TooLarge,
)
from shared.ids import new_id
from shared.store import MemoryStore
from tests.helpers.clock import FixedClock
from tests.helpers.poll import apoll_until


class World:
    def __init__(self) -> None:
        self.store = MemoryStore()
        self.clock = FixedClock()
        audit = Auditor(self.store, self.clock)
        self.accounts = AccountService(self.store, audit, self.clock)
        self.tokens = TokenService(self.store, self.accounts, audit, clock=self.clock)
        self.machines = MachineRegistry(self.store, self.accounts, audit, self.clock)
        self.pairing = Pairing(
            self.tokens, self.machines, self.accounts, tls.make_ca(), dt.timedelta(days=30)
        )
        self.op = Principal("adm_" + "0" * 26, "operator")
        self.outcomes: list[str] = []
        self.rosters = AgentRosters(self.store, clock=self.clock)
        self.queue = self.new_queue()

    def new_queue(self) -> PromptQueue:
        """A queue on the same store: what a restarted control plane has."""
        return PromptQueue(
            self.store,
            self.machines,
            Auditor(self.store, self.clock),
            limits=QueueLimits(max_depth=3, max_prompt_bytes=100, ttl=dt.timedelta(days=7)),
            clock=self.clock,
            on_outcome=self.outcomes.append,
            rosters=self.rosters,
        )

    async def machine(self, gh: int) -> tuple[str, str, BoxKeyPair]:
        acct = (await self.accounts.create(gh, f"u{gh}", None, "t")).account.account_id
        made = await self.tokens.create(self.op, acct)
        box = BoxKeyPair.generate()
        res = await self.pairing.join(
            made.value,
            tls.build_csr(tls.new_tls_key()).decode(),
            MachineInfo("m", "0.1", "h", box_public_key=box.public_key),
        )
        return acct, res.machine.machine_id, box


@pytest.fixture
def w() -> World:
    return World()


async def test_send_seals_queues_in_order_and_ack_deletes(w: World) -> None:
    acct, m, box = await w.machine(1)
    agent = new_id("agent")
    ids = [(await w.queue.send(w.op, m, agent, f"secret prompt {i}")).prompt_id for i in range(3)]
    listed = await w.queue.queued(w.op, m)
    assert [e.prompt_id for e in listed] == ids
    seqs = [e.seq for e in listed]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    # Only the machine can read the text; it is bound to the prompt id and agent.
    first = listed[0]
    assert open_bytes(first.sealed_prompt, box, aad=prompt_aad(first.prompt_id, agent)) == (
        b"secret prompt 0"
    )
    raw = b"".join([await w.store.get(i.key) async for i in w.store.list("")])
    assert b"secret prompt" not in raw
    await w.queue.acknowledged(first)
    await w.queue.acknowledged(first)  # idempotent
    assert [e.prompt_id for e in await w.queue.pending(acct, m)] == ids[1:]
    assert w.outcomes.count("queued") == 3
    # Drained empty, the next send still takes a larger number (keys never reused).
    for e in await w.queue.pending(acct, m):
        await w.queue.acknowledged(e)
    w.clock.now += dt.timedelta(seconds=1)
    await w.queue.send(w.op, m, agent, "later")
    (later,) = await w.queue.queued(w.op, m)
    assert later.seq > listed[-1].seq


async def test_limits_and_bad_input_queue_nothing(w: World) -> None:
    acct, m, _ = await w.machine(1)
    other_acct, other_m, _ = await w.machine(2)
    agent = new_id("agent")
    tenant = Principal("adm_" + "1" * 26, "account", acct)
    with pytest.raises(TooLarge, match="text"):
        await w.queue.send(w.op, m, agent, "x" * 101)
    with pytest.raises(NotFound, match="machine"):
        await w.queue.send(w.op, new_id("machine"), agent, "hi")
    with pytest.raises(NotFound, match=other_m):
        await w.queue.send(tenant, other_m, agent, "hi")
    with pytest.raises(InvalidArgument, match="agent_id"):
        await w.queue.send(w.op, m, "nope", "hi")
    for text in ("", " \n", "a\0b"):
        with pytest.raises(InvalidArgument, match="text"):
            await w.queue.send(w.op, m, agent, text)
    assert await w.queue.queued(w.op, m) == []
    assert await w.queue.queued(w.op, other_m) == []
    for i in range(3):
        await w.queue.send(tenant, m, agent, f"p{i}")
    with pytest.raises(QuotaExceeded, match="limit of 3"):
        await w.queue.send(tenant, m, agent, "one too many")
    assert len(await w.queue.queued(w.op, m)) == 3
    assert other_acct != acct


class LostAnswer(MemoryStore):
    """The first queue entry's put lands, and its answer is lost (a 503 after the write)."""

    lose = True

    async def put(self, key, data, *, if_none_match=False, if_match=None):  # type: ignore[no-untyped-def]
        etag = await super().put(key, data, if_none_match=if_none_match, if_match=if_match)
        if "/queue/" in key and self.lose:
            self.lose = False
            raise StoreUnavailable(f"put {key}: answer lost")
        return etag


async def test_a_keyed_send_whose_answer_was_lost_queues_once(w: World) -> None:
    """Before: the retry checked the in-memory view the failed put never refreshed,
    queued a second copy under a new prompt id, and both ran."""
    acct, m, _box = await w.machine(1)
    store = LostAnswer()
    for key in [i.key async for i in w.store.list("")]:
        await store.put(key, await w.store.get(key))
    w.store = store
    w.machines = MachineRegistry(store, w.accounts, Auditor(store, w.clock), w.clock)
    w.queue = w.new_queue()
    agent = new_id("agent")
    with pytest.raises(StoreUnavailable):
        await w.queue.send(w.op, m, agent, "hello", idempotency_key="k-lost")
    again = await w.queue.send(w.op, m, agent, "hello", idempotency_key="k-lost")
    listed = await w.queue.queued(w.op, m)
    assert [e.prompt_id for e in listed] == [again.prompt_id]
    assert again.state == "queued"


async def test_idempotency_key_never_queues_twice(w: World) -> None:
    _, m, _ = await w.machine(1)
    agent = new_id("agent")
    first = await w.queue.send(w.op, m, agent, "hello", idempotency_key="k-1")
    again = await w.queue.send(w.op, m, agent, "hello", idempotency_key="k-1")
    assert again.prompt_id == first.prompt_id and again.entry is None
    other = await w.queue.send(w.op, m, agent, "hello", idempotency_key="k-2")
    assert other.prompt_id != first.prompt_id
    assert len(await w.queue.queued(w.op, m)) == 2
    raw = b"".join([await w.store.get(i.key) async for i in w.store.list("")])
    assert b"k-1" not in raw


async def test_a_key_retried_after_the_ack_answers_the_first_prompt(w: World) -> None:
    acct, m, _ = await w.machine(1)
    agent = new_id("agent")
    presence = PresenceRegistry(w.store, clock=w.clock)
    delivery = PromptDelivery(w.queue, presence, ack_wait=10, clock=w.clock)
    record = await w.machines.load_any(acct, m)
    assert record is not None
    session = await presence.open(record, "0.1", 1)
    delivery.connected(session)
    answers = iter([Ack(run_id="run_" + "1" * 26), Ack(refused="agent is archived")])

    async def the_machine() -> None:
        while True:
            notice = await session.next_outgoing()
            assert isinstance(notice, DeliveryNotice)
            answer = next(answers)
            ack = Ack(notice.prompt_id, answer.run_id, answer.refused)
            await delivery.acked(session, ack)

    machine = asyncio.create_task(the_machine())
    try:
        first = await delivery.send(w.op, m, agent, "hello", "k-1")
        assert (first.state, first.run_id) == ("acknowledged", "run_" + "1" * 26)
        refused = await delivery.send(w.op, m, agent, "hello", "k-2")
        assert (refused.state, refused.reason) == ("refused", "agent is archived")
        assert await w.queue.queued(w.op, m) == []
        # The replies were lost; the client sends again with the same keys: the
        # first prompts' answers, nothing queued or delivered again (it would run twice).
        assert await delivery.send(w.op, m, agent, "hello", "k-1") == first
        assert await delivery.send(w.op, m, agent, "hello", "k-2") == refused
        assert await w.queue.queued(w.op, m) == []
        assert session.outbox.empty()
        assert w.outcomes.count("replayed") == 2
    finally:
        machine.cancel()
        await delivery.close()

    # A restarted control plane (nothing in memory), the machine offline: the same.
    restarted = PromptDelivery(w.new_queue(), PresenceRegistry(w.store), clock=w.clock)
    assert await restarted.send(w.op, m, agent, "hello", "k-1") == first
    assert await restarted.send(w.op, m, agent, "hello", "k-2") == refused
    assert await w.queue.queued(w.op, m) == []
    # The record holds no text, and the key only hashed.
    records = [await w.store.get(i.key) async for i in w.store.list(acked_prefix(acct, m))]
    assert len(records) == 2 and not [r for r in records if b"hello" in r or b"k-1" in r]

    # Past its time to live the key is forgotten (a new prompt), and its records go.
    w.clock.now += dt.timedelta(days=7, seconds=1)
    later = await restarted.send(w.op, m, agent, "hello", "k-1")
    assert later.prompt_id != first.prompt_id and later.state == "queued"
    assert [e.prompt_id for e in await w.queue.queued(w.op, m)] == [later.prompt_id]
    assert [i.key async for i in w.store.list(acked_prefix(acct, m))] == []


async def test_an_ack_that_stops_before_its_delete_keeps_one_answer(w: World) -> None:
    acct, m, _ = await w.machine(1)
    agent = new_id("agent")
    sent = await w.queue.send(w.op, m, agent, "hello", idempotency_key="k-1")
    assert sent.entry is not None
    real_delete = w.store.delete

    async def down(key: str) -> None:
        raise StoreUnavailable("delete: the store is down")

    # The record is written, the entry's delete (the commit point) fails: the
    # state a crash between the two leaves.
    w.store.delete = down  # type: ignore[method-assign]
    with pytest.raises(StoreUnavailable):
        await AckBatcher(w.queue).add(sent.entry, run_id="run_" + "1" * 26)
    w.store.delete = real_delete  # type: ignore[method-assign]
    restarted = w.new_queue()
    for queue in (w.queue, restarted):
        again = await queue.send(w.op, m, agent, "hello", idempotency_key="k-1")
        assert (again.prompt_id, again.entry) == (sent.prompt_id, None)
    # Still queued, so delivered again; its second ack completes the first.
    [entry] = await restarted.pending(acct, m)
    assert entry.prompt_id == sent.prompt_id
    await restarted.acknowledged(entry, run_id="run_" + "1" * 26)
    again = await restarted.send(w.op, m, agent, "hello", idempotency_key="k-1")
    assert (again.prompt_id, again.state, again.run_id) == (
        sent.prompt_id,
        "acknowledged",
        "run_" + "1" * 26,
    )
    assert await restarted.queued(w.op, m) == []


async def test_an_ack_whose_record_fails_deletes_nothing(w: World) -> None:
    acct, m, _ = await w.machine(1)
    sent = await w.queue.send(w.op, m, new_id("agent"), "hello", idempotency_key="k-1")
    assert sent.entry is not None
    real_put = w.store.put

    async def full(key: str, *args: object, **kwargs: object) -> None:
        if key.startswith(acked_prefix(acct, m)):
            raise StoreUnavailable("put: the store is down")
        await real_put(key, *args, **kwargs)  # type: ignore[arg-type]

    w.store.put = full  # type: ignore[method-assign,assignment]
    with pytest.raises(StoreUnavailable):
        await w.queue.acknowledged(sent.entry, run_id="run_" + "1" * 26)
    assert [e.prompt_id for e in await w.queue.queued(w.op, m)] == [sent.prompt_id]
    again = await w.queue.send(w.op, m, new_id("agent"), "hello", idempotency_key="k-1")
    assert again.prompt_id == sent.prompt_id


async def test_a_key_is_the_accounts_own_after_the_ack_too(w: World) -> None:
    acct_a, m_a, _ = await w.machine(1)
    acct_b, m_b, _ = await w.machine(2)
    tenant_a = Principal("adm_" + "1" * 26, "account", acct_a)
    tenant_b = Principal("adm_" + "2" * 26, "account", acct_b)
    agent = new_id("agent")
    theirs = await w.queue.send(tenant_a, m_a, agent, "hi", idempotency_key="same")
    assert theirs.entry is not None
    await w.queue.acknowledged(theirs.entry, run_id="run_" + "1" * 26)
    # The same key from another account names its own prompt, never theirs...
    mine = await w.queue.send(tenant_b, m_b, agent, "hi", idempotency_key="same")
    assert mine.prompt_id != theirs.prompt_id and mine.state == "queued"
    # ...and their machine is not there for it at all.
    with pytest.raises(NotFound, match=m_a):
        await w.queue.send(tenant_b, m_a, agent, "hi", idempotency_key="same")
    assert await w.queue.queued(w.op, m_a) == []


async def test_expired_prompts_are_dropped_with_audit(w: World) -> None:
    acct, m, _ = await w.machine(1)
    await w.queue.send(w.op, m, new_id("agent"), "old")
    w.clock.now += dt.timedelta(days=7, seconds=1)
    fresh = await w.queue.send(w.op, m, new_id("agent"), "new")
    assert [e.prompt_id for e in await w.queue.queued(w.op, m)] == [fresh.prompt_id]
    assert "expired" in w.outcomes
    keys = [i.key async for i in w.store.list(queue_prefix(acct, m))]
    assert len(keys) == 1
    audits = [await w.store.get(i.key) async for i in w.store.list("audit/")]
    assert any(b"prompt.expire" in a for a in audits)


async def test_a_clock_that_disagrees_with_the_store_expires_nothing(w: World) -> None:
    """Our clock 8 days ahead of the store's: the queue keeps the prompt, its
    idempotency key answers with the same prompt, and an acknowledged key stays
    known; once the clocks agree again, expiry runs as before."""
    agrees = [False]
    queue = PromptQueue(
        w.store,
        w.machines,
        Auditor(w.store, w.clock),
        limits=QueueLimits(max_depth=3, max_prompt_bytes=100, ttl=dt.timedelta(days=7)),
        clock=w.clock,
        on_outcome=w.outcomes.append,
        rosters=w.rosters,
        may_expire=lambda: agrees[0],
    )
    acct, m, _ = await w.machine(1)
    agent = new_id("agent")
    kept = await queue.send(w.op, m, agent, "queued", idempotency_key="k-kept")
    done = await queue.send(w.op, m, agent, "acked", idempotency_key="k-done")
    await queue.acknowledged((await queue.queued(w.op, m))[1])
    w.clock.now += dt.timedelta(days=8)
    assert [e.prompt_id for e in await queue.queued(w.op, m)] == [kept.prompt_id]
    again = await queue.send(w.op, m, agent, "queued", idempotency_key="k-kept")
    assert again.prompt_id == kept.prompt_id
    replayed = await queue.send(w.op, m, agent, "acked", idempotency_key="k-done")
    assert replayed.prompt_id == done.prompt_id
    assert "expired" not in w.outcomes
    assert [i.key async for i in w.store.list(acked_prefix(acct, m))]
    # The clocks agree again: the week-old prompt and key go.
    agrees[0] = True
    assert await queue.queued(w.op, m) == []
    assert "expired" in w.outcomes
    assert [i.key async for i in w.store.list(acked_prefix(acct, m))] == []


async def test_sequence_claim_skips_a_taken_number(w: World) -> None:
    acct, m, _ = await w.machine(1)
    agent = new_id("agent")
    await w.queue.send(w.op, m, agent, "a")
    (first,) = await w.queue.queued(w.op, m)
    # A concurrent sender already claimed the next number (simulated by writing it).
    taken = first.seq + 1
    await w.store.put(queue_prefix(acct, m) + f"{taken:020d}.sealed", b"{}", if_none_match=True)
    second = await w.queue.send(w.op, m, agent, "b")
    keys = [i.key async for i in w.store.list(queue_prefix(acct, m))]
    assert keys[-1].endswith(f"{taken + 1:020d}.sealed")
    assert second.prompt_id in [e.prompt_id for e in await w.queue.queued(w.op, m)]


async def test_offline_count_skips_connected_and_revoked_machines(w: World) -> None:
    _, online, _ = await w.machine(1)
    _, offline, _ = await w.machine(2)
    _, revoked, _ = await w.machine(3)
    presence = PresenceRegistry(w.store, clock=w.clock)
    fleet = FleetView(w.machines)
    assert presence.count_offline(await fleet.machines()) == 3
    await presence.open(await w.machines.get(w.op, online), "1", 0)
    await w.machines.revoke(w.op, revoked)
    assert presence.count_offline(await fleet.machines()) == 1
    assert offline


async def test_the_fleet_is_listed_again_only_when_it_changed(w: World) -> None:
    """The periodic checks' view of every machine: one listing while nothing
    changes; again after a revocation, a change it is told of, or an hour. A
    join adds its machine without a listing."""
    now = [0.0]
    fleet = FleetView(w.machines, refresh=3600, monotonic=lambda: now[0])
    _, first, _ = await w.machine(1)
    assert [m.machine_id for m in await fleet.machines()] == [first]
    for _ in range(5):
        await fleet.machines()
    assert fleet.listings == 1
    _, second, _ = await w.machine(2)  # a join
    assert {m.machine_id for m in await fleet.machines()} == {first, second}
    assert fleet.listings == 1
    await w.machines.revoke(w.op, second)
    assert [m.revoked for m in await fleet.machines() if m.machine_id == second] == [True]
    assert fleet.listings == 2
    fleet.changed()  # e.g. an account deletion finished
    await fleet.machines()
    assert fleet.listings == 3
    now[0] = 3599.0
    await fleet.machines()
    assert fleet.listings == 3
    now[0] = 3600.0
    await fleet.machines()
    assert fleet.listings == 4


async def test_an_offline_machines_presence_is_read_once(w: World) -> None:
    """The status of an offline machine comes from what this process wrote or
    last read: a wake check every 30 s costs no GET per machine."""
    _, m, _ = await w.machine(1)
    machine = await w.machines.get(w.op, m)
    writer = PresenceRegistry(w.store, clock=w.clock)
    session = await writer.open(machine, "1", 2)
    writer.fire_reported(session, w.clock() + dt.timedelta(hours=1))
    await writer.seen(session)
    await writer.close(session)
    # What this process wrote answers without a read...
    assert (await writer.status(machine)).next_fire_at == w.clock() + dt.timedelta(hours=1)
    # ...and a new process reads it once.
    gets: list[str] = []
    store_get = w.store.get

    async def counting_get(key: str) -> bytes:
        gets.append(key)
        return await store_get(key)

    w.store.get = counting_get  # type: ignore[method-assign]
    reader = PresenceRegistry(w.store, clock=w.clock)
    for _ in range(3):
        status = await reader.status(machine)
    assert status.agent_count == 2 and status.next_fire_at is not None
    assert len([k for k in gets if "/presence/" in k]) == 1
    # A machine with no presence at all (joined, never connected): read once too.
    _, never, _ = await w.machine(2)
    silent = await w.machines.get(w.op, never)
    for _ in range(3):
        assert (await reader.status(silent)).last_seen_at is None
    assert len([k for k in gets if "/presence/" in k]) == 2


async def test_an_offline_machines_roster_refuses_unknown_and_archived_agents(w: World) -> None:
    acct, m, _box = await w.machine(1)
    active, archived, unknown = new_id("agent"), new_id("agent"), new_id("agent")
    # Never reported (an older machine): every agent is queued, as before.
    await w.queue.send(w.op, m, unknown, "queued without a roster", check_roster=True)
    await w.rosters.report(acct, m, (active,), (archived,))
    with pytest.raises(NotFound, match=f"agent {unknown}"):
        await w.queue.send(w.op, m, unknown, "hi", check_roster=True)
    with pytest.raises(InvalidState, match=f"agent {archived}: archived on machine {m}"):
        await w.queue.send(w.op, m, archived, "hi", check_roster=True)
    assert len(await w.queue.queued(w.op, m)) == 1  # nothing more queued
    assert w.outcomes.count("refused_agent") == 2
    await w.queue.send(w.op, m, active, "for the active one", check_roster=True)
    # An online machine answers itself (the roster may be a heartbeat old).
    await w.queue.send(w.op, m, unknown, "delivered, the machine decides")

    # The roster is read back from the store by a new process; ids only.
    stored = (await w.store.get(roster_key(acct, m))).decode()
    assert active in stored and archived in stored
    fresh = AgentRosters(w.store)
    with pytest.raises(NotFound):
        await fresh.check(acct, m, unknown)
    await fresh.check(acct, m, active)

    # Unarchived: the whole roster replaces the old one; a same roster writes nothing.
    await w.rosters.report(acct, m, (active, archived), ())
    await w.rosters.check(acct, m, archived)
    before = (await w.store.head(roster_key(acct, m))).etag
    await w.rosters.report(acct, m, (archived, active), ())
    assert (await w.store.head(roster_key(acct, m))).etag == before
    # A malformed id: the report is ignored and the stored roster stays.
    await w.rosters.report(acct, m, ("../../etc",), ())
    await AgentRosters(w.store).check(acct, m, archived)


async def test_acks_arriving_together_are_deleted_in_one_batch(w: World) -> None:
    acct, m, _box = await w.machine(1)
    w.queue._limits = QueueLimits(max_depth=50)
    agent = new_id("agent")
    for i in range(10):
        await w.queue.send(w.op, m, agent, f"p{i}")
    entries = await w.queue.queued(w.op, m)
    calls: list[int] = []
    real = w.store.delete_many

    async def counted(keys: Sequence[str]) -> None:
        calls.append(len(keys))
        await real(keys)

    started, release = asyncio.Event(), asyncio.Event()
    real_one = w.store.delete

    async def held(key: str) -> None:
        started.set()
        await release.wait()  # the first delete stays in flight while the rest arrive
        await real_one(key)

    w.store.delete_many = counted  # type: ignore[method-assign]
    w.store.delete = held  # type: ignore[method-assign]
    acks = AckBatcher(w.queue)
    done = [asyncio.ensure_future(acks.add(e)) for e in entries[:1]]
    await asyncio.wait_for(started.wait(), 5)  # the first is on its way (alone: one DELETE)...
    done += [asyncio.ensure_future(acks.add(e)) for e in entries[1:]]  # ...the rest arrive
    release.set()
    await asyncio.gather(*done)
    assert calls == [9]  # one DeleteObjects for the nine that waited
    assert await w.queue.queued(w.op, m) == []
    assert w.outcomes.count("acknowledged") == 10


async def test_a_failed_ack_delete_leaves_the_entry_queued(w: World) -> None:
    acct, m, _box = await w.machine(1)
    await w.queue.send(w.op, m, new_id("agent"), "kept")
    [entry] = await w.queue.queued(w.op, m)

    async def down(key: str) -> None:
        raise StoreUnavailable("delete: the store is down")

    w.store.delete = down  # type: ignore[method-assign]
    with pytest.raises(StoreUnavailable):
        await AckBatcher(w.queue).add(entry)
    assert [e.prompt_id for e in await w.queue.queued(w.op, m)] == [entry.prompt_id]


async def _connected(w: World, acct: str, m: str) -> tuple[PromptDelivery, Session]:
    presence = PresenceRegistry(w.store, clock=w.clock)
    delivery = PromptDelivery(w.queue, presence, clock=w.clock, redrain_first=0.01)
    record = await w.machines.load_any(acct, m)
    assert record is not None
    return delivery, await presence.open(record, "0.1", 1)


async def test_a_drain_the_store_failed_is_drained_again_while_the_link_is_up(
    w: World,
) -> None:
    """Before: the failed drain was logged and nothing drained again until the next
    connect or send, so a connected machine's queue waited behind one lost answer."""
    acct, m, _box = await w.machine(1)
    sent = await w.queue.send(w.op, m, new_id("agent"), "queued while offline")
    real_get = w.store.get
    failures = 2

    async def flaky_get(key: str) -> bytes:
        nonlocal failures
        if "/queue/" in key and failures:
            failures -= 1
            raise StoreUnavailable(f"get {key}: server answered SlowDown")
        return await real_get(key)

    w.store.get = flaky_get  # type: ignore[method-assign]
    delivery, session = await _connected(w, acct, m)
    try:
        delivery.connected(session)
        notice = await asyncio.wait_for(session.next_outgoing(), 5)
        assert isinstance(notice, DeliveryNotice) and notice.prompt_id == sent.prompt_id
        assert failures == 0
    finally:
        await delivery.close()


async def test_an_acknowledged_entry_whose_delete_failed_is_delivered_and_deleted_again(
    w: World,
) -> None:
    """Before: the entry stayed queued until the machine connected again."""
    acct, m, _box = await w.machine(1)
    sent = await w.queue.send(w.op, m, new_id("agent"), "queued while offline")
    real_delete = w.store.delete
    failures = 1

    async def lost_delete(key: str) -> None:
        nonlocal failures
        if failures:
            failures -= 1
            raise StoreUnavailable(f"delete {key}: server answered SlowDown")
        await real_delete(key)

    w.store.delete = lost_delete  # type: ignore[method-assign]
    delivery, session = await _connected(w, acct, m)
    delivered: list[str] = []

    async def the_machine() -> None:
        while True:
            notice = await session.next_outgoing()
            assert isinstance(notice, DeliveryNotice)
            delivered.append(notice.prompt_id)
            await delivery.acked(session, Ack(notice.prompt_id, "run_" + "1" * 26))

    async def gone() -> bool:
        return not [i async for i in w.store.list(queue_prefix(acct, m))]

    machine = asyncio.create_task(the_machine())
    try:
        delivery.connected(session)
        await apoll_until(gone, deadline=5, what="the acknowledged entry deleted")
        # Delivered again after the failed delete; the machine answers the same run.
        assert delivered == [sent.prompt_id, sent.prompt_id]
        assert failures == 0
    finally:
        machine.cancel()
        await delivery.close()


async def test_a_failed_record_keeps_only_its_own_entry_of_a_batch_queued(w: World) -> None:
    """Before: one failed record failed the whole batch, every entry stayed queued and
    was delivered again (under a flaky store, a drain of a hundred again and again)."""
    acct, m, _box = await w.machine(1)
    w.queue._limits = QueueLimits(max_depth=50)
    agent = new_id("agent")
    for i in range(3):
        await w.queue.send(w.op, m, agent, f"p{i}", idempotency_key=f"k{i}")
    entries = await w.queue.queued(w.op, m)
    real_put = w.store.put
    lost = {entries[1].seq}

    async def flaky(key: str, *args: object, **kwargs: object) -> str:
        if key.startswith(acked_prefix(acct, m)) and any(f"{s:020d}" in key for s in lost):
            raise StoreUnavailable(f"put {key}: server answered SlowDown")
        return await real_put(key, *args, **kwargs)  # type: ignore[arg-type]

    w.store.put = flaky  # type: ignore[method-assign,assignment]
    acks = AckBatcher(w.queue)
    done = [acks.add(e, run_id="run_" + str(i) * 26) for i, e in enumerate(entries)]
    outcomes = await asyncio.gather(*done, return_exceptions=True)
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], StoreUnavailable)
    assert [e.prompt_id for e in await w.queue.queued(w.op, m)] == [entries[1].prompt_id]
    assert w.outcomes.count("acknowledged") == 2
