"""Providers started by waiting prompts: EC2 on moto's server, debounce, bad
credentials as a kept error and a count, sealed settings, operator-only local."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from controlplane.access.accounts import AccountService
from controlplane.access.principals import Principal
from controlplane.access.tokens import TokenService
from controlplane.integrity.audit import Auditor
from controlplane.machines.pairing import Pairing
from controlplane.machines.presence import PresenceRegistry
from controlplane.machines.registry import MachineInfo, MachineRegistry
from controlplane.queue.delivery import PromptDelivery
from controlplane.queue.prompts import PromptQueue
from controlplane.queue.starter import MachineStarter
from shared import tls
from shared.crypto import BoxKeyPair
from shared.errors import InvalidArgument, PermissionDenied
from shared.ids import new_id
from shared.store import MemoryStore
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
        self.starter = MachineStarter(
            self.store,
            self.machines,
            audit,
            b"s" * 32,
            log_dir=tmp_path / "providers",
            on_result=self.results.append,
        )
        queue = PromptQueue(self.store, self.machines, audit)
        self.delivery = PromptDelivery(
            queue, PresenceRegistry(self.store), on_queued=self.starter.request
        )

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
