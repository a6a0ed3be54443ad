"""LinkSessions unit tests over MemoryStore: the Connect rules without gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from controlplane.access.accounts import AccountService
from controlplane.access.principals import Principal
from controlplane.access.tokens import TokenService
from controlplane.integrity.audit import Auditor
from controlplane.integrity.records import Machine
from controlplane.machines.links import (
    Ack,
    Heartbeat,
    Hello,
    LinkNotice,
    LinkSessions,
    MachineMessage,
    Welcome,
)
from controlplane.machines.pairing import Pairing
from controlplane.machines.presence import (
    PresenceRegistry,
    RenewNowNotice,
    ReplicasChangedNotice,
    RevokedNotice,
)
from controlplane.machines.registry import MachineInfo, MachineRegistry
from controlplane.metrics import ControlMetrics
from shared import tls
from shared.errors import InvalidArgument, Unauthenticated
from shared.store import MemoryStore

_PROMPT = 5.0


class Feed:
    """The machine's side: messages put in are read by the session; None ends it."""

    def __init__(self, *items: MachineMessage | None) -> None:
        self.queue: asyncio.Queue[MachineMessage | None] = asyncio.Queue()
        self.taken = 0
        for item in items:
            self.queue.put_nowait(item)

    def __aiter__(self) -> Feed:
        return self

    async def __anext__(self) -> MachineMessage:
        item = await self.queue.get()
        self.taken += 1
        if item is None:
            raise StopAsyncIteration
        return item


class World:
    def __init__(self, lifetime: dt.timedelta = dt.timedelta(days=30)) -> None:
        self.store = MemoryStore()
        audit = Auditor(self.store)
        self.accounts = AccountService(self.store, audit)
        self.tokens = TokenService(self.store, self.accounts, audit)
        self.machines = MachineRegistry(self.store, self.accounts, audit)
        self.ca = tls.make_ca()
        self.pairing = Pairing(self.tokens, self.machines, self.accounts, self.ca, lifetime)
        self.op = Principal("adm_" + "0" * 26, "operator")
        self.presence = PresenceRegistry(self.store)
        self.machines.on_revoke(self.presence.kick)
        self.metrics = ControlMetrics(CollectorRegistry())
        self.now: dt.datetime | None = None

    def clock(self) -> dt.datetime:
        return self.now or dt.datetime.now(dt.UTC)

    def sessions(self, heartbeat: float = 1.0, renew_threshold: float = 1 / 3) -> LinkSessions:
        return LinkSessions(
            ca_cert_pem=self.ca.cert_pem,
            machines=self.machines,
            presence=self.presence,
            metrics=self.metrics,
            heartbeat_interval=heartbeat,
            renew_threshold=renew_threshold,
            clock=self.clock,
            linger=0.05,
        )

    async def join(self) -> tuple[str, bytes]:
        account = await self.accounts.create(1, "u1", None, "test")
        made = await self.tokens.create(self.op, account.account.account_id)
        res = await self.pairing.join(
            made.value, tls.build_csr(tls.new_tls_key()).decode(), MachineInfo("m", "0.1", "h")
        )
        return res.machine.machine_id, res.cert.cert_pem

    def count(self, name: str, value: str) -> float:
        counter = self.metrics.connects if name == "connects" else self.metrics.disconnects
        return counter.labels(value)._value.get()  # type: ignore[attr-defined,no-any-return]


async def _next(notices: AsyncIterator[LinkNotice]) -> LinkNotice:
    return await asyncio.wait_for(anext(notices), _PROMPT)


async def _rest(notices: AsyncIterator[LinkNotice]) -> list[LinkNotice]:
    async def drain() -> list[LinkNotice]:
        return [n async for n in notices]

    return await asyncio.wait_for(drain(), _PROMPT)


async def test_each_welcome_lists_the_replicas_as_they_are_then() -> None:
    """The first welcome lists the link addresses of the moment; a replica joining
    (ReplicasChangedNotice, to every link here) sends a fresh welcome with the new list."""
    w = World()
    machine_id, pem = await w.join()
    replicas = ["10.0.0.1:7444"]
    sessions = LinkSessions(
        ca_cert_pem=w.ca.cert_pem,
        machines=w.machines,
        presence=w.presence,
        metrics=w.metrics,
        heartbeat_interval=0.5,
        renew_threshold=1 / 3,
        clock=w.clock,
        linger=0.05,
        control_addresses=lambda: tuple(replicas),
    )
    feed = Feed(Hello("2.0", 0))
    async with contextlib.aclosing(sessions.run(pem, feed)) as notices:
        first = await _next(notices)
        assert isinstance(first, Welcome) and first.control_addresses == ("10.0.0.1:7444",)
        replicas.append("10.0.0.2:7444")
        assert w.presence.tell_all(ReplicasChangedNotice()) == 1
        again = await _next(notices)
        assert isinstance(again, Welcome) and again.machine_id == machine_id
        assert again.control_addresses == ("10.0.0.1:7444", "10.0.0.2:7444")
        feed.queue.put_nowait(None)
        assert await _rest(notices) == []


