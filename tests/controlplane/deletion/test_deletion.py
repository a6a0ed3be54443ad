"""Account deletion on the in-memory store: what goes, what stays, crashes at every step."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Awaitable, Callable, Sequence

import pytest

from controlplane.access.accounts import AccountService
from controlplane.access.authz import CredentialService
from controlplane.access.principals import Principal
from controlplane.access.tokens import TokenService
from controlplane.deletion.service import AccountDeletion, DeletionHooks, _together
from controlplane.deletion.sweep import AccountSweep
from controlplane.integrity import jsonstore
from controlplane.integrity.audit import Auditor
from controlplane.integrity.intents import INTENTS_PREFIX, Intents
from controlplane.integrity.records import deleted_key, deleting_key
from controlplane.machines.backups import backups_prefix
from controlplane.machines.pairing import Pairing
from controlplane.machines.registry import MachineInfo, MachineRegistry
from shared import tls
from shared.backup_target import names_key, segment_key
from shared.errors import InvalidState, NotFound, PermissionDenied, StoreError, Unauthenticated
from shared.ids import new_id
from shared.store import MemoryStore, ObjectStore
from shared.store.authenticated import seal
from shared.store.base import delete_keys
from shared.store.wrappers import StoreWrapper

OP = Principal("adm_" + "0" * 26, "operator")


class Clock:
    def __init__(self) -> None:
        self.now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

    def __call__(self) -> dt.datetime:
        return self.now


class Crash(BaseException):
    """The process dies (nothing after it runs, no roll-back either)."""


class PassThrough(StoreWrapper):
    """Every call straight to ``inner``; the wrappers below change one or two."""

    async def get(self, key: str) -> bytes:
        return await self.inner.get(key)

    def get_stream(self, key, chunk_size=1024):  # type: ignore[no-untyped-def]
        return self.inner.get_stream(key, chunk_size)

    async def head(self, key: str):  # type: ignore[no-untyped-def]
        return await self.inner.head(key)

    async def put(self, key, data, *, if_none_match=False, if_match=None):  # type: ignore[no-untyped-def]
        return await self.inner.put(key, data, if_none_match=if_none_match, if_match=if_match)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def delete_many(self, keys: Sequence[str]) -> None:
        await delete_keys(self.inner, keys)

    def list_pages(self, prefix="", *, start_after=None, page_size=1000):  # type: ignore[no-untyped-def]
        return self.inner.list_pages(prefix, start_after=start_after, page_size=page_size)


class CrashingStore(PassThrough):
    """Dies at the ``after``-th write or delete (a batch counts once): before it
    reaches the store, or with ``landed`` right after the store took it."""

    def __init__(self, inner: ObjectStore, after: int, *, landed: bool = False) -> None:
        super().__init__(inner)
        self.left = after
        self.landed = landed

    def _tick(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise Crash

    async def _write(self, write: Callable[[], Awaitable[object]]) -> object:
        if not self.landed:
            self._tick()
        result = await write()
        if self.landed:
            self._tick()
        return result

    async def put(self, key, data, *, if_none_match=False, if_match=None):  # type: ignore[no-untyped-def]
        return await self._write(
            lambda: self.inner.put(key, data, if_none_match=if_none_match, if_match=if_match)
        )

    async def delete(self, key: str) -> None:
        await self._write(lambda: self.inner.delete(key))

    async def delete_many(self, keys: Sequence[str]) -> None:
        await self._write(lambda: delete_keys(self.inner, keys))


class FailingBatch(PassThrough):
    """A permanent fault on the ``nth`` batch delete, once."""

    def __init__(self, inner: ObjectStore, nth: int) -> None:
        super().__init__(inner)
        self.left = nth

    async def delete_many(self, keys: Sequence[str]) -> None:
        self.left -= 1
        if self.left == 0:
            raise StoreError("delete: server answered AccessDenied")
        # The others are slower: the failed one ends while they are in flight.
        await asyncio.sleep(0.01)
        await delete_keys(self.inner, keys)


class Process:
    """One control plane's domain objects over a (shared) store."""

    def __init__(self, store: ObjectStore, clock: Clock, page_size: int = 7) -> None:
        self.store = store
        audit = Auditor(store, clock)
        self.intents = Intents(store, clock)
        self.accounts = AccountService(store, audit, clock, intents=self.intents)
        self.creds = CredentialService(store, self.accounts, audit, clock)
        self.tokens = TokenService(store, self.accounts, audit, clock=clock, intents=self.intents)
        self.machines = MachineRegistry(store, self.accounts, audit, clock, intents=self.intents)
        self.pairing = Pairing(
            self.tokens,
            self.machines,
            self.accounts,
            CA,
            dt.timedelta(days=30),
            intents=self.intents,
            store=store,
        )
        self.deletion = AccountDeletion(
            store,
            self.accounts,
            audit,
            self.intents,
            clock=clock,
            page_size=page_size,
            backups=store,
        )


