"""Renewal rules in the domain, shared listing helpers, and bounded presence reads."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from controlplane.access.accounts import AccountService
from controlplane.access.principals import Principal
from controlplane.access.tokens import TokenService
from controlplane.api.admin import AdminServicer
from controlplane.integrity import jsonstore
from controlplane.integrity.audit import Auditor
from controlplane.integrity.records import Machine, token_key
from controlplane.machines.links import LinkSessions
from controlplane.machines.pairing import Pairing
from controlplane.machines.presence import MachineStatus, PresenceRegistry
from controlplane.machines.registry import MachineInfo, MachineRegistry
from controlplane.metrics import ControlMetrics
from shared import tls
from shared.errors import InvalidState, NotFound, Unauthenticated
from shared.pb.control.v1 import admin_pb2
from shared.store import MemoryStore
from tests.helpers.poll import apoll_until

OP = Principal("adm_" + "0" * 26, "operator")


class World:
    def __init__(self, lifetime: dt.timedelta) -> None:
        self.store = MemoryStore()
        audit = Auditor(self.store)
        self.accounts = AccountService(self.store, audit)
        self.tokens = TokenService(self.store, self.accounts, audit)
        self.machines = MachineRegistry(self.store, self.accounts, audit)
        self.ca = tls.make_ca()
        self.pairing = Pairing(self.tokens, self.machines, self.accounts, self.ca, lifetime)
        self.sessions = LinkSessions(
            ca_cert_pem=self.ca.cert_pem,
            machines=self.machines,
            presence=PresenceRegistry(self.store),
            metrics=ControlMetrics(CollectorRegistry()),
            heartbeat_interval=1.0,
            renew_threshold=1 / 3,
        )

    async def account(self, gh: int) -> str:
        return (await self.accounts.create(gh, f"u{gh}", None, "test")).account.account_id

    async def join(self, account_id: str) -> tuple[str, bytes]:
        made = await self.tokens.create(OP, account_id)
        res = await self.pairing.join(
            made.value, tls.build_csr(tls.new_tls_key()).decode(), MachineInfo("m", "0.1", "h")
        )
        return res.machine.machine_id, res.cert.cert_pem


def csr() -> str:
    return tls.build_csr(tls.new_tls_key()).decode()


async def test_authorize_returns_the_presented_identity() -> None:
    w = World(dt.timedelta(days=30))
    mc, cert = await w.join(await w.account(1))
    peer = await w.sessions.authorize(cert)
    assert peer.machine.machine_id == mc
    assert peer.identity == tls.identity_from_cert(cert)
    assert peer.cert_pem == cert


async def test_fresh_certificate_is_not_due_for_renewal() -> None:
    w = World(dt.timedelta(days=30))
    _, cert = await w.join(await w.account(1))
    peer = await w.sessions.authorize(cert)
    # Even a threshold of 0.99 is held back to half the lifetime.
    with pytest.raises(InvalidState, match="not due for renewal yet"):
        await w.pairing.renew_presented(peer, csr(), 0.99)
    assert (await w.sessions.authorize(cert)).machine.cert_serial == peer.identity.serial


async def test_only_the_current_certificate_renews() -> None:
    # A one-minute lifetime behind a five-minute backdate: due at once.
    w = World(dt.timedelta(minutes=1))
    _, cert1 = await w.join(await w.account(1))
    new = await w.pairing.renew_presented(await w.sessions.authorize(cert1), csr(), 1 / 3)
    assert new.serial != tls.identity_from_cert(cert1).serial
    old = await w.sessions.authorize(cert1)  # the previous certificate still connects
    with pytest.raises(Unauthenticated) as caught:
        await w.pairing.renew_presented(old, csr(), 1 / 3)
    assert caught.value.message == "renew: only the current certificate may renew"
    current = await w.sessions.authorize(new.cert_pem)
    assert current.machine.cert_serial == new.serial
    assert (await w.pairing.renew_presented(current, csr(), 1 / 3)).serial != new.serial


async def test_join_ignores_a_stored_repair_machine_id() -> None:
    w = World(dt.timedelta(days=30))
    acct = await w.account(1)
    first, _ = await w.join(acct)
    made = await w.tokens.create(OP, acct)

    def poke(d: dict[str, Any]) -> dict[str, Any]:
        return {**d, "repair_machine_id": first}

    await jsonstore.update(w.store, token_key(acct, made.token.token_id), poke)
    res = await w.pairing.join(made.value, csr(), MachineInfo("m", "0.1", "h"))
    assert res.machine.machine_id != first


async def test_read_all_keeps_only_json_records_named_by_valid_ids() -> None:
    store = MemoryStore()
    w = World(dt.timedelta(days=30))
    acct = await w.account(1)
    a = (await w.tokens.create(OP, acct)).token.token_id
    b = (await w.tokens.create(OP, acct)).token.token_id
    prefix = f"accounts/{acct}/tokens/"
    for key in (f"{prefix}{a}.json", f"{prefix}{b}.json"):
        await store.put(key, await w.store.get(key))
    await store.put(f"{prefix}not-an-id.json", b"{}")
    await store.put(f"{prefix}{a}", b"{}")  # no .json suffix
    await store.put(f"{prefix}{a}.json.tmp", b"{}")
    await store.put(f"{prefix}sub/{b}.json", b"{}")
    records = await jsonstore.read_all(store, prefix, "token")
    assert [r["token_id"] for r in records] == sorted([a, b])
    assert await jsonstore.read_all(store, prefix, "machine") == []


async def test_scope_ids_and_listings_share_one_scope() -> None:
    w = World(dt.timedelta(days=30))
    a1, a2 = await w.account(1), await w.account(2)
    m1, _ = await w.join(a1)
    m2, _ = await w.join(a2)
    assert await w.accounts.scope_ids(OP) == [a.account_id for a in await w.accounts.list()]
    assert await w.accounts.scope_ids(OP, a2) == [a2]
    admin1 = Principal("adm_" + "1" * 26, "account", a1)
    assert await w.accounts.scope_ids(admin1) == [a1]
    with pytest.raises(NotFound):
        await w.accounts.scope_ids(admin1, a2)
    assert {m.machine_id for m in await w.machines.list(OP)} == {m1, m2}
    assert [m.machine_id for m in await w.machines.list(admin1)] == [m1]
    assert {t.account_id for t in await w.tokens.list(OP)} == {a1, a2}
    assert {t.account_id for t in await w.tokens.list(admin1)} == {a1}


class _SlowPresence:
    """Counts status reads in flight; each waits until released."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.peak = 0
        self.release = asyncio.Event()

    async def status(self, machine: Machine) -> MachineStatus:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await self.release.wait()
        finally:
            self.in_flight -= 1
        return MachineStatus(machine, False, None, machine.version, 0)


