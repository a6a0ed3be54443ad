"""A stand-alone machine's bucket target: chosen by backup_target, its owner named, refusals
at start naming the setting, faults of a backup naming the target."""

from __future__ import annotations

import json
import secrets
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import boto3
import grpc
import pytest
from botocore.config import Config

from machine.app import open_machine
from machine.backups.targets.bucket import BucketTarget
from machine.backups.targets.control_plane import ControlPlaneTarget
from machine.backups.wiring import backup_target, backup_warnings, open_backups_from
from machine.config import MachineConfig
from machine.link.client import LinkClient
from machine.metrics import MachineMetrics
from machine.models import MachineIds
from shared.errors import ConfigError, InvalidArgument, StoreUnavailable
from shared.ids import new_id
from shared.metrics import new_registry
from tests.conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY
from tests.helpers.moto_server import free_port, moto_server

Closing = list[Callable[[], Awaitable[None]]]


def _ids() -> MachineIds:
    machine = new_id("machine")
    return MachineIds(machine, frozenset({machine}), joined=False)


def _cfg(tmp_path: Path, url: str, endpoint: str, **fields: object) -> MachineConfig:
    return MachineConfig(
        data_dir=tmp_path / "d",
        backup_target=url,
        backup_store_endpoint=endpoint,
        backup_access_key=TEST_ACCESS_KEY,
        backup_secret_key=TEST_SECRET_KEY,
        **fields,  # type: ignore[arg-type]
    ).validate()


def _client(endpoint: str):  # type: ignore[no-untyped-def]
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=TEST_ACCESS_KEY,
        aws_secret_access_key=TEST_SECRET_KEY,
        config=Config(s3={"addressing_style": "path"}),
    )


async def _close(closing: Closing) -> None:
    for close in reversed(closing):
        await close()