async def test_anonymous_refused_without_reading() -> None:
    w = World()
    feed = Feed(Hello("1", 0))
    with pytest.raises(Unauthenticated, match="no client certificate"):
        await _next(w.sessions().run(None, feed))
    assert feed.taken == 0
    assert w.count("connects", "refused") == 1


async def test_link_lifecycle_welcome_heartbeats_close() -> None:
    w = World()
    machine_id, pem = await w.join()
    feed = Feed(Hello("2.0", -3))
    async with contextlib.aclosing(w.sessions(heartbeat=0.5).run(pem, feed)) as notices:
        welcome = await _next(notices)
        assert welcome == Welcome(0.5, welcome.server_time, machine_id)  # type: ignore[union-attr]
        session = w.presence.session(machine_id)
        assert session is not None and session.version == "2.0" and session.agent_count == 0
        feed.queue.put_nowait(Heartbeat(4))
        feed.queue.put_nowait(Ack())
        feed.queue.put_nowait(None)
        assert await _rest(notices) == []
    assert session.agent_count == 4
    assert w.presence.session(machine_id) is None
    assert w.count("connects", "ok") == 1
    assert w.count("disconnects", "closed") == 1


async def test_hello_read_before_refusing_foreign_certificate() -> None:
    w = World()
    await w.join()
    other = World()
    _, foreign = await other.join()
    feed = Feed(Hello("1", 0))
    with pytest.raises(Unauthenticated, match="not issued"):
        await _next(w.sessions().run(foreign, feed))
    assert feed.taken == 1
    assert w.count("connects", "refused") == 1


@pytest.mark.parametrize(
    ("first", "field"),
    [(Heartbeat(1), "hello"), (None, "hello"), (Hello("1\x1b[2J", 0), "hello.version")],
)
async def test_bad_hello_refused(first: MachineMessage | None, field: str) -> None:
    w = World()
    machine_id, pem = await w.join()
    with pytest.raises(InvalidArgument) as caught:
        await _next(w.sessions().run(pem, Feed(first)))
    assert caught.value.field == field
    assert w.presence.session(machine_id) is None
    assert w.count("connects", "bad_hello") == 1


async def test_silent_machine_times_out() -> None:
    w = World()
    _, pem = await w.join()
    async with contextlib.aclosing(w.sessions(heartbeat=0.05).run(pem, Feed(Hello("1", 0)))) as n:
        assert isinstance(await _next(n), Welcome)
        assert await _rest(n) == []
    assert w.count("disconnects", "timeout") == 1


async def test_link_ends_once_certificate_expired() -> None:
    w = World()
    _, pem = await w.join()
    feed = Feed(Hello("1", 0))
    async with contextlib.aclosing(w.sessions().run(pem, feed)) as notices:
        assert isinstance(await _next(notices), Welcome)
        w.now = tls.load_cert(pem).not_valid_after_utc + dt.timedelta(seconds=1)
        feed.queue.put_nowait(Heartbeat(1))
        assert await _rest(notices) == []
    assert w.count("disconnects", "expired") == 1


async def test_renew_now_after_welcome_when_due() -> None:
    w = World(lifetime=dt.timedelta(hours=1))
    _, pem = await w.join()
    async with contextlib.aclosing(
        w.sessions(renew_threshold=0.99).run(pem, Feed(Hello("1", 0)))
    ) as notices:
        assert isinstance(await _next(notices), Welcome)
        assert await _next(notices) == RenewNowNotice("certificate nearing expiry")


async def test_revoke_notice_ends_link() -> None:
    w = World()
    machine_id, pem = await w.join()
    async with contextlib.aclosing(w.sessions().run(pem, Feed(Hello("1", 0)))) as notices:
        assert isinstance(await _next(notices), Welcome)
        await w.machines.revoke(w.op, machine_id)
        assert isinstance(await _next(notices), RevokedNotice)
        assert await _rest(notices) == []
    assert w.count("disconnects", "revoked") == 1


async def test_revoke_between_authorisation_and_registration_noticed() -> None:
    w = World()
    machine_id, pem = await w.join()
    real_open = w.presence.open

    async def open_after_revoke(machine: Machine, version: str, agents: int) -> object:
        # The revoke lands before the session exists: kick finds nothing to close.
        await w.machines.revoke(w.op, machine_id)
        return await real_open(machine, version, agents)

    w.presence.open = open_after_revoke  # type: ignore[assignment,method-assign]
    async with contextlib.aclosing(w.sessions().run(pem, Feed(Hello("1", 0)))) as notices:
        assert isinstance(await _next(notices), Welcome)
        assert isinstance(await _next(notices), RevokedNotice)
        assert await _rest(notices) == []
    assert w.presence.session(machine_id) is None
    assert w.count("disconnects", "revoked") == 1


async def test_closing_the_generator_cleans_up() -> None:
    w = World()
    machine_id, pem = await w.join()
    notices = w.sessions().run(pem, Feed(Hello("1", 0)))
    assert isinstance(await _next(notices), Welcome)
    assert w.presence.online_count == 1
    await notices.aclose()
    assert w.presence.session(machine_id) is None
    # Torn down without the machine's goodbye: broken, not closed.
    assert w.count("disconnects", "broken") == 1
    assert w.count("disconnects", "closed") == 0
