"""Backups of joined machines kept by a real control plane on moto's S3 server.

The backup engine runs with :class:`machine.backups.targets.control_plane.ControlPlaneTarget`
over a real mutual-TLS link: backup, list, verify, fetch, prune; a machine of
another account sees nothing (NOT_FOUND, as for a missing machine); a machine
of the same account may read (the replacement-box case); no plaintext lands in
the bucket; a backup planted in the bucket (sealed to the account's recovery
key, but without the control plane's MAC) is refused.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from controlplane.cli.client import AdminClient
from machine.backups.engine import BackupEngine
from machine.backups.targets.control_plane import ControlPlaneTarget
from machine.formats.backup import BackupManifest, seal_manifest
from machine.link.client import LinkClient
from shared.backup_target import MAX_LINK_MANIFEST
from shared.crypto import BoxKeyPair
from shared.errors import IntegrityError, NotFound, TooLarge
from shared.ids import id_time_ms, new_id
from shared.pb.control.v1 import link_pb2, link_pb2_grpc
from tests.conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY, _s3_client
from tests.helpers.control_proc import ControlProc, control_plane
from tests.helpers.link_client import connect_once, join
from tests.machine.backups.test_backup_engine import Clock, FakeSource

pytestmark = pytest.mark.integration


@pytest.fixture
def cp(tmp_path: Path, moto_endpoint: str, s3_bucket: str) -> Iterator[ControlProc]:
    env = {
        "AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": TEST_SECRET_KEY,
        "AGENTS_CONTROL_STORE_ENDPOINT": moto_endpoint,
    }
    with control_plane(
        tmp_path / "cp-home",
        f"s3://{s3_bucket}/cp",
        env,
    ) as proc:
        yield proc


async def _machine(cp: ControlProc, account_id: str) -> tuple[str, bytes, bytes]:
    async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=10) as admin:
        token = await admin.create_token(account_id)
    machine_id, cert, key = await join(cp.public, cp.ca_pem, token.token_value)
    await connect_once(cp.link, cp.ca_pem, cert, key)  # confirms the join
    return machine_id, cert, key


async def _account(cp: ControlProc, github_id: int) -> str:
    async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=10) as admin:
        reply = await admin.create_account(github_id, f"user{github_id}")
    return reply.account.account_id


@asynccontextmanager
async def _link(cp: ControlProc, cert: bytes, key: bytes) -> AsyncIterator[LinkClient]:
    client = LinkClient.mutual(cp.link, ca_pem=cp.ca_pem, key_pem=key, cert_pem=cert)
    try:
        yield client
    finally:
        await client.aclose()


def _engine(
    tmp: Path, source: FakeSource, target: ControlPlaneTarget, machine_id: str, recovery: Any
) -> BackupEngine:
    machine_key = BoxKeyPair.generate()
    return BackupEngine(
        source,
        target,
        machine_id=machine_id,
        naming_key=os.urandom(32),
        recipients=[machine_key.public_key, recovery.public_key],
        keypair=machine_key,
        work_dir=tmp / "work",
        keep=2,
        clock=Clock(),
    )


def _metric(cp: ControlProc, name: str) -> float:
    """The sum of a metric's samples over its labels."""
    addr = cp.serve_info["metrics"]
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=15) as r:
        text = r.read().decode()
    return sum(
        float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


async def test_engine_backs_up_lists_verifies_prunes_through_the_control_plane(
    cp: ControlProc, tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    alice, bob = await _account(cp, 7001), await _account(cp, 7002)
    a_id, a_cert, a_key = await _machine(cp, alice)
    a2_id, a2_cert, a2_key = await _machine(cp, alice)
    b_id, b_cert, b_key = await _machine(cp, bob)
    recovery = BoxKeyPair.generate()
    source = FakeSource(tmp_path, 4)
    async with _link(cp, a_cert, a_key) as link:
        engine = _engine(tmp_path, source, ControlPlaneTarget(link), a_id, recovery)
        first = await engine.backup_now()
        assert first.uploaded == first.segments == 5
        source.change(next(iter(source.data)))
        second = await engine.backup_now()
        assert second.uploaded == 1  # the unchanged agents and attachment were kept
        listed = [info.backup_id for info, _ in await engine.list()]
        assert listed == [first.backup_id, second.backup_id]
        verified = await engine.verify(second.backup_id, recovery)
        assert verified.plain_bytes == second.plain_bytes
        source.change(next(iter(source.data)))
        third = await engine.backup_now()  # keep = 2: the first goes
        assert third.pruned is not None and third.pruned.manifests == (first.backup_id,)
        assert [i.backup_id for i, _ in await engine.list()] == [
            second.backup_id,
            third.backup_id,
        ]
        fetched = await engine.fetch(third.backup_id, tmp_path / "fetched", recovery)
        assert {a: p.read_bytes() for a, p in fetched.agent_files.items()} == source.data

    # Another machine of the same account may read them (a replacement box).
    async with _link(cp, a2_cert, a2_key) as link:
        target = ControlPlaneTarget(link, source=a_id)
        assert [m.backup_id for m in await target.list_manifests()] == [
            second.backup_id,
            third.backup_id,
        ]
        reader = _engine(tmp_path / "a2", source, target, a_id, recovery)
        again = await reader.fetch(third.backup_id, tmp_path / "a2-fetched", recovery)
        assert {a: p.read_bytes() for a, p in again.agent_files.items()} == source.data

    # Another account's machine: NOT_FOUND, exactly as for a machine that does not exist.
    missing = new_id("machine")
    async with _link(cp, b_cert, b_key) as link:
        for who in (a_id, missing):
            target = ControlPlaneTarget(link, source=who)
            with pytest.raises(NotFound):
                await target.get_manifest(third.backup_id)
            with pytest.raises(NotFound):
                async for _ in target.get_segment(fetched.manifest.segments[0].name):
                    pass
        errors = []
        for who in (a_id, missing):
            with pytest.raises(NotFound) as err:
                await ControlPlaneTarget(link, source=who).list_manifests()
            errors.append(str(err.value).replace(who, "<id>"))
        assert errors[0] == errors[1]
        # Its own backups are empty: the ids never mix.
        assert await ControlPlaneTarget(link).list_manifests() == []

    # Nothing readable in the bucket: every object, whole.
    s3 = _s3_client(moto_endpoint)
    marker = b"SECRET-CONVERSATION"
    keys = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket)
        for o in page.get("Contents", [])
    ]
    assert any("/backups/" in k for k in keys)
    for k in keys:
        assert marker not in s3.get_object(Bucket=s3_bucket, Key=k)["Body"].read(), k
    assert _metric(cp, "agents_cp_backup_stored_objects_total") >= 7
    assert _metric(cp, "agents_cp_backup_stored_bytes_total") > 0
    assert _metric(cp, "agents_cp_backup_calls_total") > 0
    # Streams are counted too, once each, with the code the caller saw.
    get_segment = 'agents_cp_backup_calls_total{code="%s",method="GetSegment"}'
    assert _metric(cp, get_segment % "OK") >= 1
    assert _metric(cp, get_segment % "NOT_FOUND") == 2


