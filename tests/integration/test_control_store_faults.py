"""The control plane when its store fails, is swapped, or is not this deployment's.

Real processes: a dedicated moto S3 server (so the test can SIGSTOP it, kill it
and start an empty one on the same port), ``agents-control init`` + ``serve``,
and the admin CLI. A machine joins and connects over real mutual TLS.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import grpc
import grpc.aio
import pytest
from botocore.config import Config

from tests.helpers.control_proc import (
    CliResult,
    ControlProc,
    agents_control_exe,
    run_init,
    s3_env,
    start_serve,
    stop_serve,
)
from tests.helpers.link_client import connect_once, join
from tests.helpers.machine_proc import AGENTS_MACHINE, MachineProc
from tests.helpers.moto_server import free_port, start_moto
from tests.helpers.poll import apoll_until

pytestmark = pytest.mark.integration

HEARTBEAT = 0.3
#: controlplane.integrity.trusted.STORE_CALL_DEADLINE, plus the CLI's own start-up.
ANSWER_WITHIN = 9.0
BUCKET = "faults"


def _s3(endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing-secret",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )


class Store:
    """A moto server of our own on a fixed port, that can be frozen, killed and replaced."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *, bucket: bool = True) -> None:
        self.proc = start_moto(self.port)
        if bucket:
            client = _s3(self.url)
            client.create_bucket(Bucket=BUCKET)
            client.close()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def snapshot(self) -> dict[str, bytes]:
        client = _s3(self.url)
        out = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
            for item in page.get("Contents", []):
                out[item["Key"]] = client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read()
        client.close()
        return out

    def restore(self, objects: dict[str, bytes]) -> None:
        client = _s3(self.url)
        for key, body in objects.items():
            client.put_object(Bucket=BUCKET, Key=key, Body=body)
        client.close()


@pytest.fixture
def store() -> Iterator[Store]:
    s = Store()
    s.start()
    try:
        yield s
    finally:
        if s.proc is not None:
            s.proc.send_signal(signal.SIGCONT)
        s.kill()


@pytest.fixture
def cp(tmp_path: Path, store: Store) -> Iterator[ControlProc]:
    running = run_init(
        tmp_path / "home",
        f"s3://{BUCKET}/cp",
        s3_env(store.url),
        ["--heartbeat-interval", str(HEARTBEAT)],
    )
    try:
        start_serve(running)
        yield running
    finally:
        stop_serve(running)


def _unavailable_faults(cp: ControlProc) -> float:
    url = f"http://{cp.serve_info['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    pattern = r'^agents_cp_store_errors_total\{[^}]*outcome="unavailable"[^}]*\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def _timed(cp: ControlProc, *args: str) -> tuple[CliResult, float]:
    start = time.monotonic()
    res = cp.cli(*args, timeout=40)
    return res, time.monotonic() - start


async def _until_ok(cp: ControlProc, deadline: float, what: str) -> None:
    last = [cp.cli("account", "list")]

    def ok() -> bool:
        last[0] = cp.cli("account", "list")
        return last[0].code == 0

    fail = lambda: AssertionError(f"{what}: {last[0].err}")  # noqa: E731
    await apoll_until(ok, deadline=deadline, what=what, step=0.3, fail=fail)


async def _joined_machine(cp: ControlProc) -> tuple[str, bytes, bytes]:
    res = cp.cli("account", "create", "--github-id", "7", "--github-login", "s", "--json")
    assert res.code == 0, res.err
    acct = json.loads(res.out)["account_id"]
    made = cp.cli("token", "create", "--account", acct, "--json")
    assert made.code == 0, made.err
    machine = await join(cp.public, cp.ca_pem, json.loads(made.out)["token_value"])
    await connect_once(cp.link, cp.ca_pem, machine[1], machine[2])
    return machine