class _Machines:
    def __init__(self, machines: list[Machine]) -> None:
        self.machines = machines

    async def list(self, principal: Principal, account_id: str = "") -> list[Machine]:
        return self.machines


class _Credentials:
    async def authenticate(self, bearer: str | None) -> Principal:
        return OP


class _NoStarter:
    def starting(self, machine_id: str) -> bool:
        return False

    async def has_provider(self, account_id: str, machine_id: str) -> bool:
        return False


class _Context:
    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", "Bearer x"),)


async def test_list_machines_reads_presence_concurrently_but_bounded() -> None:
    w = World(dt.timedelta(days=30))
    acct = await w.account(1)
    joined = [await w.join(acct) for _ in range(20)]
    machines = await w.machines.list(OP)
    presence = _SlowPresence()
    servicer = AdminServicer(
        accounts=w.accounts,
        credentials=_Credentials(),  # type: ignore[arg-type]
        tokens=w.tokens,
        machines=_Machines(machines),  # type: ignore[arg-type]
        presence=presence,  # type: ignore[arg-type]
        deletion=None,  # type: ignore[arg-type]
        ca_hash="sha256:x",
        join_address="127.0.0.1:1",
        prompts=None,  # type: ignore[arg-type]
        starter=_NoStarter(),  # type: ignore[arg-type]
    )
    call = asyncio.create_task(
        servicer.ListMachines(admin_pb2.ListMachinesRequest(), _Context())  # type: ignore[arg-type]
    )
    try:
        await apoll_until(lambda: presence.in_flight >= 16, deadline=10, what="16 reads in flight")
        presence.release.set()
        async with asyncio.timeout(10):
            reply = await call
    finally:
        call.cancel()
    # Unbounded, all 20 reads would have been waiting at once.
    assert presence.peak == 16
    assert [m.machine_id for m in reply.machines] == [m.machine_id for m in machines]
    assert {m.machine_id for m in reply.machines} == {mc for mc, _ in joined}