CA = tls.make_ca()


async def _populate(p: Process, gh: int, machines: int = 3, extra: int = 20) -> str:
    acct = (await p.accounts.create(gh, f"u{gh}", None, "test")).account.account_id
    for _ in range(machines):
        made = await p.tokens.create(OP, acct)
        res = await p.pairing.join(
            made.value, tls.build_csr(tls.new_tls_key()).decode(), MachineInfo("m", "0.1", "h")
        )
        await p.machines.confirm(res.machine)
    await p.creds.create_for_account(OP, acct, "admin")
    for i in range(extra):
        await p.store.put(f"accounts/{acct}/presence/x{i:03d}.json", b"{}")
    return acct


def _finish_held(p: Process) -> asyncio.Event:
    """Run ``p``'s deletions in the background, each finishing only once the
    returned event is set (the tombstone is written, the rest waits)."""
    p.deletion.run_in_background(DeletionHooks())
    gate = asyncio.Event()
    real = p.deletion.finish

    async def held_finish(account_id: str) -> None:
        await gate.wait()
        await real(account_id)

    p.deletion.finish = held_finish  # type: ignore[method-assign]
    return gate


async def _keys(store: ObjectStore) -> list[str]:
    return [i.key async for i in store.list("")]


async def _points_to(store: ObjectStore, key: str, acct: str) -> bool:
    try:
        return acct.encode() in await store.get(key)
    except NotFound:
        return False


async def _leftovers(store: ObjectStore, acct: str) -> list[str]:
    """Every object of ``acct`` (under its prefix, or an index/credential naming it)."""
    out = []
    for key in await _keys(store):
        if key.startswith(f"accounts/{acct}/"):
            out.append(key)
        elif key.startswith(("index/", "credentials/")) and await _points_to(store, key, acct):
            out.append(key)
    return out


@pytest.fixture
def clock() -> Clock:
    return Clock()