async def test_frozen_and_gone_store_answer_unavailable_then_recover(
    cp: ControlProc, store: Store
) -> None:
    assert cp.cli("account", "list").code == 0
    assert store.proc is not None
    where = f"store s3://{BUCKET}/cp/"

    store.proc.send_signal(signal.SIGSTOP)
    res, took = _timed(cp, "account", "list")
    assert res.code == 1 and where in res.err and "no answer within" in res.err, res.err
    assert took < ANSWER_WITHIN, took
    assert len(res.err.strip().splitlines()) == 1, res.err
    # Counted as a store fault, so the "store errors" alert sees a frozen store.
    assert _unavailable_faults(cp) >= 1
    store.proc.send_signal(signal.SIGCONT)
    await _until_ok(cp, 15, "after SIGCONT")

    # Gone: nothing listens on the port.
    snapshot = store.snapshot()
    store.kill()
    res, took = _timed(cp, "account", "list")
    assert res.code == 1 and where in res.err, res.err
    assert took < ANSWER_WITHIN, took
    # Back, with its contents: the daemon recovers by itself.
    store.start()
    store.restore(snapshot)
    await _until_ok(cp, 15, "after the store came back")


async def test_store_swapped_while_serving_refuses_then_resumes(
    cp: ControlProc, store: Store
) -> None:
    machine_id, cert, key = await _joined_machine(cp)
    snapshot = store.snapshot()

    # The store is replaced by an empty one (same endpoint, same bucket name).
    store.kill()
    store.start()
    res, took = _timed(cp, "account", "list")
    # Right after the swap, too: every "not found" is confirmed by a fresh look
    # at the marker (DeploymentGuard.confirm_missing), never "unknown credential".
    assert res.code == 1, res.err
    assert "cp/deployment.json is missing" in res.err and f"s3://{BUCKET}/cp/" in res.err
    assert took < ANSWER_WITHIN
    # The machine is told the store cannot be trusted, never "unknown machine".
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await connect_once(cp.link, cp.ca_pem, cert, key)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    assert "deployment.json" in (info.value.details() or "")
    # Nothing was written into the wrong store.
    assert store.snapshot() == {}

    # The right store is back: everything resumes, the machine keeps its identity.
    store.restore(snapshot)
    await _until_ok(cp, 15, "after the right store came back")
    await connect_once(cp.link, cp.ca_pem, cert, key)
    shown = cp.cli("machine", "show", machine_id)
    assert shown.code == 0, shown.err


def test_serve_refuses_an_empty_or_foreign_store(
    cp: ControlProc, store: Store, tmp_path: Path
) -> None:
    stop_serve(cp)
    client = _s3(store.url)
    client.create_bucket(Bucket="other")
    client.close()
    argv = [str(agents_control_exe()), "serve", "--home", str(cp.home)]

    def serve(url: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*argv, "--store", url], env=cp.env, capture_output=True, text=True, timeout=60
        )

    empty = serve("s3://other/cp")
    assert empty.returncode == 1
    last = empty.stderr.strip().splitlines()[-1]
    assert "cp/deployment.json is missing" in last and "s3://other/cp/" in last, empty.stderr
    assert "Restore" in last
    assert empty.stderr.count("deployment.json is missing") == 1, empty.stderr

    # Another deployment's store: its marker does not verify under our key.
    run_init(tmp_path / "other-home", "s3://other/cp", s3_env(store.url))
    foreign = serve("s3://other/cp")
    assert foreign.returncode == 1
    assert "not authentic" in foreign.stderr.strip().splitlines()[-1], foreign.stderr

    # The right store still serves.
    start_serve(cp)
    assert cp.cli("account", "list").code == 0


def test_missing_bucket_is_failed_precondition_naming_the_store(
    cp: ControlProc, store: Store
) -> None:
    client = _s3(store.url)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for item in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=item["Key"])
    client.delete_bucket(Bucket=BUCKET)
    client.close()
    res, _ = _timed(cp, "account", "list")
    assert res.code in (1, 2), res.err
    assert "bucket does not exist" in res.err and f"s3://{BUCKET}/cp/" in res.err, res.err
    assert "internal error" not in res.err


def _store_faults(cp: ControlProc) -> float:
    url = f"http://{cp.serve_info['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(v) for v in re.findall(r"^agents_cp_store_errors_total\{.*\} (\S+)$", text, re.M)
    )


