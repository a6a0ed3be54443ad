"""Account deletion for real: moto's S3 server, agents-control and agents-machine processes.

Two accounts; about 10,000 objects in the one deleted (written straight into
the bucket, sealed as the control plane seals them). The control plane is
SIGKILLed midway through the deletion (by the crash proxy, right after S3
took its fourth batch delete) and started again: the deletion finishes with no
operator action. Counts by prefix before and after show every object and index
entry of the deleted account gone and every object of the other one kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import grpc
import pytest
from botocore.config import Config

from controlplane.cli.admin_types import NewJoinToken
from controlplane.cli.client import AdminClient
from controlplane.integrity.keys import load_home_keys
from controlplane.integrity.trusted import record_mac_key
from machine.link.client import LinkClient
from shared.errors import NotFound
from shared.store.authenticated import seal
from tests.helpers.control_proc import ControlProc, run_init, s3_env, start_serve, stop_serve
from tests.helpers.fault_proxy import CrashProxy, crash_proxy
from tests.helpers.link_client import join
from tests.helpers.poll import apoll_until
from tests.helpers.store_records import read_json

pytestmark = pytest.mark.integration

HEARTBEAT = 0.3
OBJECTS = 10_000
KEPT_OBJECTS = 300
#: About the deletion issue 34 reported (4,007 objects): four batches and a bit.
COUNTED_OBJECTS = 4_000
PREFIX = "cp/"
MACHINE_EXE = Path(sys.executable).parent / "agents-machine"
DEADLINE = 60.0


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[CrashProxy]:
    with crash_proxy(moto_endpoint) as p:
        yield p


@pytest.fixture
def cp(tmp_path: Path, proxy: CrashProxy, s3_bucket: str) -> Iterator[ControlProc]:
    running = run_init(
        tmp_path / "home",
        f"s3://{s3_bucket}/cp",
        s3_env(proxy.url),
        ["--heartbeat-interval", str(HEARTBEAT)],
    )
    try:
        start_serve(running)
        yield running
    finally:
        proxy.disarm()
        stop_serve(running)


@pytest.fixture
def s3(moto_endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing-secret",
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=16),
    )


def _keys(s3: Any, bucket: str, prefix: str) -> list[str]:
    out: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out.extend(item["Key"] for item in page.get("Contents", []))
    return out


def _pointing_to(s3: Any, bucket: str, account_id: str) -> list[str]:
    """Index entries and credentials whose record names ``account_id``."""
    out = []
    for key in _keys(s3, bucket, PREFIX + "index/") + _keys(s3, bucket, PREFIX + "credentials/"):
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        if account_id in key or read_json(body).get("account_id") == account_id:
            out.append(key)
    return out


def _fill(s3: Any, bucket: str, home: Path, account_id: str, count: int) -> None:
    """``count`` sealed objects under the account's prefix, 16 writers at once."""
    mac = record_mac_key(load_home_keys(home))

    def put(i: int) -> None:
        key = f"accounts/{account_id}/backups/seg_{i:06d}.json"
        body = seal(mac, key, json.dumps({"n": i}).encode())
        s3.put_object(Bucket=bucket, Key=PREFIX + key, Body=body)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(count)))


async def _until(pred: Callable[[], Any], what: str, timeout: float = DEADLINE) -> None:
    await apoll_until(pred, deadline=timeout, what=what, step=0.05)


def _machine_argv(reply: NewJoinToken, data_dir: Path) -> list[str]:
    return [
        str(MACHINE_EXE),
        "join",
        reply.join_address,
        "--token",
        reply.token_value,
        "--ca-hash",
        reply.ca_hash,
        "--data-dir",
        str(data_dir),
    ]


def _machine_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}