async def test_backup_rpcs_bound_and_check_their_input(cp: ControlProc) -> None:
    alice = await _account(cp, 7101)
    _, cert, key = await _machine(cp, alice)
    creds = grpc.ssl_channel_credentials(cp.ca_pem, private_key=key, certificate_chain=cert)
    async with grpc.aio.secure_channel(cp.link, creds) as ch:
        stub = link_pb2_grpc.MachineLinkStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.HaveSegments(
                link_pb2.HaveSegmentsRequest(hashes=["ab" * 32] * 10_001), timeout=10
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.HaveSegments(link_pb2.HaveSegmentsRequest(hashes=["../x"]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "hash" in (err.value.details() or "")

        async def short() -> AsyncIterator[link_pb2.PutSegmentRequest]:
            yield link_pb2.PutSegmentRequest(
                header=link_pb2.SegmentHeader(hash="cd" * 32, size=100)
            )
            yield link_pb2.PutSegmentRequest(chunk=b"x" * 10)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PutSegment(short(), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Nothing of the short segment was kept.
        have = await stub.HaveSegments(link_pb2.HaveSegmentsRequest(hashes=["cd" * 32]), timeout=10)
        assert list(have.present) == []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Prune(link_pb2.PruneRequest(keep=0), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_the_largest_manifest_goes_up_and_comes_back(cp: ControlProc) -> None:
    alice = await _account(cp, 7102)
    _, cert, key = await _machine(cp, alice)
    async with _link(cp, cert, key) as link:
        target = ControlPlaneTarget(link)
        # The largest a machine sends (a long usage history): past gRPC's 4 MiB
        # default limit, and past the control plane's fixed 4 MiB receive window
        # (no BDP probing: controlplane/server.py), so it arrives in 4 KiB TLS
        # records over window updates sent while it is being read.
        blob = os.urandom(MAX_LINK_MANIFEST)
        backup_id = new_id("backup")
        await target.put_manifest(backup_id, blob, [])
        assert await target.get_manifest(backup_id) == blob
        # Past the link's limit: refused on the machine, saying which limit.
        with pytest.raises(TooLarge, match="manifest"):
            await target.put_manifest(new_id("backup"), b"x" * (MAX_LINK_MANIFEST + 1), [])
        assert [m.backup_id for m in await target.list_manifests()] == [backup_id]


async def test_a_backup_planted_in_the_bucket_is_refused_and_the_genuine_one_restores(
    cp: ControlProc, tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    alice = await _account(cp, 7101)
    a_id, a_cert, a_key = await _machine(cp, alice)
    recovery = BoxKeyPair.generate()
    source = FakeSource(tmp_path, 2)
    async with _link(cp, a_cert, a_key) as link:
        engine = _engine(tmp_path, source, ControlPlaneTarget(link), a_id, recovery)
        genuine = await engine.backup_now()

    # Someone with the bucket's write credentials (not the control plane's keys) and
    # the account's recovery public key plants a newer, well-formed backup.
    root = f"cp/accounts/{alice}/backups/{a_id}/manifests/"
    forged_id = new_id("backup", now_ms=id_time_ms(genuine.backup_id) + 1000)
    forged = BackupManifest(forged_id, a_id, 0.0, os.urandom(32), ())
    s3 = _s3_client(moto_endpoint)
    s3.put_object(
        Bucket=s3_bucket,
        Key=f"{root}{forged_id}.sealed",
        Body=seal_manifest(forged, [recovery.public_key]),
    )
    s3.put_object(Bucket=s3_bucket, Key=f"{root}{forged_id}.names", Body=b"[]")
    refused_before = _metric(cp, "agents_cp_store_records_refused_total")

    async with _link(cp, a_cert, a_key) as link:
        engine = _engine(tmp_path / "again", source, ControlPlaneTarget(link), a_id, recovery)
        listed = [info.backup_id for info, _ in await engine.list()]
        assert listed == [genuine.backup_id, forged_id]  # listed: a listing reads nothing
        with pytest.raises(IntegrityError, match="MAC"):  # DATA_LOSS over the link
            await engine.fetch(forged_id, tmp_path / "forged", recovery)
        assert not (tmp_path / "forged").exists() or not any((tmp_path / "forged").iterdir())
        fetched = await engine.fetch(genuine.backup_id, tmp_path / "fetched", recovery)
        assert {a: p.read_bytes() for a, p in fetched.agent_files.items()} == source.data
    assert _metric(cp, "agents_cp_store_records_refused_total") > refused_before

    # fsck (read-only, beside the running daemon) names both planted objects (no MAC).
    report = cp.cli("fsck", "--json")
    assert report.code == 1, report.err
    findings = json.loads(report.out)["findings"]
    refused = {f["key"] for f in findings if f["kind"] == "unmacd_backup"}
    assert refused == {
        f"accounts/{alice}/backups/{a_id}/manifests/{forged_id}.sealed",
        f"accounts/{alice}/backups/{a_id}/manifests/{forged_id}.names",
    }


async def test_a_segment_damaged_in_the_bucket_is_mended_by_the_next_backup(
    cp: ControlProc, tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    """A flipped byte in a segment the control plane keeps: verify fails naming it,
    and the next backup sends that segment again over the bad copy (PutSegment
    with ``replace``), so it and the older backup naming it restore again."""
    account = await _account(cp, 7101)
    machine_id, cert, key = await _machine(cp, account)
    recovery = BoxKeyPair.generate()
    source = FakeSource(tmp_path, 3)
    s3 = _s3_client(moto_endpoint)
    async with _link(cp, cert, key) as link:
        engine = _engine(tmp_path, source, ControlPlaneTarget(link), machine_id, recovery)
        first = await engine.backup_now()
        segments = sorted(
            o["Key"]
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket, Prefix="cp/")
            for o in page.get("Contents", [])
            if f"/backups/{machine_id}/segments/" in o["Key"]
        )
        assert len(segments) == first.segments
        victim = segments[0]
        data = bytearray(s3.get_object(Bucket=s3_bucket, Key=victim)["Body"].read())
        data[len(data) // 2] ^= 1
        s3.put_object(Bucket=s3_bucket, Key=victim, Body=bytes(data))
        with pytest.raises(IntegrityError):
            await engine.verify(first.backup_id, recovery)
        second = await engine.backup_now()
        assert second.uploaded == 1, "the damaged segment is sent again, nothing else"
        still_damaged = s3.get_object(Bucket=s3_bucket, Key=victim)["Body"].read() == data
        assert not still_damaged
        for backup_id in (first.backup_id, second.backup_id):
            await engine.verify(backup_id, recovery)
        assert (await engine.backup_now()).uploaded == 0, "mended once, then reused"