class ListingSpy(PassThrough):
    """Records every key a listing hands out."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.listed: list[str] = []

    async def list_pages(self, prefix="", *, start_after=None, page_size=1000):  # type: ignore[no-untyped-def,override]
        async for page in self.inner.list_pages(
            prefix, start_after=start_after, page_size=page_size
        ):
            self.listed += [i.key for i in page]
            yield page


async def test_segments_the_backups_name_go_without_being_listed(clock: Clock) -> None:
    spy = ListingSpy(MemoryStore())
    p = Process(spy, clock)
    gone = await _populate(p, 1, extra=0)
    kept = await _populate(p, 2, extra=0)
    machines = [
        k.rsplit("/", 1)[-1].removesuffix(".json")
        for k in await _keys(spy)
        if k.startswith(f"accounts/{gone}/machines/")
    ]
    orphans = []
    for m, machine in enumerate(machines):
        root = backups_prefix(gone, machine)
        names = [f"{m:02x}{i:062x}" for i in range(40)]
        for name in names:
            await spy.put(root + segment_key(name), b"sealed")
        # Two backups sharing most segments; a list names junk too (skipped).
        await spy.put(root + names_key(new_id("backup")), json.dumps(names[:30]).encode())
        junk = [*names[10:], "../../index/x", "A" * 64, 7]
        await spy.put(root + names_key(new_id("backup")), json.dumps(junk).encode())
        await spy.put(root + names_key(new_id("backup")), b"not json")
        orphan = root + segment_key("f" * 64)  # named by no list: the listing finds it
        await spy.put(orphan, b"sealed")
        orphans.append(orphan)
    before_kept = await _leftovers(spy, kept)
    spy.listed.clear()

    done = await p.deletion.delete(OP, gone)

    assert done.state == "deleted"
    assert await _leftovers(spy, gone) == []
    assert await _leftovers(spy, kept) == before_kept
    listed_segments = sorted(k for k in spy.listed if "/segments/" in k)
    assert listed_segments == sorted(orphans), "only segments no list names are listed"
    assert done.deleted_objects >= 3 * 41


async def test_a_deleted_accounts_record_put_back_grants_nothing(clock: Clock) -> None:
    p = Process(MemoryStore(), clock)
    gone = await _populate(p, 1)
    saved = {k: await p.store.get(k) for k in await _keys(p.store) if f"/{gone}" in k}
    await p.deletion.delete(OP, gone)
    # A bucket writer puts every record of the account back (older genuine copies).
    for key, data in saved.items():
        await p.store.put(key, data)
    with pytest.raises(NotFound):
        await p.accounts.get(gone)
    with pytest.raises(PermissionDenied, match="account does not exist"):
        await p.accounts.require_active(gone, "join")
    assert gone not in await p.accounts.scope_ids(OP)


async def test_delete_removes_the_account_and_keeps_the_other(clock: Clock) -> None:
    p = Process(MemoryStore(), clock)
    gone = await _populate(p, 1)
    kept = await _populate(p, 2)
    before_kept = await _leftovers(p.store, kept)
    assert len(await _leftovers(p.store, gone)) > 30
    clock.now += dt.timedelta(minutes=1)

    done = await p.deletion.delete(OP, gone)

    assert done.state == "deleted" and done.deleted_by == OP.credential_id
    assert await _leftovers(p.store, gone) == []
    assert await _leftovers(p.store, kept) == before_kept
    assert not [k for k in await _keys(p.store) if k.startswith(INTENTS_PREFIX)]
    # Told apart from "never existed"; idempotent.
    got = await p.deletion.get(OP, gone)
    assert (got.state, got.finished_at, got.deleted_by) == ("deleted", clock.now, OP.credential_id)
    assert got.deleted_objects >= 20
    assert (await p.deletion.delete(OP, gone)) == got
    with pytest.raises(NotFound):
        await p.accounts.get(gone)
    never = "acct_" + "1" * 26
    with pytest.raises(NotFound):
        await p.deletion.get(OP, never)
    with pytest.raises(NotFound):
        await p.deletion.delete(OP, never)
    with pytest.raises(InvalidState, match="not being deleted"):
        await p.deletion.get(OP, kept)


async def test_another_accounts_id_answers_like_a_missing_one(clock: Clock) -> None:
    p = Process(MemoryStore(), clock)
    mine, other = await _populate(p, 1, 0, 0), await _populate(p, 2, 0, 0)
    admin = Principal("adm_" + "2" * 26, "account", mine)
    never = "acct_" + "1" * 26
    for call in (p.deletion.get, p.deletion.delete):
        with pytest.raises(NotFound) as theirs:
            await call(admin, other)
        with pytest.raises(NotFound) as missing:
            await call(admin, never)
        assert str(theirs.value).replace(other, "X") == str(missing.value).replace(never, "X")
    with pytest.raises(PermissionDenied, match="operator"):
        await p.deletion.delete(admin, mine)
    assert (await p.accounts.get(other)).state == "active"


async def test_joins_refused_while_deleting_and_after(clock: Clock) -> None:
    p = Process(MemoryStore(), clock)
    acct = await _populate(p, 1, 1, 0)
    token = (await p.tokens.create(OP, acct)).value
    gate = _finish_held(p)
    started = await p.deletion.delete(OP, acct)
    assert started.state == "deleting"
    assert (await p.accounts.get(acct)).state == "deleting"
    with pytest.raises(PermissionDenied, match="being deleted"):
        await p.tokens.check(token)
    with pytest.raises(PermissionDenied, match="being deleted"):
        await p.tokens.create(OP, acct)
    gate.set()
    await p.deletion.wait()
    with pytest.raises(Unauthenticated, match="unknown token"):
        await p.tokens.check(token)


class FinishingBetweenReads(PassThrough):
    """Runs ``finish`` (a deletion's last writes) right after the first read of
    either of the account's tombstones returns."""

    def __init__(self, inner: ObjectStore, acct: str) -> None:
        super().__init__(inner)
        self.keys = {deleted_key(acct), deleting_key(acct)}
        self.finish: Callable[[], Awaitable[None]] | None = None

    async def get(self, key: str) -> bytes:
        try:
            return await self.inner.get(key)
        finally:
            if key in self.keys and self.finish is not None:
                finish, self.finish = self.finish, None
                await finish()


async def test_a_deletion_finishing_between_the_tombstone_reads_is_never_active(
    clock: Clock,
) -> None:
    inner = MemoryStore()
    acct = await _populate(Process(inner, clock), 1, 0, 0)
    deleter = Process(inner, clock)
    gate = _finish_held(deleter)
    await deleter.deletion.delete(OP, acct)  # the tombstone is written; finishing waits

    async def finish_now() -> None:
        gate.set()
        await deleter.deletion.wait()

    racing = FinishingBetweenReads(inner, acct)
    racing.finish = finish_now
    reader = Process(racing, clock)
    try:
        state = (await reader.accounts.get(acct)).state
    except NotFound:
        state = "gone"
    assert racing.finish is None, "the deletion finished during the read"
    assert state in ("deleting", "gone")
    with pytest.raises(PermissionDenied):
        await reader.accounts.require_active(acct, "join")


async def test_background_run_closes_links_and_counts(clock: Clock) -> None:
    p = Process(MemoryStore(), clock)
    acct = await _populate(p, 1, 2, 30)
    closed: list[str] = []
    results: list[str] = []
    objects: list[int] = []

    def close_links(account_id: str) -> int:
        closed.append(account_id)
        return 2

    p.deletion.run_in_background(
        DeletionHooks(
            close_links=close_links,
            finished=results.append,
            objects=objects.append,
        )
    )
    await p.deletion.delete(OP, acct)
    await p.deletion.wait()
    assert closed == [acct] and results == ["ok"]
    got = await p.deletion.get(OP, acct)
    assert got.state == "deleted" and got.deleted_objects == sum(objects) >= 30


class RecordingProgress(CrashingStore):
    """Records, in order, every tombstone write (its count) and read, and every
    batch delete."""

    def __init__(self, inner: ObjectStore, tombstone: str) -> None:
        super().__init__(inner, 10**9)
        self.tombstone = tombstone
        self.events: list[tuple[str, int]] = []

    async def get(self, key: str) -> bytes:
        if key == self.tombstone:
            self.events.append(("read", 0))
        return await super().get(key)

    async def head(self, key: str):  # type: ignore[no-untyped-def]
        if key == self.tombstone:
            self.events.append(("read", 0))
        return await super().head(key)

    async def put(self, key, data, *, if_none_match=False, if_match=None):  # type: ignore[no-untyped-def]
        if key == self.tombstone:
            self.events.append(("save", int(jsonstore.decode(data, key)["deleted_objects"])))
        return await super().put(key, data, if_none_match=if_none_match, if_match=if_match)

    async def delete_many(self, keys: Sequence[str]) -> None:
        await super().delete_many(keys)
        self.events.append(("batch", len(keys)))


async def _prefix_objects(store: ObjectStore, acct: str) -> int:
    """What a deletion of ``acct`` counts: every object under its prefix but its record."""
    return len([k for k in await _keys(store) if k.startswith(f"accounts/{acct}/")]) - 1


async def test_each_listed_batch_is_counted_and_saved_before_its_delete(clock: Clock) -> None:
    """The count's commit point is one put of the tombstone per batch of the
    listing, before that batch's delete, with no read of the tombstone first."""
    store = MemoryStore()
    acct = await _populate(Process(store, clock), 1, 1, 90)
    total = await _prefix_objects(store, acct)
    recording = RecordingProgress(store, deleting_key(acct))
    p = Process(recording, clock)
    done = await p.deletion.delete(OP, acct)
    assert done.deleted_objects == total
    saves = [n for kind, n in recording.events if kind == "save"]
    # The tombstone's creation (count 0), then the saves, each of a larger count.
    assert saves[0] == 0 and saves[1:] == sorted(set(saves[1:])) and saves[-1] == total
    # Batches under the prefix: all but the index batch and the last two deletes
    # (account record, tombstone); one save each, before it.
    batches = [i for i, (kind, _) in enumerate(recording.events) if kind == "batch"][1:-2]
    assert len(batches) >= 10 and len(saves) == 1 + len(batches)
    for n, i in enumerate(batches, start=1):
        assert [kind for kind, _ in recording.events[:i]].count("save") > n
    # Read when the run starts, never again before a save (its etag is known).
    kinds = [kind for kind, _ in recording.events]
    first, last = batches[0], len(kinds) - 1 - kinds[::-1].index("save")
    assert "read" not in kinds[first:last]


#: Writes and deletes one whole deletion of _populate's account makes (page size 7:
#: six batches under the prefix, with the tokens' use markers, each counted by a save
#: of the tombstone before it).
WRITES = 20


@pytest.mark.parametrize("landed", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("crash_after", range(WRITES + 1))
async def test_a_crash_at_any_step_is_finished_by_the_next_process(
    clock: Clock, crash_after: int, landed: bool
) -> None:
    """Killed before (or right after) each write or delete of a deletion: the next
    process finishes it, and reports every object deleted (issue 34: only its own)."""
    store = MemoryStore()
    setup = Process(store, clock)
    acct = await _populate(setup, 1)
    kept = await _populate(setup, 2)
    before_kept = await _leftovers(store, kept)
    total = await _prefix_objects(store, acct)
    clock.now += dt.timedelta(minutes=1)

    dying = Process(CrashingStore(store, crash_after, landed=landed), clock)
    if crash_after < WRITES:
        with pytest.raises(Crash):
            await dying.deletion.delete(OP, acct)
    else:  # the last case dies nowhere: the range covers every step
        await dying.deletion.delete(OP, acct)
    left = await _keys(store)
    committed = deleting_key(acct) in left or deleted_key(acct) in left

    clock.now += dt.timedelta(minutes=1)
    after = Process(store, clock)
    await after.intents.recover()  # what serve does at start (and every tick)

    assert await _leftovers(store, kept) == before_kept
    assert not [k for k in await _keys(store) if k.startswith(INTENTS_PREFIX)]
    if committed:
        assert await _leftovers(store, acct) == []
        done = await after.deletion.get(OP, acct)
        assert (done.state, done.deleted_objects) == ("deleted", total)
        assert deleted_key(acct) in await _keys(store)
    else:
        # Nobody heard of it: rolled back, the account is whole and active.
        assert (await after.accounts.get(acct)).state == "active"
        assert len(await _leftovers(store, acct)) > 30


async def _with_backups(p: Process, acct: str, segments: int = 10) -> None:
    """Each of ``acct``'s machines gets ``segments`` segments named by one names list."""
    machines = [
        k.rsplit("/", 1)[-1].removesuffix(".json")
        for k in await _keys(p.store)
        if k.startswith(f"accounts/{acct}/machines/")
    ]
    for m, machine in enumerate(machines):
        root = backups_prefix(acct, machine)
        names = [f"{m:02x}{i:062x}" for i in range(segments)]
        for name in names:
            await p.store.put(root + segment_key(name), b"sealed")
        await p.store.put(root + names_key(new_id("backup")), json.dumps(names).encode())


async def test_a_crash_at_any_write_among_named_segments_is_finished_by_the_next_process(
    clock: Clock,
) -> None:
    """Killed after 0, 1, 2, ... writes or deletes, until a run gets through: every
    point of a deletion whose segments are named by names lists, resumed."""
    for crash_after in range(400):
        landed = bool(crash_after % 2)  # killed before the write, or right after it
        store = MemoryStore()
        setup = Process(store, clock)
        acct = await _populate(setup, 1, extra=0)
        await _with_backups(setup, acct)
        kept = await _populate(setup, 2, extra=0)
        await _with_backups(setup, kept)
        before_kept = await _leftovers(store, kept)
        total = await _prefix_objects(store, acct)
        dying = Process(CrashingStore(store, crash_after // 2, landed=landed), clock)
        try:
            await dying.deletion.delete(OP, acct)
            finished = True
        except Crash:
            finished = False
        clock.now += dt.timedelta(minutes=1)  # recovery takes intents of a past process
        after = Process(store, clock)
        await after.intents.recover()
        assert await _leftovers(store, kept) == before_kept
        if deleted_key(acct) in await _keys(store):
            assert await _leftovers(store, acct) == []
            assert (await after.deletion.get(OP, acct)).deleted_objects == total, crash_after
        else:
            assert (await after.accounts.get(acct)).state == "active"
        if finished and not landed:
            break
    else:
        pytest.fail("no deletion got through 200 writes")
    assert crash_after > 20, "the deletion's writes were all reached"


async def test_a_failed_batch_stops_the_run_and_the_next_one_finishes(clock: Clock) -> None:
    store = MemoryStore()
    setup = Process(store, clock)
    acct = await _populate(setup, 1, 1, 40)
    clock.now += dt.timedelta(minutes=1)
    # Batch 1 is the index entries; batch 2 the first of the prefix.
    p = Process(FailingBatch(store, 2), clock)
    results: list[str] = []
    p.deletion.run_in_background(DeletionHooks(finished=results.append))
    await p.deletion.delete(OP, acct)
    await p.deletion.wait()
    assert results == ["failed"]
    assert (await p.deletion.get(OP, acct)).state == "deleting"
    assert f"accounts/{acct}/account.json" in await _keys(store)
    await p.intents.recover()  # the next self-check tick resumes it
    await p.deletion.wait()
    assert results == ["failed", "ok"]
    assert await _leftovers(store, acct) == []
    assert (await p.deletion.get(OP, acct)).state == "deleted"


async def test_a_machine_offline_during_the_deletion_hears_it_when_it_connects(
    clock: Clock,
) -> None:
    p = Process(MemoryStore(), clock)
    acct = await _populate(p, 1, 0, 0)
    made = await p.tokens.create(OP, acct)
    res = await p.pairing.join(
        made.value, tls.build_csr(tls.new_tls_key()).decode(), MachineInfo("m", "0.1", "h")
    )
    peer = tls.identity_from_cert(res.cert.cert_pem)
    await p.machines.authorize_peer(peer)  # connects once (confirms the join)
    await p.deletion.delete(OP, acct)
    # The machine's own answer for a deleted account (machine/link/connection.py stops on it),
    # not "unknown machine", which it would keep retrying.
    with pytest.raises(PermissionDenied, match="account deleted"):
        await p.machines.authorize_peer(peer)
    stranger = tls.identity_from_cert(
        tls.sign_client_csr(
            CA,
            tls.build_csr(tls.new_tls_key()).decode(),
            account_id="acct_" + "1" * 26,
            machine_id="mc_" + "1" * 26,
            lifetime=dt.timedelta(days=1),
        ).cert_pem
    )
    with pytest.raises(Unauthenticated, match="unknown machine"):
        await p.machines.authorize_peer(stranger)


async def test_steps_run_together_and_the_first_failure_cancels_the_rest() -> None:
    started: list[str] = []
    slow_waiting = asyncio.Event()
    cancelled = asyncio.Event()

    async def slow() -> None:
        started.append("slow")
        try:
            slow_waiting.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def failing() -> None:
        started.append("failing")
        await slow_waiting.wait()  # both running at once
        raise StoreError("store: boom")

    with pytest.raises(StoreError, match="boom"):
        await _together(slow(), failing())
    assert started == ["slow", "failing"] and cancelled.is_set()

    # Each step waits for the other: run one after the other, this would hang.
    first, second = asyncio.Event(), asyncio.Event()

    async def step(mine: asyncio.Event, other: asyncio.Event) -> None:
        mine.set()
        await other.wait()

    await asyncio.wait_for(_together(step(first, second), step(second, first)), 5)


async def test_named_segments_are_read_from_macd_names_lists() -> None:
    """The control plane stores names lists MAC'd (controlplane.machines.backups): the sweep
    reads the names through the header and deletes those segments without a listing."""
    raw = MemoryStore()
    acct, machine = new_id("account"), new_id("machine")
    root = backups_prefix(acct, machine)
    names = [f"{i:064x}" for i in range(5)]
    for name in names:
        await raw.put(root + segment_key(name), b"sealed")
    listed = root + names_key(new_id("backup"))
    await raw.put(listed, seal(b"k" * 32, listed, json.dumps(names).encode()))
    sweep = AccountSweep(raw, acct, backups=raw)
    await sweep.named_segments([machine])
    assert await _keys(raw) == [listed]  # the list goes with the listing step, after
    assert sweep.deleted == len(names)
