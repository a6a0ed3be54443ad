"""Prompts for a stopped machine, for real: agents-control and agents-machine processes
on moto's S3 server (through the crash proxy, so the control plane can be killed
just before it deletes a delivered prompt).

A joined machine with two agents is stopped; 20 prompts are queued; the machine
is started and runs all 20, in order per agent, each exactly once; the queue is
empty afterwards; no object in the bucket holds a prompt's text. Then the
control plane is SIGKILLed after a delivery and before its delete: after its
restart the prompt is delivered again and still runs once.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import psutil
import pytest

from controlplane.cli.client import AdminClient
from shared.errors import (
    AgentsError,
    InvalidArgument,
    InvalidState,
    NotFound,
    QuotaExceeded,
    TooLarge,
)
from shared.ids import new_id
from tests.helpers.control_proc import (
    ControlProc,
    join_new_account,
    run_init,
    s3_env,
    start_serve,
    stop_serve,
)
from tests.helpers.fault_proxy import CrashProxy, crash_proxy
from tests.helpers.machine_proc import machine_env, run_cli
from tests.helpers.moto_server import free_port
from tests.helpers.poll import apoll_until

pytestmark = pytest.mark.integration

HEARTBEAT = 0.3
DEPTH = 20
DEADLINE = 30.0
MACHINE_EXE = Path(sys.executable).parent / "agents-machine"


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[CrashProxy]:
    with crash_proxy(moto_endpoint) as p:
        yield p


@pytest.fixture
def cp(tmp_path: Path, proxy: CrashProxy, s3_bucket: str) -> Iterator[ControlProc]:
    # Fixed ports (free ones): the machine must find the control plane again
    # after the crash test restarts it.
    ports = ["--listen", f"127.0.0.1:{free_port()}", "--link-listen", f"127.0.0.1:{free_port()}"]
    running = run_init(
        tmp_path / "home",
        f"s3://{s3_bucket}/cp",
        s3_env(proxy.url),
        ["--heartbeat-interval", str(HEARTBEAT), *ports],
    )
    # A small queue, so the test can fill it (the default is 1,000).
    with (running.home / "config.toml").open("a") as f:
        f.write(f"prompt_queue_depth = {DEPTH}\n")
    try:
        start_serve(running)
        yield running
    finally:
        proxy.disarm()
        stop_serve(running)


@contextlib.asynccontextmanager
async def admin(cp: ControlProc) -> AsyncIterator[AdminClient]:
    async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=15) as client:
        yield client


def _ok(res: Any) -> str:
    assert res.code == 0, res.err
    return str(res.out)


def _prompts(cp: ControlProc, machine_id: str) -> list[dict[str, Any]]:
    listed = json.loads(_ok(cp.cli("prompt", "list", "--machine", machine_id, "--json")))
    return list(listed["prompts"])


def _s3(endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing-secret",
        region_name="us-east-1",
    )


def _keys(endpoint: str, bucket: str) -> list[str]:
    pages = _s3(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _bucket(endpoint: str, bucket: str) -> dict[str, bytes]:
    """Every object in the bucket, key -> bytes, read straight from S3."""
    s3, out = _s3(endpoint), {}
    for key in _keys(endpoint, bucket):
        try:
            out[key] = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        except s3.exceptions.NoSuchKey:
            continue  # deleted since the listing (an intent, a presence write)
    return out


def _queue_keys(endpoint: str, bucket: str) -> list[str]:
    return [k for k in _keys(endpoint, bucket) if "/queue/" in k]


def _runs(data_dir: Path) -> list[tuple[str, str, str, str, float]]:
    """(agent, prompt, prompt id, state, started) of every run, by start time."""
    conn = sqlite3.connect(data_dir / "machine.db")
    try:
        rows = conn.execute(
            "SELECT agent_id, prompt, prompt_id, state, COALESCE(started_at, 0) FROM runs"
            " ORDER BY started_at, created_at"
        ).fetchall()
    finally:
        conn.close()
    return [tuple(r) for r in rows]  # type: ignore[misc]


async def _online(client: AdminClient, machine_id: str, want: bool) -> None:
    async def check() -> bool:
        return (await client.get_machine(machine_id)).online is want

    await apoll_until(check, deadline=DEADLINE, what=f"machine online={want}")


async def test_queued_prompts_run_once_in_order_and_survive_a_control_plane_crash(
    tmp_path: Path, cp: ControlProc, proxy: CrashProxy, moto_endpoint: str, s3_bucket: str
) -> None:
    data = tmp_path / "machine"
    joined = _join(cp, tmp_path, data)
    try:
        async with admin(cp) as client:
            machine_id = await apoll_until(
                lambda: next(iter(_machine_ids(cp)), None), deadline=DEADLINE, what="joined"
            )
            await _online(client, machine_id, True)
            agents = []
            for name in ("a", "b"):
                made = run_cli(data, "agent", "create", name, "--folder", str(tmp_path), "--json")
                assert made.returncode == 0, made.stderr
                agents.append(json.loads(made.stdout)["agent_id"])
            made = run_cli(data, "agent", "create", "c", "--folder", str(tmp_path), "--json")
            archived = json.loads(made.stdout)["agent_id"]
            assert run_cli(data, "agent", "archive", archived).returncode == 0
            joined.send_signal(signal.SIGTERM)
            assert joined.wait(timeout=DEADLINE) == 0
            await _online(client, machine_id, False)

            # 20 prompts for the stopped machine, alternating between its agents.
            texts = [f"queued secret {i:02d} for {agents[i % 2]}" for i in range(20)]
            first = _ok(
                cp.cli(
                    "prompt",
                    "send",
                    "--machine",
                    machine_id,
                    "--agent",
                    agents[0],
                    "--text",
                    texts[0],
                    "--idempotency-key",
                    "k0",
                )
            )
            assert re.match(r"prompt pr_[0-9a-z]{26} queued", first), first
            for i, text in enumerate(texts[1:], start=1):
                sent = await client.send_prompt(machine_id, agents[i % 2], text, f"k{i}")
                assert sent.state == "queued"
            again = await client.send_prompt(machine_id, agents[0], texts[0], "k0")
            assert again.prompt_id == first.split()[1]
            await _bad_input_queues_nothing(cp, client, machine_id, agents[0], archived)
            listed = _prompts(cp, machine_id)
            assert len(listed) == 20 and {p["state"] for p in listed} == {"queued"}
            for blob in _bucket(moto_endpoint, s3_bucket).values():
                assert b"queued secret" not in blob

            # The local provider starts the machine: setting it is enough, since
            # prompts wait (issue 34: before, it took another send); the machine
            # shows "starting".
            serve = [str(MACHINE_EXE), "--data-dir", str(data), "serve", "--no-background"]
            settings = json.dumps({"command": serve})
            _ok(cp.cli("machine", "provider", "set", machine_id, "local", "--settings", settings))

            async def starting() -> bool:
                return (await client.get_machine(machine_id)).starting

            await apoll_until(starting, deadline=DEADLINE, what="machine starting")

            # The CLI's listing shows it starting or, later, online: polled, since on
            # a loaded machine a single listing can fall between the two.
            def listed_starting_or_online() -> bool:
                listed = json.loads(_ok(cp.cli("machine", "list", "--json")))["machines"]
                return [m["starting"] or m["online"] for m in listed] == [True]

            await apoll_until(
                listed_starting_or_online, deadline=DEADLINE, what="listed starting or online"
            )

            async def drained() -> bool:
                states = [p["state"] for p in _prompts(cp, machine_id)]
                return states.count("acknowledged") == 20 and len(states) == 20

            await apoll_until(drained, deadline=DEADLINE, what="queue drained")
            runs = await apoll_until(
                lambda: (
                    (r := _runs(data)) and len(r) == 20 and all(x[3] == "finished" for x in r) and r
                ),
                deadline=DEADLINE,
                what="20 runs finished",
            )
            assert sorted(r[1] for r in runs) == sorted(texts)  # each exactly once
            for agent in agents:
                mine = [r[1] for r in runs if r[0] == agent]
                assert mine == [t for t in texts if t.endswith(agent)]  # in send order
            assert len({r[2] for r in runs}) == 20
            assert not [k for k in _queue_keys(moto_endpoint, s3_bucket)]
            # A send retried after its prompt was acknowledged (its reply lost)
            # answers that prompt, and queues (so runs) nothing.
            again = await client.send_prompt(machine_id, agents[0], texts[0], "k0")
            assert (again.prompt_id, again.state) == (first.split()[1], "acknowledged")
            assert again.run_id.startswith("run_")
            # The online machine refuses a prompt for its archived agent: the CLI
            # says why and exits 2, at the send and at a retried send alike.
            for _ in range(2):
                refused = cp.cli(
                    "prompt", "send", "--machine", machine_id, "--agent", archived,
                    "--text", "to an archived agent", "--idempotency-key", "k-archived",
                )  # fmt: skip
                assert refused.code == 2, refused.err
                assert re.fullmatch(
                    r"agents-control: prompt send: prompt pr_[0-9a-z]{26} was refused by the"
                    r" machine: .*archived.*\n",
                    refused.err,
                ), refused.err

            # The control plane dies after delivering, before deleting the entry.
            assert cp.process is not None
            proxy.arm_before(cp.process.pid, "DELETE", "/queue/")
            with contextlib.suppress(AgentsError):
                await client.send_prompt(machine_id, agents[1], "after the crash", "k-crash")
            assert proxy.crashed.wait(DEADLINE)
            cp.process.wait(timeout=DEADLINE)
            assert len(_queue_keys(moto_endpoint, s3_bucket)) == 1
        start_serve(cp)
        async with admin(cp) as client:
            await _online(client, machine_id, True)

            async def redelivered() -> bool:
                return not _queue_keys(moto_endpoint, s3_bucket)

            await apoll_until(redelivered, deadline=DEADLINE, what="redelivered and deleted")
            # The restarted control plane remembers the key from the store.
            again = await client.send_prompt(machine_id, agents[0], texts[0], "k0")
            assert (again.prompt_id, again.state) == (first.split()[1], "acknowledged")
            # Killed between the acknowledged prompt's record and its entry's
            # delete (the commit point): the record and the redelivery agree.
            crash_runs = [r for r in _runs(data) if r[1] == "after the crash"]
            assert len(crash_runs) == 1
            retried = await client.send_prompt(machine_id, agents[1], "after the crash", "k-crash")
            assert (retried.prompt_id, retried.state) == (crash_runs[0][2], "acknowledged")
        assert len(_runs(data)) == 21, "no retried key ran its prompt again"
    finally:
        if joined.poll() is None:
            joined.kill()
            joined.wait(timeout=DEADLINE)
        _kill_serving(data)


async def test_a_machine_killed_after_recording_a_prompt_before_its_ack_runs_it_once(
    tmp_path: Path, cp: ControlProc
) -> None:
    data = tmp_path / "machine"
    joined = _join(cp, tmp_path, data)
    serving: subprocess.Popen[bytes] | None = None
    try:
        async with admin(cp) as client:
            machine_id = await apoll_until(
                lambda: next(iter(_machine_ids(cp)), None), deadline=DEADLINE, what="joined"
            )
            await _online(client, machine_id, True)
            made = run_cli(data, "agent", "create", "a", "--folder", str(tmp_path), "--json")
            assert made.returncode == 0, made.stderr
            agent = json.loads(made.stdout)["agent_id"]
            joined.send_signal(signal.SIGTERM)
            assert joined.wait(timeout=DEADLINE) == 0
            await _online(client, machine_id, False)
            texts = [f"prompt {i} before the machine crash" for i in range(3)]
            ids = [(await client.send_prompt(machine_id, agent, t)).prompt_id for t in texts]

            # The machine stores the 2nd delivery durably, then SIGKILLs itself
            # before its acknowledgement is sent (the test-only fault hook).
            log = (tmp_path / "crash.log").open("wb")
            serving = subprocess.Popen(
                [str(MACHINE_EXE), "--data-dir", str(data), "serve", "--no-background"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=machine_env({"AGENTS_MACHINE_TEST_CRASH_AFTER_DELIVERIES": "2"}),
            )
            log.close()
            assert serving.wait(timeout=DEADLINE) == -signal.SIGKILL
            await _online(client, machine_id, False)
            recorded = [r[2] for r in _runs(data)]
            assert sorted(recorded) == sorted(ids[:2])  # the 2nd one is recorded...
            queued = {p["prompt_id"] for p in _prompts(cp, machine_id) if p["state"] == "queued"}
            assert {ids[1], ids[2]} <= queued  # ...and still queued: its ack never came

            # Restarted (no fault): the 2nd is delivered again, deduplicated, once.
            serving = subprocess.Popen(
                [str(MACHINE_EXE), "--data-dir", str(data), "serve", "--no-background"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=machine_env(),
            )

            async def drained() -> bool:
                states = [p["state"] for p in _prompts(cp, machine_id)]
                return states.count("acknowledged") >= 2 and "queued" not in states

            await apoll_until(drained, deadline=DEADLINE, what="queue drained")
            ended = ("finished", "interrupted")
            runs = await apoll_until(
                lambda: (r := _runs(data)) and len(r) == 3 and all(x[3] in ended for x in r) and r,
                deadline=DEADLINE,
                what="3 runs ended",
            )
            assert [r[2] for r in runs] == ids  # each once, in send order
            assert [r[1] for r in runs] == texts
            # The first may have been running when the machine died (interrupted,
            # never started again); the recorded-but-unacknowledged 2nd runs now.
            assert [r[3] for r in runs[1:]] == ["finished", "finished"]
    finally:
        for proc in (joined, serving):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=DEADLINE)


async def _bad_input_queues_nothing(
    cp: ControlProc, client: AdminClient, machine_id: str, agent_id: str, archived: str
) -> None:
    """Each refusal names the problem; the queue (full at DEPTH) is unchanged."""
    # The stopped machine's roster (it sent its agents' ids before it left).
    unknown = new_id("agent")
    with pytest.raises(NotFound, match=f"agent {unknown}"):
        await client.send_prompt(machine_id, unknown, "hi")
    with pytest.raises(InvalidState, match="archived on machine"):
        await client.send_prompt(machine_id, archived, "hi")
    with pytest.raises(QuotaExceeded, match=f"limit of {DEPTH}"):
        await client.send_prompt(machine_id, agent_id, "one too many")
    with pytest.raises(TooLarge, match="text: larger than the limit of 1048576 bytes"):
        await client.send_prompt(machine_id, agent_id, "x" * (1024 * 1024 + 1))
    with pytest.raises(NotFound, match="machine"):
        await client.send_prompt(new_id("machine"), agent_id, "hi")
    with pytest.raises(InvalidArgument, match="agent_id"):
        await client.send_prompt(machine_id, "not-an-agent", "hi")
    # Another account's admin: the machine answers like a missing one.
    other = re.search(
        r"account (acct_[0-9a-z]{26})",
        _ok(cp.cli("account", "create", "--github-id", "8", "--github-login", "other")),
    )
    assert other
    made = await client.create_credential(other.group(1), "other admin")
    async with AdminClient(cp.public, cp.ca_pem, made.credential, timeout=15) as theirs:
        with pytest.raises(NotFound, match=machine_id):
            await theirs.send_prompt(machine_id, agent_id, "hi")
        with pytest.raises(NotFound, match=machine_id):
            await theirs.list_prompts(machine_id)
    # The CLI: one line, exit 2 for an unreadable file; the status for the rest.
    res = cp.cli("prompt", "send", "--machine", machine_id, "--agent", agent_id, "--file", "/nope")
    assert res.code == 2 and "cannot read /nope" in res.err and "Traceback" not in res.err
    res = cp.cli("prompt", "send", "--machine", machine_id, "--agent", agent_id, "--text", "x")
    assert res.code != 0 and "limit of 20" in res.err and "Traceback" not in res.err


def _join(cp: ControlProc, tmp_path: Path, data: Path) -> subprocess.Popen[bytes]:
    """A new account, and a machine joined to it (serving in the foreground)."""
    return join_new_account(cp, data, tmp_path / "join.log", github_id=7, login="q")


def _kill_serving(data: Path) -> None:
    """Kill the machine the local provider started (its own session: it outlives
    the control plane, as a real one would)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if str(data) in cmd and "serve" in cmd:
            with contextlib.suppress(psutil.Error):
                proc.kill()
                proc.wait(timeout=DEADLINE)


def _machine_ids(cp: ControlProc) -> list[str]:
    listed = json.loads(_ok(cp.cli("machine", "list", "--json")))
    return [m["machine_id"] for m in listed["machines"]]
