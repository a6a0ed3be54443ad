"""A real ``agents-machine`` moves to another control-plane replica when its own goes.

Real processes on loopback: moto, nats-server, two ``serve --cluster`` replicas
of one home, and one ``agents-machine`` joined through the first with one
``--link-address``, the first's own: the second's it learns from the join
reply (every replica publishes its link address in NATS), and a third
replica started after the join over the live link. The first replica is
SIGKILLed: within 5 s the machine is linked to the second (its link.json names
the survivor first, and the survivor lists it online), and a prompt sent
through the survivor is delivered and acknowledged.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from machine.link import identity
from shared.errors import IntegrityError, InvalidState, NotFound
from tests.helpers.control_proc import ControlProc, join_new_account
from tests.helpers.machine_proc import run_cli
from tests.helpers.nats_proc import NatsProc, nats_binary
from tests.helpers.poll import apoll_until
from tests.helpers.processes import stop_process
from tests.helpers.replicas import add_replica, serve_replicas

pytestmark = pytest.mark.skipif(nats_binary() is None, reason="nats-server not installed")

HEARTBEAT = 0.5


@pytest.fixture
def replicas(
    tmp_path: Path, s3_bucket: str, moto_endpoint: str, nats: NatsProc
) -> Iterator[list[ControlProc]]:
    with serve_replicas(tmp_path, s3_bucket, moto_endpoint, nats, 2, heartbeat=HEARTBEAT) as procs:
        yield procs


def _addresses(data: Path) -> tuple[str, ...]:
    try:
        return identity.load_link(data).control_addresses
    except (InvalidState, IntegrityError):
        return ()


def _first_address(data: Path) -> str:
    try:
        return identity.load_link(data).control_address
    except (InvalidState, IntegrityError):
        return ""


async def test_a_real_machine_moves_to_the_surviving_replica(
    replicas: list[ControlProc], nats: NatsProc, tmp_path: Path
) -> None:
    doomed, survivor = replicas
    data = tmp_path / "machine"
    machine = join_new_account(
        doomed,
        data,
        tmp_path / "machine.log",
        github_id=38,
        login="failover",
        # The operator names no other replica: the join reply does.
        extra=["--link-address", doomed.link],
    )
    try:
        # Joined through the first replica: its link address first, the other after.
        await apoll_until(
            lambda: _first_address(data) == doomed.link, deadline=15, what="the machine joined"
        )
        assert identity.load_link(data).control_addresses == (doomed.link, survivor.link)
        async with survivor.admin() as admin:

            async def online() -> str:
                listed = await admin.list_machines()
                return next((m.machine_id for m in listed if m.online), "")

            machine_id = await apoll_until(online, deadline=15, what="the machine online")
        made = run_cli(data, "agent", "create", "r", "--folder", str(tmp_path), "--json")
        assert made.returncode == 0, made.stderr
        agent = json.loads(made.stdout)["agent_id"]

        # A replica started now is learned over the live link (a fresh welcome).
        later = add_replica(replicas, nats)
        await apoll_until(
            lambda: _addresses(data) == (doomed.link, survivor.link, later.link),
            deadline=10,
            what="the machine learning the replica started after its join",
        )

        assert doomed.process is not None
        doomed.process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        doomed.process.wait(timeout=10)

        # Linked to the survivor (it saved it first, so renewals and backups follow)
        # and listed online there, within 5 s of the kill.
        await apoll_until(
            lambda: _first_address(data) == survivor.link,
            deadline=5,
            what="the machine linked to the survivor",
        )
        async with survivor.admin() as admin:

            async def online_there() -> bool:
                listed = await admin.list_machines()
                return any(m.machine_id == machine_id and m.online for m in listed)

            await apoll_until(
                online_there,
                deadline=5 - (time.monotonic() - killed_at),
                what="listed online through the survivor within 5 s of the kill",
            )

            # Its roster (sent after the agent was made) decides the send.
            async def sent() -> str:
                try:
                    return (await admin.send_prompt(machine_id, agent, "hello")).prompt_id
                except NotFound:
                    return ""

            prompt = await apoll_until(sent, deadline=10, what="a prompt queued")

            async def acknowledged() -> bool:
                listed = (await admin.list_prompts(machine_id)).prompts
                return any(p.prompt_id == prompt and p.run_id for p in listed)

            await apoll_until(acknowledged, deadline=10, what="the prompt acknowledged")
        assert machine.poll() is None, "the machine still serves"
    finally:
        stop_process(machine, grace=10)