async def test_a_bucket_removed_while_serving_is_one_warning_per_loop_and_no_traceback(
    cp: ControlProc, store: Store
) -> None:
    """Issue 34: while the bucket was gone the log filled with tracebacks
    (``controlplane.wake``: NoSuchBucket, StoreMisconfigured) and a self-check
    warning per heartbeat. Now each periodic loop says it once, without a
    traceback, and once more when the store is back."""
    stop_serve(cp)  # again with every periodic job ticking fast
    with (cp.home / "config.toml").open("a") as f:
        f.write("wake_check_seconds = 0.3\nclock_check_seconds = 0.3\n")
    start_serve(cp)
    await _joined_machine(cp)  # an offline machine for the waker and the offline gauge
    snapshot: dict[str, bytes] = {}
    client = _s3(store.url)

    def removed() -> bool:
        # The daemon may write meanwhile (BucketNotEmpty): what it wrote is kept too.
        taken = store.snapshot()
        snapshot.update(taken)
        for key in taken:
            client.delete_object(Bucket=BUCKET, Key=key)
        try:
            client.delete_bucket(Bucket=BUCKET)
        except client.exceptions.ClientError as e:
            if e.response["Error"]["Code"] != "BucketNotEmpty":
                raise
            return False
        return True

    await apoll_until(removed, deadline=30, what="the bucket removed")
    assert cp.log_path is not None
    log = cp.log_path

    def gone_warning() -> bool:
        return "the bucket does not exist (NoSuchBucket)" in log.read_text()

    await apoll_until(gone_warning, deadline=30, what="a warning naming the store problem")
    # Many more failed ticks (the self-check's alone every 0.3 s).
    faults = _store_faults(cp)
    await apoll_until(lambda: _store_faults(cp) >= faults + 20, deadline=30, what="failed ticks")

    client.create_bucket(Bucket=BUCKET)
    client.close()
    store.restore(snapshot)
    await apoll_until(
        lambda: "self-check: works again" in log.read_text(),
        deadline=30,
        what="the recovery line",
    )
    await _until_ok(cp, 15, "after the bucket came back")
    stop_serve(cp)
    text = log.read_text()
    assert "Traceback" not in text, text
    warned = [
        line.split(" ", 2)[2]  # without the time stamp
        for line in text.splitlines()
        if " WARNING " in line and "NoSuchBucket" in line
    ]
    assert warned and len(warned) == len(set(warned)), text  # each loop says it once
    assert any(line.startswith("WARNING controlplane.server: self-check: ") for line in warned)
    assert text.count("self-check: works again") == 1, text


async def test_real_machine_keeps_identity_through_a_swapped_store(
    cp: ControlProc, store: Store, tmp_path: Path
) -> None:
    """A machine that reconnects while the store is swapped is told UNAVAILABLE, keeps
    trying with its identity, and is back online once the right store is back."""
    res = cp.cli("account", "create", "--github-id", "8", "--github-login", "r", "--json")
    assert res.code == 0, res.err
    acct = json.loads(res.out)["account_id"]
    made = json.loads(cp.cli("token", "create", "--account", acct, "--json").out)
    data_dir = tmp_path / "machine"
    log = tmp_path / "join.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    with log.open("wb") as out:
        joining = subprocess.Popen(
            [
                str(AGENTS_MACHINE),
                *shlex.split(made["join_command"])[1:],
                "--data-dir",
                str(data_dir),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        await _until(lambda: _status(cp, acct) == "online", 30, "joined machine online")
    finally:
        joining.kill()
        joining.wait(timeout=10)
    machine_id = _machine_ids(cp, acct)[0]
    snapshot = store.snapshot()

    store.kill()
    store.start()  # an empty store where this deployment's was
    machine = MachineProc(data_dir)
    machine.start()
    try:
        await _until(
            lambda: "deployment.json is missing" in machine.log(), 30, "machine told UNAVAILABLE"
        )
        store.restore(snapshot)
        await _until(lambda: _status(cp, acct) == "online", 40, "machine back online")
        assert _machine_ids(cp, acct) == [machine_id]
        assert "stopped for good" not in machine.log()
        assert "unknown machine" not in machine.log()
    finally:
        machine.kill()


def _machines(cp: ControlProc, acct: str) -> list[Any]:
    res = cp.cli("machine", "list", "--account", acct, "--json")
    return list(json.loads(res.out)["machines"]) if res.code == 0 else []


def _machine_ids(cp: ControlProc, acct: str) -> list[str]:
    return [m["machine_id"] for m in _machines(cp, acct)]


def _status(cp: ControlProc, acct: str) -> str:
    machines = _machines(cp, acct)
    return "online" if machines and machines[0]["online"] else "offline"


async def _until(check: Any, deadline: float, what: str) -> None:
    await apoll_until(
        check, deadline=deadline, what=what, step=0.3, fail=lambda: AssertionError(what)
    )