# 10,000 objects through moto took 110 s of the 120 s default on a slower box.
@pytest.mark.timeout(300)
async def test_account_deletion_survives_a_crash_and_keeps_the_other_account(
    cp: ControlProc, proxy: CrashProxy, s3: Any, s3_bucket: str, tmp_path: Path
) -> None:
    log = tmp_path / "machine.log"
    machine: subprocess.Popen[bytes] | None = None
    try:
        async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=10) as client:
            gone = (await client.create_account(101, "gone")).account.account_id
            kept = (await client.create_account(202, "kept")).account.account_id
            await client.create_credential(gone, "gone admin")
            await client.create_credential(kept, "kept admin")
            await client.create_token(kept)
            spare = await client.create_token(gone)  # never used: refused after the deletion
            joined = await client.create_token(gone)
            data_dir = tmp_path / "machine"
            with log.open("wb") as out:
                machine = subprocess.Popen(
                    _machine_argv(joined, data_dir),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=_machine_env(),
                )

            async def online() -> bool:
                listed = await client.list_machines(gone)
                return bool(listed and listed[0].online)

            await _until(online, "machine online")

        _fill(s3, s3_bucket, cp.home, gone, OBJECTS)
        _fill(s3, s3_bucket, cp.home, kept, KEPT_OBJECTS)
        gone_before = _keys(s3, s3_bucket, f"{PREFIX}accounts/{gone}/")
        kept_before = _keys(s3, s3_bucket, f"{PREFIX}accounts/{kept}/")
        kept_index = _pointing_to(s3, s3_bucket, kept)
        gone_index = _pointing_to(s3, s3_bucket, gone)
        assert len(gone_before) > OBJECTS and len(kept_before) > KEPT_OBJECTS
        # listing, GitHub id, machine, two tokens, one credential
        assert len(gone_index) == 6, gone_index

        # Killed once S3 took the fourth batch delete: the index entries', then
        # three of 1000 (more in flight, each counted in the tombstone first).
        assert cp.process is not None
        proxy.arm_after_batches(cp.process.pid, 4)
        async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=10) as client:
            started = await client.delete_account(gone)
        assert started.state == "deleting" and started.deleted_by
        assert await asyncio.to_thread(proxy.crashed.wait, DEADLINE), proxy.writes
        cp.process.wait(timeout=10)
        midway = _keys(s3, s3_bucket, f"{PREFIX}accounts/{gone}/")
        assert 0 < len(midway) < len(gone_before) - 2000, len(midway)
        assert f"{PREFIX}accounts/{gone}/deleting.json" in midway

        # The machine was told before the crash: it stops for good and keeps its data.
        await _until(lambda: "stopped for good" in log.read_text(errors="replace"), "told")
        assert machine.poll() is None, log.read_text()
        assert (data_dir / "machine.db").exists()

        start_serve(cp)  # no operator action besides the restart itself
        async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=10) as client:

            async def deleted() -> bool:
                return (await client.get_deletion(gone)).state == "deleted"

            await _until(deleted, "deletion finished after the restart")
            done = await client.get_deletion(gone)
            assert done.deleted_by == started.deleted_by and done.finished_at
            with pytest.raises(NotFound):
                await client.get_account(gone)
            with pytest.raises(NotFound):
                await client.get_deletion("acct_" + "1" * 26)
            assert [a.account_id for a in await client.list_accounts()] == [kept]

        assert _keys(s3, s3_bucket, f"{PREFIX}accounts/{gone}/") == []
        assert _pointing_to(s3, s3_bucket, gone) == []
        # The restarted daemon counted the run it finished and what it deleted.
        url = f"http://{cp.serve_info['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            metrics = r.read().decode()
        assert 'agents_cp_account_deletions_total{result="ok"} 1.0' in metrics
        found = re.search(r"^agents_cp_account_deletion_objects_total (\S+)$", metrics, re.M)
        # Batches in flight when the proxy killed the daemon may land after the
        # midway count, and may even leave nothing but the records for the restart
        # (the deletion pipelines several): so at most what was left, maybe 0.
        assert found and 0 <= float(found.group(1)) <= len(midway) - 2, metrics
        assert _keys(s3, s3_bucket, f"{PREFIX}accounts/{kept}/") == kept_before
        assert _pointing_to(s3, s3_bucket, kept) == kept_index
        assert _keys(s3, s3_bucket, f"{PREFIX}deleted/") == [f"{PREFIX}deleted/{gone}.json"]
        assert _keys(s3, s3_bucket, f"{PREFIX}cp/intents/") == []

        # The deleted account's unused token is refused; the machine did not come back.
        res = subprocess.run(
            # The restarted daemon listens on a new port.
            _machine_argv(dataclasses.replace(spare, join_address=cp.public), tmp_path / "late"),
            capture_output=True,
            text=True,
            timeout=60,
            env=_machine_env(),
        )
        assert res.returncode != 0 and re.search("unknown token", res.stderr), res.stderr
        assert "Traceback" not in res.stderr
        assert machine.poll() is None and (data_dir / "machine.db").exists()
        assert "stopped for good" in log.read_text(errors="replace")
    finally:
        if machine is not None and machine.poll() is None:
            machine.kill()
            machine.wait(timeout=15)