async def test_the_bucket_is_chosen_its_owner_named_and_another_machine_refused(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/laptop"
    cfg = _cfg(tmp_path, url, moto_endpoint)
    ids, closing = _ids(), []
    try:
        target, name = await backup_target(cfg, ids, closing)
        assert isinstance(target, BucketTarget)
        assert name == f"bucket s3://{s3_bucket}/laptop/ at {moto_endpoint}"
        assert await target.list_manifests() == []
        assert backup_warnings(cfg, target) == ()  # off this disk
    finally:
        await _close(closing)
    owner = _client(moto_endpoint).get_object(Bucket=s3_bucket, Key="laptop/machine.json")
    assert json.loads(owner["Body"].read()) == {"machine_id": ids.canonical}
    # The same machine again: its own prefix.
    closing = []
    try:
        await backup_target(cfg, ids, closing)
    finally:
        await _close(closing)
    # Another machine on that prefix: refused at start, the prefix left as it was.
    with pytest.raises(ConfigError) as err:
        await backup_target(cfg, _ids(), [])
    assert err.value.field == "backup_target"
    assert f"holds machine {ids.canonical}'s backups" in err.value.reason
    assert "prefix of its own" in err.value.reason
    # ... but it may restore from it (--from), which names whose backups they are.
    async with open_backups_from(cfg, url) as (_, whose):
        assert whose == ids.canonical


async def test_a_prefix_holding_other_objects_is_refused(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    _client(moto_endpoint).put_object(Bucket=s3_bucket, Key="shared/report.pdf", Body=b"x")
    with pytest.raises(ConfigError, match="holds other objects and no machine.json"):
        await backup_target(_cfg(tmp_path, f"s3://{s3_bucket}/shared", moto_endpoint), _ids(), [])
    with pytest.raises(InvalidArgument, match="--from: .* not a backup target"):
        cfg = _cfg(tmp_path, f"s3://{s3_bucket}/x", moto_endpoint)
        async with open_backups_from(cfg, f"s3://{s3_bucket}/shared"):
            pass
    with pytest.raises(InvalidArgument, match="--from: .*bucket"):
        async with open_backups_from(cfg, "s3://Not_A_Bucket/p"):
            pass
    secret = secrets.token_urlsafe(20)
    with pytest.raises(InvalidArgument, match="--from: credentials never go in the URL") as err:
        async with open_backups_from(cfg, f"s3://{s3_bucket}/x?access_key=AK&secret_key={secret}"):
            pass
    assert secret not in err.value.message


async def test_an_unknown_bucket_is_refused_at_start_naming_the_setting(
    tmp_path: Path, moto_endpoint: str
) -> None:
    missing = f"absent-{secrets.token_hex(4)}"
    with pytest.raises(ConfigError) as err:
        await backup_target(_cfg(tmp_path, f"s3://{missing}/m", moto_endpoint), _ids(), [])
    assert err.value.field == "backup_target"
    assert f"s3://{missing}/m/" in err.value.reason
    assert "the bucket does not exist" in err.value.reason


async def test_refused_credentials_are_refused_at_start_without_the_secret(
    tmp_path: Path,
) -> None:
    secret = secrets.token_urlsafe(30)
    with moto_server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as endpoint:
        cfg = MachineConfig(
            data_dir=tmp_path / "d",
            backup_target="s3://backups/m1",
            backup_store_endpoint=endpoint,
            backup_access_key="AKIAUNKNOWN000000001",
            backup_secret_key=secret,
        ).validate()
        with pytest.raises(ConfigError) as err:
            await backup_target(cfg, _ids(), [])
    assert err.value.field == "backup_target" and "s3://backups/m1/" in err.value.reason
    assert "the access key is not known" in err.value.reason
    assert secret not in err.value.message and "AKIAUNKNOWN" not in err.value.message


async def test_an_unreachable_bucket_starts_and_each_use_fails_naming_the_target(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A laptop started offline still serves its agents; its backups fail until it is back.
    endpoint = f"http://127.0.0.1:{free_port()}"
    cfg = _cfg(tmp_path, "s3://backups/m1", endpoint)
    closing: Closing = []
    try:
        target, _ = await backup_target(cfg, _ids(), closing)
        assert any("each backup tries it again" in r.message for r in caplog.records)
        with pytest.raises(StoreUnavailable) as err:
            await target.list_manifests()
        assert str(err.value).startswith(f"backup target s3://backups/m1/ at {endpoint}: ")
    finally:
        await _close(closing)
    # The daemon starts; a backup fails as a whole, naming the target.
    cfg = _cfg(tmp_path, "s3://backups/m1", endpoint, background_loops=False)
    async with open_machine(cfg) as m:
        with pytest.raises(StoreUnavailable, match="^backup target s3://backups/m1/ at "):
            await m.require_backups().backup_now()


async def test_a_joined_machine_ignores_a_bucket_and_says_so(
    tmp_path: Path, moto_endpoint: str
) -> None:
    cfg = _cfg(tmp_path, "s3://backups/m1", moto_endpoint)
    client = LinkClient(grpc.aio.insecure_channel("127.0.0.1:1"))
    try:
        (warning,) = backup_warnings(cfg, ControlPlaneTarget(client))
    finally:
        await client.aclose()
    assert "backup_target s3://backups/m1/" in warning and "is ignored" in warning


async def test_the_same_device_gauge_says_where_backups_go(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    gauge = "agents_machine_backup_same_device"
    metrics = MachineMetrics(new_registry())
    folder = MachineConfig(data_dir=tmp_path / "a", background_loops=False).validate()
    async with open_machine(folder, metrics=metrics) as m:
        assert metrics.registry.get_sample_value(gauge) == 1  # <data_dir>/backups
        assert any("same device" in w for w in m.require_backups().status().warnings)
    metrics = MachineMetrics(new_registry())
    cfg = _cfg(tmp_path, f"s3://{s3_bucket}/m", moto_endpoint, background_loops=False)
    async with open_machine(cfg, metrics=metrics) as m:
        assert metrics.registry.get_sample_value(gauge) == 0
        backups = m.require_backups()
        assert backups.status().target.startswith(f"bucket s3://{s3_bucket}/m/")
        assert not any("same device" in w for w in backups.status().warnings)
        made = await backups.backup_now()
        assert (await backups.restore_check(made.backup_id)).ok
        # The bucket's store calls are counted on the daemon's registry.
        ops = metrics.registry.get_sample_value(
            "agents_machine_store_operations_total", {"operation": "put", "outcome": "ok"}
        )
        assert ops is not None and ops > 0


async def test_a_folder_target_on_another_device_is_not_warned_and_refusals_name_it(
    tmp_path: Path,
) -> None:
    # /dev/shm is a tmpfs: another device than the test's data folder, when it exists.
    shm = Path("/dev/shm")
    data = tmp_path / "d"
    (tmp_path / "file").write_text("x")
    cfg = MachineConfig(data_dir=data, backup_target=str(tmp_path / "file" / "b")).validate()
    with pytest.raises(ConfigError) as err:
        await backup_target(cfg, _ids(), [])
    assert err.value.field == "backup_target"
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no folder on another device to try")
    other = shm / f"agents-test-{secrets.token_hex(4)}"
    cfg = MachineConfig(data_dir=data, backup_target=str(other), background_loops=False).validate()
    metrics = MachineMetrics(new_registry())
    try:
        async with open_machine(cfg, metrics=metrics) as m:
            assert metrics.registry.get_sample_value("agents_machine_backup_same_device") == 0
            status = m.require_backups().status()
            assert status.target == f"folder {other}"
            assert not any("same device" in w for w in status.warnings)
    finally:
        shutil.rmtree(other, ignore_errors=True)
