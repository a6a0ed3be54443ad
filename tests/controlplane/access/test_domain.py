"""Domain unit tests over MemoryStore: accounts, tokens, authz, machines, presence."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any

import pytest

from controlplane.access.accounts import AccountService
from controlplane.access.authz import CredentialService
from controlplane.access.principals import Principal
from controlplane.access.tokens import TokenService
from controlplane.integrity.audit import Auditor
from controlplane.integrity.records import Machine, deleting_key, token_key, token_uses_prefix
from controlplane.machines.alive import KEPT, AliveStamps
from controlplane.machines.pairing import Pairing
from controlplane.machines.presence import PresenceRegistry, RevokedNotice
from controlplane.machines.registry import MachineInfo, MachineRegistry
from shared import tls
from shared.errors import (
    AlreadyExists,
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from shared.ids import new_id
from shared.store import MemoryStore


class Clock:
    def __init__(self) -> None:
        self.now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

    def __call__(self) -> dt.datetime:
        return self.now


class World:
    def __init__(self) -> None:
        self.store = MemoryStore()
        self.clock = Clock()
        audit = Auditor(self.store, self.clock)
        self.accounts = AccountService(self.store, audit, self.clock)
        self.creds = CredentialService(self.store, self.accounts, audit, self.clock)
        self.tokens = TokenService(self.store, self.accounts, audit, clock=self.clock)
        self.machines = MachineRegistry(self.store, self.accounts, audit, self.clock)
        self.ca = tls.make_ca()
        self.pairing = Pairing(
            self.tokens, self.machines, self.accounts, self.ca, dt.timedelta(days=30)
        )
        self.op = Principal("adm_" + "0" * 26, "operator")

    async def account(self, gh: int) -> str:
        return (await self.accounts.create(gh, f"u{gh}", None, "test")).account.account_id

    async def join(self, account_id: str, **token_args: Any) -> tuple[str, bytes]:
        made = await self.tokens.create(self.op, account_id, **token_args)
        key = tls.new_tls_key()
        res = await self.pairing.join(
            made.value, tls.build_csr(key).decode(), MachineInfo("m", "0.1", "h")
        )
        return res.machine.machine_id, res.cert.cert_pem


@pytest.fixture
def w() -> World:
    return World()


async def test_account_create_once_per_github_user(w: World) -> None:
    made = await w.accounts.create(7, "octo", None, "t")
    assert made.recovery_private_key is not None and len(made.account.recovery_public_key) == 32
    with pytest.raises(AlreadyExists):
        await w.accounts.create(7, "other", None, "t")
    with pytest.raises(InvalidArgument, match="github_login"):
        await w.accounts.create(8, "bad login!", None, "t")
    given = await w.accounts.create(9, "nine", b"\x01" * 32, "t")
    assert given.recovery_private_key is None
    # Listed in id order; two ids made in the same millisecond order by their random part.
    assert [a.account_id for a in await w.accounts.list()] == sorted(
        [made.account.account_id, given.account.account_id]
    )
    raw = b"".join([await w.store.get(i.key) async for i in w.store.list("")])
    assert made.recovery_private_key.hex().encode() not in raw


async def test_token_lifecycle(w: World) -> None:
    acct = await w.account(1)
    with pytest.raises(InvalidArgument, match="ttl_seconds"):
        await w.tokens.create(w.op, acct, ttl_seconds=24 * 3600 + 1)
    made = await w.tokens.create(w.op, acct)
    assert made.token.expires_at - made.token.created_at == dt.timedelta(hours=1)
    tok_id, secret = made.value.split(".")
    with pytest.raises(Unauthenticated, match="unknown token or wrong secret"):
        await w.tokens.consume(f"{tok_id}.{'A' * 43}")
    with pytest.raises(Unauthenticated, match="malformed"):
        await w.tokens.consume("nonsense")
    used = await w.tokens.consume(made.value)
    assert used.uses == 1
    with pytest.raises(Unauthenticated, match="already used"):
        await w.tokens.consume(made.value)
    late = await w.tokens.create(w.op, acct, ttl_seconds=60, max_uses=3)
    w.clock.now += dt.timedelta(seconds=61)
    with pytest.raises(Unauthenticated, match="token expired"):
        await w.tokens.consume(late.value)
    revoked = await w.tokens.create(w.op, acct)
    await w.tokens.revoke(w.op, revoked.token.token_id)
    with pytest.raises(Unauthenticated, match="token revoked"):
        await w.tokens.consume(revoked.value)
    stored = b"".join([await w.store.get(i.key) async for i in w.store.list("")])
    assert secret.encode() not in stored


async def test_token_zero_means_default_and_negative_is_refused(w: World) -> None:
    acct = await w.account(1)
    # proto3 cannot tell "not set" from 0, so 0 is "use the default" (1 h, 1 use).
    made = await w.tokens.create(w.op, acct, ttl_seconds=0, max_uses=0)
    assert made.token.expires_at - made.token.created_at == dt.timedelta(hours=1)
    assert made.token.max_uses == 1
    with pytest.raises(InvalidArgument, match="ttl_seconds: must not be negative") as ttl:
        await w.tokens.create(w.op, acct, ttl_seconds=-1)
    assert ttl.value.field == "ttl_seconds"
    with pytest.raises(InvalidArgument, match="max_uses: must not be negative") as uses:
        await w.tokens.create(w.op, acct, max_uses=-5)
    assert uses.value.field == "max_uses"
    assert len(await w.tokens.list(w.op, acct)) == 1  # nothing made by the refusals


async def test_token_of_deleting_account_refused(w: World) -> None:
    acct = await w.account(1)
    made = await w.tokens.create(w.op, acct)
    await w.store.put(deleting_key(acct), b"{}")
    with pytest.raises(PermissionDenied, match="being deleted"):
        await w.tokens.consume(made.value)
    with pytest.raises(PermissionDenied):
        await w.tokens.create(w.op, acct)


async def test_multi_use_token_counts_uses(w: World) -> None:
    acct = await w.account(1)
    made = await w.tokens.create(w.op, acct, max_uses=2)
    await w.tokens.consume(made.value)
    await w.tokens.consume(made.value)
    with pytest.raises(Unauthenticated):
        await w.tokens.consume(made.value)


async def test_a_fleet_joining_at_once_with_one_token_all_joins(w: World) -> None:
    """Concurrent joins with one token each take a use (before, their
    compare-and-swap rounds on the token's record lost to each other until some
    gave up with 'too much contention')."""
    acct = await w.account(1)
    fleet = 60
    made = await w.tokens.create(w.op, acct, max_uses=fleet)
    real_get = w.store.get

    async def slow_get(key: str) -> bytes:
        await asyncio.sleep(0.001)  # a store's round trip: joins interleave as for real
        return await real_get(key)

    w.store.get = slow_get  # type: ignore[method-assign]
    csrs = [tls.build_csr(tls.new_tls_key()).decode() for _ in range(fleet)]
    joined = await asyncio.gather(
        *(w.pairing.join(made.value, csr, MachineInfo("m", "0.1", "h")) for csr in csrs)
    )
    assert len({j.machine.machine_id for j in joined}) == fleet
    token = await w.tokens.get(w.op, made.token.token_id)
    assert token.uses == fleet and token.state(w.clock()) == "used"


async def test_joins_waiting_on_one_token_take_their_uses_together(w: World) -> None:
    """A token of 5 uses, 12 joins at once: the record is written far fewer times
    than there are joins, exactly 5 join and hold a use marker each, and the
    other 7 are refused as used, their markers gone."""
    acct = await w.account(1)
    made = await w.tokens.create(w.op, acct, max_uses=5)
    key = token_key(acct, made.token.token_id)
    writes = 0
    real_put, real_get = w.store.put, w.store.get

    async def counted_put(k: str, data: Any, **kw: Any) -> str:
        nonlocal writes
        writes += k == key
        await asyncio.sleep(0.002)  # a store's round trip: the others queue meanwhile
        return await real_put(k, data, **kw)

    async def slow_get(k: str) -> bytes:
        await asyncio.sleep(0.001)
        return await real_get(k)

    w.store.put = counted_put  # type: ignore[method-assign]
    w.store.get = slow_get  # type: ignore[method-assign]
    results = await asyncio.gather(
        *(w.tokens.consume(made.value, new_id("intent")) for _ in range(12)),
        return_exceptions=True,
    )
    joined = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(joined) == 5
    assert all(isinstance(r, Unauthenticated) and "already used" in str(r) for r in refused)
    assert sorted(t.uses for t in joined) == [1, 2, 3, 4, 5], "each sees the token as it left it"
    assert writes < 5, f"{writes} writes of the record for 5 uses"
    token = await w.tokens.get(w.op, made.token.token_id)
    assert token.uses == 5 and token.state(w.clock()) == "used"
    markers = [o.key async for o in w.store.list(token_uses_prefix(acct, made.token.token_id))]
    assert len(markers) == 5


async def test_joins_waiting_on_a_token_whose_record_went_all_hear_why(w: World) -> None:
    """The record gone under a batch (the account's deletion swept it): every
    waiting join is refused with the same NotFound, none is left waiting."""
    acct = await w.account(1)
    made = await w.tokens.create(w.op, acct, max_uses=10)
    token = await w.tokens.check(made.value)
    key = token_key(acct, token.token_id)
    real_get = w.store.get

    async def gone_get(k: str) -> bytes:
        await asyncio.sleep(0.002)  # the others queue meanwhile
        if k == key:
            raise NotFound("object", k)
        return await real_get(k)

    w.store.get = gone_get  # type: ignore[method-assign]
    async with asyncio.timeout(10):
        results = await asyncio.gather(
            *(w.tokens.use(token, new_id("intent")) for _ in range(6)), return_exceptions=True
        )
    assert all(isinstance(r, NotFound) for r in results), results


async def test_a_join_cancelled_while_waiting_for_the_token_takes_no_use(w: World) -> None:
    acct = await w.account(1)
    made = await w.tokens.create(w.op, acct, max_uses=3)
    token = await w.tokens.check(made.value)
    gate = asyncio.Event()
    real_put = w.store.put

    async def held_put(k: str, data: Any, **kw: Any) -> str:
        if k == token_key(acct, token.token_id):
            await gate.wait()
        return await real_put(k, data, **kw)

    w.store.put = held_put  # type: ignore[method-assign]
    first = asyncio.create_task(w.tokens.use(token, new_id("intent")))
    waiting_id = new_id("intent")
    second = asyncio.create_task(w.tokens.use(token, waiting_id))
    async with asyncio.timeout(10):  # the second queued behind the first's update
        while not w.tokens._waiting.get(token.token_id):
            await asyncio.sleep(0.001)
    second.cancel()
    gate.set()
    assert (await first).uses == 1
    with pytest.raises(asyncio.CancelledError):
        await second
    # The next join takes its own use only, not the cancelled one's as well.
    assert (await w.tokens.use(token, new_id("intent"))).uses == 2
    after = await w.tokens.get(w.op, token.token_id)
    assert after.uses == 2 and waiting_id not in after.used_by


async def test_bad_csr_does_not_burn_token(w: World) -> None:
    acct = await w.account(1)
    made = await w.tokens.create(w.op, acct)
    with pytest.raises(InvalidArgument, match="csr_pem"):
        await w.pairing.join(made.value, "not a csr", MachineInfo("m", "1", "h"))
    assert (await w.tokens.consume(made.value)).uses == 1


async def test_cross_account_is_not_found(w: World) -> None:
    a, b = await w.account(1), await w.account(2)
    mc_a, _ = await w.join(a)
    mc_b, _ = await w.join(b)
    admin_a = (await w.creds.create_for_account(w.op, a, "a")).value
    pa = await w.creds.authenticate(admin_a)
    assert pa.account_id == a and not pa.is_operator
    assert [m.machine_id for m in await w.machines.list(pa)] == [mc_a]
    assert {m.machine_id for m in await w.machines.list(w.op)} == {mc_a, mc_b}
    missing = new_id("machine")
    for call in (
        lambda mid: w.machines.get(pa, mid),
        lambda mid: w.machines.rename(pa, mid, "x"),
        lambda mid: w.machines.revoke(pa, mid),
    ):
        with pytest.raises(NotFound) as other:
            await call(mc_b)
        with pytest.raises(NotFound) as absent:
            await call(missing)
        assert str(other.value).replace(mc_b, "X") == str(absent.value).replace(missing, "X")
    with pytest.raises(NotFound):
        await w.tokens.list(pa, b)
    with pytest.raises(PermissionDenied):
        await w.creds.create_for_account(pa, a, "again")
    # An account that does not exist is NOT_FOUND for the operator, as for tokens
    # (before: PERMISSION_DENIED "account does not exist", exit 1).
    with pytest.raises(NotFound):
        await w.creds.create_for_account(w.op, "acct_" + "0" * 26, "nobody")
    # The operator's view is unchanged and B's machine was not touched.
    assert (await w.machines.get(w.op, mc_b)).name == "m"


async def test_credential_checks(w: World) -> None:
    a = await w.account(1)
    made = await w.creds.create_for_account(w.op, a, "a")
    cid, _ = made.value.split(".")
    for bad, reason in [
        (None, "no credential"),
        ("x", "malformed"),
        (f"{cid}.{'B' * 43}", "unknown credential or wrong secret"),
        (f"{new_id('credential')}.{'B' * 43}", "unknown credential or wrong secret"),
    ]:
        with pytest.raises(Unauthenticated, match=reason):
            await w.creds.authenticate(bad)
    await w.store.put(deleting_key(a), b"{}")
    with pytest.raises(PermissionDenied):
        await w.creds.authenticate(made.value)


async def test_revoked_machine_refused_and_kicked(w: World) -> None:
    a = await w.account(1)
    mc, cert = await w.join(a)
    peer = tls.identity_from_cert(cert)
    machine = await w.machines.authorize_peer(peer)
    presence = PresenceRegistry(w.store, clock=w.clock)
    w.machines.on_revoke(presence.kick)
    session = await presence.open(machine, "0.1", 2)
    assert presence.online_count == 1
    await w.machines.revoke(w.op, mc)
    assert isinstance(session.outbox.get_nowait(), RevokedNotice)
    assert presence.online_count == 0
    with pytest.raises(Unauthenticated, match="revoked"):
        await w.machines.authorize_peer(peer)
    # A fresh service (another process) reads the revocation from the store.
    fresh = MachineRegistry(w.store, w.accounts, Auditor(w.store))
    with pytest.raises(Unauthenticated, match="revoked"):
        await fresh.authorize_peer(peer)


async def test_renewal_supersedes_old_serials(w: World) -> None:
    a = await w.account(1)
    mc, cert1 = await w.join(a)
    machine = await w.machines.authorize_peer(tls.identity_from_cert(cert1))
    cert2 = await w.pairing.renew(machine, tls.build_csr(tls.new_tls_key()).decode())
    machine = await w.machines.authorize_peer(tls.identity_from_cert(cert2.cert_pem))
    await w.machines.authorize_peer(tls.identity_from_cert(cert1))  # previous: still valid
    await w.pairing.renew(machine, tls.build_csr(tls.new_tls_key()).decode())
    with pytest.raises(Unauthenticated, match="superseded"):
        await w.machines.authorize_peer(tls.identity_from_cert(cert1))


async def test_presence_is_written_for_a_change_never_for_time_passing(w: World) -> None:
    """Once per link (within its first interval), for a changed agent count (at most
    once per interval), and at its end: an idle machine costs no write an hour."""
    a = await w.account(1)
    mc, cert = await w.join(a)
    machine = await w.machines.authorize_peer(tls.identity_from_cert(cert))
    ticks = [0.0]
    presence = PresenceRegistry(
        w.store,
        write_interval=60,
        clock=w.clock,
        monotonic=lambda: ticks[0],
        spread=lambda: 0.5,  # the first write half an interval after the link opened
    )
    puts: list[str] = []
    real_put = w.store.put

    async def counting_put(key: str, data: Any, **kw: Any) -> str:
        if "/presence/" in key:
            puts.append(key)
        return await real_put(key, data, **kw)

    w.store.put = counting_put  # type: ignore[method-assign]
    session = await presence.open(machine, "0.1", 1)
    assert puts == []  # a link's opening waits on no write
    for i in range(30):
        ticks[0] = i * 1.0
        await presence.seen(session, 5)
    assert puts == []
    for i in range(30, 3600):
        ticks[0] = i * 1.0
        await presence.seen(session, 5)
    assert len(puts) == 1  # at 30 s, then nothing while nothing changes
    ticks[0] = 3600.0
    await presence.seen(session, 6)  # a change: written
    assert len(puts) == 2
    ticks[0] = 3630.0
    await presence.seen(session, 7)  # another within the interval: held back
    assert len(puts) == 2
    ticks[0] = 3660.0
    w.clock.now += dt.timedelta(hours=1)
    await presence.seen(session, 7)
    assert len(puts) == 3
    await presence.close(session)
    assert len(puts) == 4
    status = await presence.status(machine)
    assert not status.online and status.agent_count == 7 and status.last_seen_at == w.clock.now


async def test_a_link_left_online_by_a_killed_control_plane_was_seen_until_its_last_stamp(
    w: World,
) -> None:
    """A control plane killed without a goodbye leaves the link's record online; the
    next one takes the machine as seen until the killed one's last alive stamp."""
    a = await w.account(1)
    _, cert = await w.join(a)
    machine = await w.machines.authorize_peer(tls.identity_from_cert(cert))
    opened_at = w.clock.now
    killed_alive = AliveStamps(w.store, epoch=3, clock=w.clock)
    await killed_alive.load()
    await killed_alive.stamp()
    killed = PresenceRegistry(
        w.store, clock=w.clock, epoch=3, alive=killed_alive, spread=lambda: 1.0
    )
    session = await killed.open(machine, "0.1", 1)
    await killed.seen(session, 1)  # its record, written online
    w.clock.now += dt.timedelta(hours=2)
    await killed_alive.stamp()  # its last stamp; then it is killed
    last_stamp = w.clock.now
    w.clock.now += dt.timedelta(minutes=4)
    alive = AliveStamps(w.store, epoch=4, clock=w.clock)
    await alive.load()
    await alive.stamp()
    restarted = PresenceRegistry(w.store, clock=w.clock, epoch=4, alive=alive)
    status = await restarted.status(machine)
    assert not status.online
    assert status.last_seen_at == last_stamp and last_stamp > opened_at
    # Without the stamps (an older record, or none readable), the record's own time.
    plain = await PresenceRegistry(w.store, clock=w.clock, epoch=4).status(machine)
    assert plain.last_seen_at == opened_at
    # The stamps keep the latest epochs only.
    for epoch in range(5, 5 + KEPT):
        later = AliveStamps(w.store, epoch=epoch, clock=w.clock)
        await later.load()
        await later.stamp()
    assert later.last_alive(3) is None and later.last_alive(5) is not None


async def test_a_close_cancelled_during_its_write_is_written_by_the_next_close(
    w: World,
) -> None:
    """The link's reader closes the session and is cancelled as the link ends;
    the link's own close then must still write last seen (before, the first
    close had forgotten the session: the second returned, and last seen went
    back to the last periodic write)."""
    a = await w.account(1)
    _, cert = await w.join(a)
    machine = await w.machines.authorize_peer(tls.identity_from_cert(cert))
    presence = PresenceRegistry(w.store, write_interval=60, clock=w.clock)
    session = await presence.open(machine, "0.1", 1)
    w.clock.now += dt.timedelta(seconds=45)
    await presence.seen(session, 1)  # within the interval: not written
    real_put = w.store.put
    started = asyncio.Event()

    async def stuck_put(key: str, data: Any, **kw: Any) -> str:
        started.set()
        await asyncio.Event().wait()  # until cancelled
        raise AssertionError("unreachable")

    w.store.put = stuck_put  # type: ignore[method-assign]
    reader_close = asyncio.create_task(presence.close(session))
    await started.wait()
    reader_close.cancel()
    await asyncio.gather(reader_close, return_exceptions=True)
    w.store.put = real_put  # type: ignore[method-assign]
    await presence.close(session)  # the link's own close, in its finally
    status = await presence.status(machine)
    assert not status.online and status.last_seen_at == w.clock.now


def test_a_record_missing_fields_is_an_integrity_error_not_a_type_error() -> None:
    # MAC'd records are ours, but one of another version (or a bug) may lack
    # fields: every reader gets a clear IntegrityError naming the record.
    with pytest.raises(IntegrityError, match=r"machine record: malformed: .*machine_id"):
        Machine.from_dict({"name": "m"})


class Crash(Exception):
    """The process dies here."""


class DiesBeforeRecord(MemoryStore):
    """Dies at the first conditional update of a key ending in ``suffix``, before it
    is written: the create-only marker written just before it stays."""

    def __init__(self) -> None:
        super().__init__()
        self.suffix = ""

    async def put(self, key, data, *, if_none_match=False, if_match=None):  # type: ignore[no-untyped-def]
        if self.suffix and key.endswith(self.suffix) and if_match is not None:
            self.suffix = ""
            raise Crash(key)
        return await super().put(key, data, if_none_match=if_none_match, if_match=if_match)


def _world_on(store: DiesBeforeRecord) -> World:
    w = World()
    w.store = store
    audit = Auditor(store, w.clock)
    w.accounts = AccountService(store, audit, w.clock)
    w.tokens = TokenService(store, w.accounts, audit, clock=w.clock)
    w.machines = MachineRegistry(store, w.accounts, audit, w.clock)
    w.pairing = Pairing(w.tokens, w.machines, w.accounts, w.ca, dt.timedelta(days=30))
    return w


async def test_a_use_killed_between_its_marker_and_the_record_fails_closed() -> None:
    store = DiesBeforeRecord()
    w = _world_on(store)
    acct = await w.account(41)
    made = await w.tokens.create(w.op, acct)
    token = await w.tokens.check(made.value)
    intent = new_id("intent")
    store.suffix = f"/tokens/{token.token_id}.json"
    with pytest.raises(Crash):
        await w.tokens.use(token, intent)
    # The marker counts: the token is used, though its record says 0 uses.
    with pytest.raises(Unauthenticated, match="already used"):
        await w.tokens.check(made.value)
    # The join's roll-back gives the use back: the marker goes, the token works.
    await w.tokens.give_back(acct, token.token_id, intent)
    again = await w.tokens.use(await w.tokens.check(made.value), new_id("intent"))
    assert again.uses == 1


async def test_a_revoke_killed_between_its_marker_and_the_record_has_taken_effect() -> None:
    store = DiesBeforeRecord()
    w = _world_on(store)
    acct = await w.account(42)
    machine_id, _ = await w.join(acct)
    store.suffix = f"/machines/{machine_id}.json"
    with pytest.raises(Crash):
        await w.machines.revoke(w.op, machine_id)
    assert (await w.machines.get(w.op, machine_id)).revoked
    listed = await w.machines.list(w.op, acct)
    assert [m.revoked for m in listed] == [True]
    # Run again (idempotent): the record says so too.
    assert (await w.machines.revoke(w.op, machine_id)).revoked


async def test_a_refused_credential_is_one_line_naming_its_id_never_its_secret(
    w: World, caplog: pytest.LogCaptureFixture
) -> None:
    a = await w.account(1)
    made = await w.creds.create_for_account(w.op, a, "a")
    cid, secret = made.value.split(".")
    wrong = "B" * 43
    caplog.set_level(logging.WARNING, "controlplane.access.authz")
    for bad in (f"{cid}.{wrong}", "x", None):
        with pytest.raises(Unauthenticated):
            await w.creds.authenticate(bad)
    await w.creds.authenticate(made.value)  # accepted: no line
    lines = [r for r in caplog.records if r.name == "controlplane.access.authz"]
    assert [r.levelno for r in lines] == [logging.WARNING] * 3
    assert [getattr(r, "credential_id", None) for r in lines] == [cid, None, None]
    assert "unknown credential or wrong secret" in lines[0].getMessage()
    text = " ".join(f"{r.getMessage()} {r.__dict__}" for r in lines)
    assert secret not in text and wrong not in text


async def test_a_credential_refused_again_and_again_warns_once(
    w: World, caplog: pytest.LogCaptureFixture
) -> None:
    a = await w.account(1)
    made = await w.creds.create_for_account(w.op, a, "a")
    cid, _ = made.value.split(".")
    caplog.set_level(logging.DEBUG, "controlplane.access.authz")
    for _ in range(20):
        with pytest.raises(Unauthenticated):
            await w.creds.authenticate(f"{cid}.{'B' * 43}")
    lines = [r for r in caplog.records if r.name == "controlplane.access.authz"]
    assert [r.levelno for r in lines] == [logging.WARNING] + [logging.DEBUG] * 19
    assert all(getattr(r, "credential_id", None) == cid for r in lines)


async def test_a_refused_join_is_one_line_naming_the_token_never_its_secret(
    w: World, caplog: pytest.LogCaptureFixture
) -> None:
    acct = await w.account(1)
    made = await w.tokens.create(w.op, acct)
    tok_id, secret = made.value.split(".")
    csr = tls.build_csr(tls.new_tls_key()).decode()
    await w.pairing.join(made.value, csr, MachineInfo("m", "1", "h"))
    caplog.set_level(logging.WARNING, "controlplane.machines.pairing")
    with pytest.raises(Unauthenticated, match="already used"):
        await w.pairing.join(made.value, csr, MachineInfo("m", "1", "h"))
    lines = [r for r in caplog.records if r.name == "controlplane.machines.pairing"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert lines[0].getMessage().startswith("join refused: ")
    assert getattr(lines[0], "token_id", None) == tok_id
    assert secret not in f"{lines[0].getMessage()} {lines[0].__dict__}"