@pytest.mark.timeout(300)
async def test_a_deletion_killed_midway_reports_every_object_it_deleted(
    cp: ControlProc, proxy: CrashProxy, s3: Any, s3_bucket: str
) -> None:
    """Issue 34: after a crash, the count covered only the resumed run (1,008
    reported for about 4,007 deleted). The daemon is SIGKILLed right after S3 took
    its third batch delete (the index entries', then two of the listing's, with
    more in flight); the next start finishes the deletion and reports them all."""
    async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=10) as client:
        gone = (await client.create_account(404, "counted")).account.account_id
    _fill(s3, s3_bucket, cp.home, gone, COUNTED_OBJECTS)
    before = _keys(s3, s3_bucket, f"{PREFIX}accounts/{gone}/")
    assert f"{PREFIX}accounts/{gone}/account.json" in before  # not counted: a record

    assert cp.process is not None
    proxy.arm_after_batches(cp.process.pid, 3)
    async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=10) as client:
        await client.delete_account(gone)
    assert await asyncio.to_thread(proxy.crashed.wait, DEADLINE)
    cp.process.wait(timeout=10)
    midway = _keys(s3, s3_bucket, f"{PREFIX}accounts/{gone}/")
    assert 0 < len(midway) < len(before) - 1000, len(midway)  # a batch or more is gone

    start_serve(cp)
    async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=10) as client:

        async def deleted() -> bool:
            return (await client.get_deletion(gone)).state == "deleted"

        await _until(deleted, "deletion finished after the restart")
        done = await client.get_deletion(gone)
    assert _keys(s3, s3_bucket, f"{PREFIX}accounts/{gone}/") == []
    assert done.deleted_objects == len(before) - 1, (done.deleted_objects, len(before))


async def test_delete_refusals_on_the_cli(cp: ControlProc) -> None:
    never = "acct_" + "1" * 26
    res = cp.cli("account", "delete", never)
    assert res.code != 0 and "not found" in res.err.lower() and len(res.err.splitlines()) == 1
    res = cp.cli("account", "deletion", "nope")
    assert res.code != 0 and "account_id" in res.err and len(res.err.splitlines()) == 1
    created = cp.cli("account", "create", "--github-id", "9", "--github-login", "nine", "--json")
    acct = json.loads(created.out)["account_id"]
    res = cp.cli("account", "deletion", acct)
    assert res.code != 0 and "not being deleted" in res.err
    res = cp.cli("account", "delete", acct, "--wait", "--json")
    assert res.code == 0, res.err
    shown = json.loads(res.out)
    assert shown["state"] == "deleted" and shown["account_id"] == acct
    again = json.loads(cp.cli("account", "deletion", acct, "--json").out)
    assert again == shown


async def test_uploads_that_outlast_the_deletion_keep_nothing_even_when_killed_midway(
    cp: ControlProc, proxy: CrashProxy, s3: Any, s3_bucket: str
) -> None:
    """Segment uploads authorized before an account's deletion whose bytes arrive
    after it finished: the control plane writes the segment, then looks for the
    deletion and deletes what it wrote (PERMISSION_DENIED). Killed between that
    write and that look, the object stays: ``fsck`` names it ``deleted_leftover``
    and ``--repair`` removes it."""
    async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=10) as admin:
        gone = (await admin.create_account(303, "late")).account.account_id
        token = await admin.create_token(gone)
    machine_id, cert, key = await join(cp.public, cp.ca_pem, token.token_value)
    names = ["ab" * 32, "cd" * 32]
    gates = [asyncio.Event(), asyncio.Event()]

    async def stream(gate: asyncio.Event) -> AsyncIterator[bytes]:
        yield b"sealed bytes, "
        await gate.wait()  # the rest arrives after the deletion
        yield b"the rest"

    client = LinkClient.mutual(cp.link, ca_pem=cp.ca_pem, key_pem=key, cert_pem=cert)
    try:
        uploads = [
            asyncio.create_task(client.put_segment(n, 0, stream(g), timeout=60))
            for n, g in zip(names, gates, strict=True)
        ]
        for name in names:  # authorized, and looking for the segment before storing it
            await _until(lambda n=name: proxy.seen("HEAD", f"/segments/{n}"), "uploads under way")
        async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=10) as admin:
            await admin.delete_account(gone)

            async def deleted() -> bool:
                return (await admin.get_deletion(gone)).state == "deleted"

            await _until(deleted, "deletion finished")
        gates[0].set()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await uploads[0]
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert _keys(s3, s3_bucket, f"{PREFIX}accounts/{gone}/") == []
        assert cp.process is not None
        proxy.arm_after(cp.process.pid, "PUT", f"/segments/{names[1]}")
        gates[1].set()
        with pytest.raises(grpc.aio.AioRpcError):
            await uploads[1]  # the daemon died right after the segment's write
        assert proxy.crashed.is_set()
        cp.process.wait(timeout=10)
    finally:
        await client.aclose()
    late = f"accounts/{gone}/backups/{machine_id}/segments/{names[1]}"
    assert _keys(s3, s3_bucket, f"{PREFIX}accounts/{gone}/") == [PREFIX + late]

    start_serve(cp)
    found = cp.cli("fsck", "--json")
    assert found.code == 1, found.err
    findings = json.loads(found.out)["findings"]
    assert [(f["kind"], f["key"]) for f in findings] == [("deleted_leftover", late)]
    stop_serve(cp)
    repaired = cp.cli("fsck", "--repair", "--json")
    assert repaired.code == 0, repaired.err
    assert _keys(s3, s3_bucket, f"{PREFIX}accounts/{gone}/") == []
    assert cp.cli("fsck").code == 0
