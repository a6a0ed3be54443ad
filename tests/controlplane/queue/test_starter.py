"""Providers started by waiting prompts: EC2 on moto's server, debounce, bad
credentials as a kept error and a count, sealed settings, operator-only local."""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from controlplane.access.accounts import AccountService
from controlplane.access.principals import Principal
from controlplane.access.tokens import TokenService
from controlplane.integrity.audit import Auditor
from controlplane.integrity.records import Machine
from controlplane.machines.pairing import Pairing
from controlplane.machines.presence import PresenceRegistry
from controlplane.machines.registry import MachineInfo, MachineRegistry
from controlplane.queue.delivery import PromptDelivery
from controlplane.queue.prompts import DEFAULT_TTL, PromptQueue
from controlplane.queue.starter import DEBOUNCE, MachineStarter
from shared import tls
from shared.crypto import BoxKeyPair
from shared.errors import InvalidArgument, PermissionDenied
from shared.ids import new_id
from shared.store import MemoryStore
from shared.timestamps import utc_now
from tests.helpers.moto_server import moto_server
from tests.helpers.poll import apoll_until

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
KEY_ID = "AKIAIOSFODNN7EXAMPLE"


class World:
    def __init__(self, tmp_path: Path) -> None:
        self.store = MemoryStore()
        audit = Auditor(self.store)
        self.accounts = AccountService(self.store, audit)
        self.tokens = TokenService(self.store, self.accounts, audit)
        self.machines = MachineRegistry(self.store, self.accounts, audit)
        self.pairing = Pairing(
            self.tokens, self.machines, self.accounts, tls.make_ca(), dt.timedelta(days=1)
        )
        self.op = Principal("adm_" + "0" * 26, "operator")
        self.results: list[str] = []
        self.now = 0.0  # the starter's monotonic clock (its debounce window)
        self.shift = dt.timedelta(0)  # how far the queue's clock is ahead
        self.queue = PromptQueue(
            self.store, self.machines, audit, clock=lambda: utc_now() + self.shift
        )
        presence = PresenceRegistry(self.store)

        async def waiting(m: Machine) -> bool:  # as server.py wires it
            return presence.session(m.machine_id) is None and await self.queue.waiting(m)

        self.starter = MachineStarter(
            self.store,
            self.machines,
            audit,
            b"s" * 32,
            log_dir=tmp_path / "providers",
            on_result=self.results.append,
            monotonic=lambda: self.now,
            waiting=waiting,
        )
        self.delivery = PromptDelivery(self.queue, presence, on_queued=self.starter.request)

    async def machine(self) -> tuple[str, str]:
        acct = (await self.accounts.create(1, "u", None, "t")).account.account_id
        made = await self.tokens.create(self.op, acct)
        res = await self.pairing.join(
            made.value,
            tls.build_csr(tls.new_tls_key()).decode(),
            MachineInfo("m", "0.1", "h", box_public_key=BoxKeyPair.generate().public_key),
        )
        return acct, res.machine.machine_id


@pytest.fixture
async def w(tmp_path: Path) -> World:
    world = World(tmp_path)
    yield world  # type: ignore[misc]
    await world.starter.close()


@pytest.fixture(scope="module")
def ec2_endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


def _ec2_client(endpoint: str) -> object:
    return boto3.client(
        "ec2",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=KEY_ID,
        aws_secret_access_key="x",
    )


def _settings(endpoint: str, instance: str) -> str:
    return json.dumps(
        {
            "instance_id": instance,
            "region": "us-east-1",
            "endpoint_url": endpoint,
            "access_key_id": KEY_ID,
            "secret_access_key": SECRET,
        }
    )


async def test_a_queued_prompt_starts_the_stopped_instance_once(
    w: World, ec2_endpoint: str
) -> None:
    ec2 = _ec2_client(ec2_endpoint)
    reply = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)  # type: ignore[attr-defined]
    instance = str(reply["Instances"][0]["InstanceId"])
    ec2.stop_instances(InstanceIds=[instance])  # type: ignore[attr-defined]
    _, m = await w.machine()
    await w.starter.set(w.op, m, "ec2", _settings(ec2_endpoint, instance))
    stored = b"".join([await w.store.get(i.key) async for i in w.store.list("")])
    assert SECRET.encode() not in stored and instance.encode() not in stored

    agent = new_id("agent")
    sent = await w.delivery.send(w.op, m, agent, "wake up")
    assert sent.state == "queued"

    def state() -> str:
        got = ec2.describe_instances(InstanceIds=[instance])  # type: ignore[attr-defined]
        return str(got["Reservations"][0]["Instances"][0]["State"]["Name"])

    await apoll_until(lambda: state() == "running", deadline=15, what="instance running")
    await apoll_until(lambda: w.starter.starting(m), deadline=15, what="starting")
    await w.delivery.send(w.op, m, agent, "again")  # inside the debounce window
    assert w.results == ["ok"]
    w.starter.connected(m)
    assert not w.starter.starting(m)


async def test_bad_credentials_are_kept_and_counted_not_raised(w: World) -> None:
    _, m = await w.machine()
    with moto_server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as endpoint:
        await w.starter.set(w.op, m, "ec2", _settings(endpoint, "i-0123456789abcdef0"))
        sent = await w.delivery.send(w.op, m, new_id("agent"), "hello")
        assert sent.state == "queued"
        await apoll_until(lambda: w.results, deadline=15, what="a start result")
    assert w.results == ["error"]
    error = w.starter.last_error(m)
    assert "refused the credentials" in error and SECRET not in error
    assert not w.starter.starting(m)


