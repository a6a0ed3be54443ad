"""Three control-plane replicas on one bucket, through a real nats-server (issue 36).

Real processes on loopback: moto, nats-server, three ``serve --cluster`` from
copies of one home, and 30 simulated machines (the real link protocol over real
TLS: tests.helpers.sim_links), each listing the three link addresses, and one
real ``agents-machine`` (its prompt, sent through another replica than its own,
is acknowledged by it). Admin
calls through every replica reach every machine; then one replica is
SIGKILLed: every machine is linked again within 5 s, prompts queued meanwhile
are delivered once, a deletion started on the killed replica completes, and
each periodic job under the lease ran once per due time across all three.
Then NATS stops: each replica keeps its own links, and a call that needs the
others is UNAVAILABLE naming NATS.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.errors import InvalidState, NotFound, TransientError
from tests.helpers.control_proc import ControlProc, join_new_account
from tests.helpers.machine_proc import run_cli
from tests.helpers.nats_proc import NatsProc, nats_binary
from tests.helpers.poll import apoll_until
from tests.helpers.processes import stop_process
from tests.helpers.replicas import serve_replicas
from tests.helpers.sim_links import SimMachine, join_sim

pytestmark = pytest.mark.skipif(nats_binary() is None, reason="nats-server not installed")

HEARTBEAT = 0.5
MACHINES = 30
#: The wake check's period here (seconds): several due times within the test.
WAKE_EVERY = 0.5
SLOT_LINE = re.compile(r"periodic job (\w+): slot (\d+) runs here")
#: Every job run under the lease (controlplane/server.py): each once per due time.
LEASE_JOBS = {"wake", "audit_retention", "alive_stamps"}


@pytest.fixture
def replicas(
    tmp_path: Path, s3_bucket: str, moto_endpoint: str, nats: NatsProc
) -> Iterator[list[ControlProc]]:
    with serve_replicas(
        tmp_path,
        s3_bucket,
        moto_endpoint,
        nats,
        3,
        heartbeat=HEARTBEAT,
        env={"AGENTS_CONTROL_LOG_LEVEL": "DEBUG"},
        config=[f"wake_check_seconds = {WAKE_EVERY}"],
    ) as procs:
        yield procs


def _slots(cp: ControlProc, job: str = "wake") -> list[int]:
    return [slot for name, slot in _runs(cp) if name == job]


def _runs(cp: ControlProc) -> list[tuple[str, int]]:
    """(job, slot) for each periodic job this replica ran under the lease."""
    assert cp.log_path is not None
    text = cp.log_path.read_text(errors="replace")
    return [(job, int(slot)) for job, slot in SLOT_LINE.findall(text)]


async def test_three_replicas_one_killed(
    replicas: list[ControlProc], nats: NatsProc, tmp_path: Path
) -> None:
    links = [cp.link for cp in replicas]
    # A real agents-machine too, linked to the third replica (never the one killed;
    # a real machine's move: tests/integration/test_machine_failover.py).
    real_data = tmp_path / "real-machine"
    real = join_new_account(
        replicas[2], real_data, tmp_path / "real.log", github_id=99, login="real"
    )
    async with replicas[0].admin() as admin:
        account = (await admin.create_account(36, "replicas")).account.account_id
        doomed = (await admin.create_account(37, "doomed")).account.account_id
        token = (await admin.create_token(account, max_uses=MACHINES)).token_value
        doomed_token = (await admin.create_token(doomed, max_uses=3)).token_value

    async def joined(i: int) -> SimMachine:
        cp = replicas[i % 3]  # joins through every replica
        value = token if i < MACHINES else doomed_token
        machine_id, cert, key = await join_sim(cp.public, cp.ca_pem, value)
        # Each lists the three link addresses, starting with the next replica's:
        # its join is confirmed by another replica than the one it joined through.
        first = (i + 1) % 3
        order = links[first:] + links[:first]
        return SimMachine(machine_id, cert, key, cp.ca_pem, order)

    sims = list(await asyncio.gather(*(joined(i) for i in range(MACHINES + 3))))
    tasks = [asyncio.create_task(sim.run()) for sim in sims]
    ours, theirs = sims[:MACHINES], sims[MACHINES:]
    try:
        await apoll_until(
            lambda: all(s.linked_to for s in sims), deadline=15, what="every machine linked"
        )
        assert {s.linked_to for s in sims} == set(links), "spread over the three"

        # Every replica lists every machine online, and reaches each with a prompt.
        sent: dict[str, list[str]] = {s.machine_id: [] for s in ours}
        for cp in replicas:
            async with cp.admin() as admin:
                listed = await admin.list_machines(account)
                assert len(listed) == MACHINES and all(m.online for m in listed), [
                    (m.machine_id, m.online) for m in listed if not m.online
                ]
                for sim in ours:
                    reply = await admin.send_prompt(sim.machine_id, "ag_" + "0" * 26, "hi")
                    sent[sim.machine_id].append(reply.prompt_id)
        await apoll_until(
            lambda: all(set(s.deliveries) == set(sent[s.machine_id]) for s in ours),
            deadline=15,
            what="every prompt through every replica delivered",
        )

        # A key rotation would change one replica's home only: refused.
        async with replicas[1].admin() as admin:
            with pytest.raises(InvalidState, match="one of several replicas"):
                await admin.rotate_server_certificate()

        # The real machine, reached through another replica than its own.
        async with replicas[0].admin() as admin:

            async def real_online() -> str:
                for m in await admin.list_machines():
                    if m.hostname != "sim" and m.online:
                        return m.machine_id
                return ""

            real_id = await apoll_until(real_online, deadline=30, what="the real machine online")
        made = run_cli(real_data, "agent", "create", "r", "--folder", str(tmp_path), "--json")
        assert made.returncode == 0, made.stderr
        agent = json.loads(made.stdout)["agent_id"]
        async with replicas[0].admin() as admin:
            # Its roster (sent after the agent was made) decides the send: retried
            # until the control plane has it.
            async def sent_real() -> str:
                try:
                    return (await admin.send_prompt(real_id, agent, "hello")).prompt_id
                except NotFound:
                    return ""

            real_prompt = await apoll_until(sent_real, deadline=15, what="a prompt queued")
        async with replicas[2].admin() as admin:

            async def acknowledged() -> bool:
                listed = (await admin.list_prompts(real_id)).prompts
                return any(p.prompt_id == real_prompt and p.run_id for p in listed)

            await apoll_until(acknowledged, deadline=20, what="the real machine's ack")

        # A revoke through a replica the machine is not linked to reaches it.
        revoked = ours[-1]
        other = next(cp for cp in replicas if cp.link != revoked.linked_to)
        async with other.admin() as admin:
            await admin.revoke_machine(revoked.machine_id)
        await apoll_until(lambda: revoked.stopped == "revoked", deadline=10, what="revoked")
        live = ours[:-1]

        # Kill the replica holding the most links, right after it started a deletion.
        victim = max(replicas[:2], key=lambda cp: sum(s.linked_to == cp.link for s in sims))
        survivors = [cp for cp in replicas if cp is not victim]
        async with victim.admin() as admin:
            await admin.delete_account(doomed)
        assert victim.process is not None
        victim.process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        victim.process.wait(timeout=10)
        slot_at_kill = int(time.time() // WAKE_EVERY)

        # Prompts queued while its machines move.
        queued: dict[str, str] = {}
        async with survivors[0].admin() as admin:
            for sim in live:
                reply = await admin.send_prompt(sim.machine_id, "ag_" + "1" * 26, "again")
                queued[sim.machine_id] = reply.prompt_id

        await apoll_until(
            lambda: all(s.linked_to in (survivors[0].link, survivors[1].link) for s in live),
            deadline=5 - (time.monotonic() - killed_at),
            what="every machine linked to a survivor within 5 s of the kill",
        )
        async with survivors[1].admin() as admin:

            async def all_online() -> bool:
                listed = await admin.list_machines(account)
                return all(m.online for m in listed if not m.revoked)

            await apoll_until(all_online, deadline=5, what="listed online")
            done = await apoll_until(
                lambda: _deleted(admin, doomed), deadline=20, what="the deletion completed"
            )
            assert done
        await apoll_until(
            lambda: all(queued[s.machine_id] in s.deliveries for s in live),
            deadline=10,
            what="prompts queued during the move delivered",
        )
        for sim in live:
            assert max(sim.deliveries.values()) == 1, (sim.machine_id, sim.deliveries)
        assert all(s.stopped or not s.linked_to for s in theirs)

        # Each periodic job ran once per due time, across the three, before and after
        # (the wake check's short period gives several; the others' one or two).
        await apoll_until(
            lambda: max(_slots(survivors[0]) + _slots(survivors[1]), default=0) > slot_at_kill + 2,
            deadline=10,
            what="the wake check running after the kill",
        )
        ran = Counter(run for cp in replicas for run in _runs(cp))
        assert {job for job, _slot in ran} == LEASE_JOBS, ran
        assert max(ran.values()) == 1, [run for run, n in ran.items() if n > 1]

        # NATS gone: each replica keeps its own links; a listing (which needs the
        # others) is UNAVAILABLE naming NATS; a prompt to a machine linked here goes.
        nats.stop()
        here = survivors[0]
        local = [s for s in live if s.linked_to == here.link]
        assert local
        async with here.admin() as admin:

            async def refused() -> bool:
                try:
                    await admin.list_machines(account)
                except TransientError as e:
                    return "NATS" in str(e)
                return False

            await apoll_until(refused, deadline=10, what="UNAVAILABLE naming NATS")
            reply = await admin.send_prompt(local[0].machine_id, "ag_" + "2" * 26, "local")
        await apoll_until(
            lambda: reply.prompt_id in local[0].deliveries, deadline=10, what="delivered here"
        )
        assert all(s.linked_to == here.link for s in local), "links kept without NATS"
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stop_process(real, grace=10)


async def _deleted(admin: object, account_id: str) -> bool:
    from controlplane.cli.client import AdminClient

    assert isinstance(admin, AdminClient)
    return (await admin.get_deletion(account_id)).state == "deleted"