async def test_local_needs_the_operator_and_settings_are_checked(w: World) -> None:
    acct, m = await w.machine()
    tenant = Principal("adm_" + "1" * 26, "account", acct)
    with pytest.raises(PermissionDenied, match="operator"):
        await w.starter.set(tenant, m, "local", json.dumps({"command": ["true"]}))
    with pytest.raises(InvalidArgument, match="settings_json"):
        await w.starter.set(w.op, m, "local", "{not json")
    with pytest.raises(InvalidArgument, match="provider"):
        await w.starter.set(w.op, m, "gcp", "{}")
    assert [i.key async for i in w.store.list(f"accounts/{acct}/providers/")] == []


async def test_a_machine_without_a_provider_is_asked_about_once(w: World) -> None:
    """``machine list`` asks whether each machine has a provider: a machine without
    one costs one store read per process, until a provider is set for it."""
    _, m = await w.machine()
    reads: list[str] = []
    store_get = w.store.get

    async def counting_get(key: str) -> bytes:
        reads.append(key)
        return await store_get(key)

    w.store.get = counting_get  # type: ignore[method-assign]
    account = (await w.machines.get(w.op, m)).account_id
    for _ in range(3):
        assert not await w.starter.has_provider(account, m)
    assert len([k for k in reads if "/providers/" in k]) == 1
    await w.starter.set(w.op, m, "local", json.dumps({"command": ["true"]}))
    assert await w.starter.has_provider(account, m)


def _instance(endpoint: str) -> tuple[object, str]:
    """A stopped EC2 instance on moto's server: (client, instance id)."""
    ec2 = _ec2_client(endpoint)
    reply = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)  # type: ignore[attr-defined]
    instance = str(reply["Instances"][0]["InstanceId"])
    ec2.stop_instances(InstanceIds=[instance])  # type: ignore[attr-defined]
    return ec2, instance


def _state(ec2: object, instance: str) -> str:
    got = ec2.describe_instances(InstanceIds=[instance])  # type: ignore[attr-defined]
    return str(got["Reservations"][0]["Instances"][0]["State"]["Name"])


async def test_setting_a_provider_starts_a_machine_whose_prompts_wait(
    w: World, ec2_endpoint: str
) -> None:
    """Issue 34: prompts queued for a machine without a provider waited until the
    next send after ``provider set``; the set itself starts the machine now."""
    ec2, instance = _instance(ec2_endpoint)
    _, m = await w.machine()
    sent = await w.delivery.send(w.op, m, new_id("agent"), "wake up")
    assert sent.state == "queued" and w.results == []  # no provider: nothing to ask
    await w.starter.set(w.op, m, "ec2", _settings(ec2_endpoint, instance))
    await apoll_until(lambda: w.results, deadline=15, what="a start result")
    assert w.results == ["ok"] and w.starter.starting(m)
    await apoll_until(lambda: _state(ec2, instance) == "running", deadline=15, what="running")


async def test_setting_a_provider_with_nothing_queued_starts_nothing(
    w: World, ec2_endpoint: str
) -> None:
    ec2, instance = _instance(ec2_endpoint)
    acct, m = await w.machine()
    await w.starter.set(w.op, m, "ec2", _settings(ec2_endpoint, instance))
    machine = await w.machines.get(w.op, m)
    assert not await w.starter.start_if_waiting(machine)
    assert w.results == [] and not w.starter.starting(m) and _state(ec2, instance) == "stopped"


async def test_waiting_prompts_are_asked_for_again_and_a_known_queue_costs_no_request(
    w: World, caplog: pytest.LogCaptureFixture
) -> None:
    """The periodic check (ScheduleWaker) asks again for a machine whose prompts
    still wait once the debounce window is over, logs the same refusal once, and
    reads nothing from the store for a queue and a provider it knows."""
    caplog.set_level(logging.DEBUG, logger="controlplane.queue.starter")
    _, m = await w.machine()
    missing = "/nonexistent/agents-machine"
    await w.starter.set(w.op, m, "local", json.dumps({"command": [missing, "serve"]}))
    machine = await w.machines.get(w.op, m)
    await w.delivery.send(w.op, m, new_id("agent"), "hello")
    await apoll_until(lambda: w.results, deadline=15, what="the first start")
    requests: list[str] = []
    for name in ("get", "head", "list", "list_pages", "put", "delete"):
        real = getattr(w.store, name)

        def counted(*args: object, _real: object = real, _name: str = name, **kw: object) -> object:
            requests.append(_name)
            return _real(*args, **kw)  # type: ignore[operator]

        setattr(w.store, name, counted)
    assert not await w.starter.start_if_waiting(machine)  # inside the window
    for n in (2, 3):
        w.now += DEBOUNCE
        assert await w.starter.start_if_waiting(machine)
        await apoll_until(lambda n=n: len(w.results) == n, deadline=15, what="asked again")
    assert w.results == ["error", "error", "error"]
    assert requests == []
    failed = [r for r in caplog.records if "provider start failed" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert "cannot run" in w.starter.last_error(m)


async def test_an_empty_or_expired_queue_asks_nothing(w: World) -> None:
    _, m = await w.machine()
    # A command that cannot run: a start is asked for (and fails) without a process.
    await w.starter.set(w.op, m, "local", json.dumps({"command": ["/nonexistent/x"]}))
    machine = await w.machines.get(w.op, m)
    assert not await w.starter.start_if_waiting(machine)  # nothing queued
    await w.delivery.send(w.op, m, new_id("agent"), "hello")
    await apoll_until(lambda: w.results, deadline=15, what="the send's start")
    w.now += DEBOUNCE
    w.shift = DEFAULT_TTL + dt.timedelta(seconds=1)  # the prompt is past its time to live
    assert not await w.queue.waiting(machine)
    assert not await w.starter.start_if_waiting(machine)
    assert w.results == ["error"]
