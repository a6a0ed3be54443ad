"""Control-plane disaster recovery for real, on moto's S3 server.

A control plane with 5 joined ``agents-machine`` daemons (the drill's
orchestrator, real processes), a backup stored through it, prompts queued to
the stopped machines; the control plane is SIGKILLed and its home deleted;
``agents-control restore`` rebuilds it from the bucket and the recovery key.
Every machine reconnects with the certificate it has (no join), the queued
prompts are delivered, the backup is still listed and verifies. The old home,
started again afterwards, is fenced out: it exits and writes nothing. And no
object in the bucket holds a private key, a credential or a secret in the clear.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import boto3  # type: ignore[import-untyped]
import pytest

from controlplane.cli.drill import Drill
from controlplane.integrity.keys import load_home_keys
from controlplane.recovery.fencing import EPOCH_KEY
from shared.errors import InvalidState
from tests.helpers.control_proc import agents_control_exe, recovery_key_path, run_init, s3_env
from tests.helpers.fault_proxy import crash_proxy
from tests.helpers.poll import apoll_until

pytestmark = pytest.mark.integration

MACHINES = 5
DEADLINE = 60.0


def _bucket(endpoint: str, bucket: str) -> dict[str, bytes]:
    """Every object in the bucket, key -> bytes, read straight from S3."""
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing-secret",
        region_name="us-east-1",
    )
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            try:
                out[obj["Key"]] = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            except s3.exceptions.NoSuchKey:
                continue  # deleted since the listing (an intent, a presence write)
    return out


def _no_secret_in_clear(objects: dict[str, bytes], secrets: list[bytes]) -> None:
    assert any(k.endswith("cp/keys.sealed") for k in objects)
    for key, body in objects.items():
        assert b"PRIVATE KEY" not in body, key
        for secret in secrets:
            assert secret not in body, key


# Six daemons (a control plane started three times, five machines) on a shared
# 2-core host: about 40 s alone, over two minutes under load.
@pytest.mark.timeout(300)
async def test_restore_from_the_bucket_brings_every_machine_back_without_a_join(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    env = {**os.environ, **s3_env(moto_endpoint)}
    env.pop("AGENTS_CONTROL_STORE_ENDPOINT", None)  # given as --store-endpoint
    async with Drill(
        tmp_path / "drill",
        machines=MACHINES,
        env=env,
        store_url=f"s3://{s3_bucket}/cp",
        store_endpoint=moto_endpoint,
    ) as drill:
        await drill.set_up()
        keys = load_home_keys(drill.home)
        secrets = [
            keys.ca.key_pem,
            keys.server.key_pem,
            keys.control_key_pem,
            keys.secrets_key,
            drill.operator.encode(),
            drill.operator.split(".")[1].encode(),
            drill.recovery_key.read_bytes().splitlines()[-1],
        ]
        _no_secret_in_clear(_bucket(moto_endpoint, s3_bucket), secrets)

        # A backup through the control plane, of a machine that is then stopped.
        backed_up = drill.machines[0]
        drill.machine_cli(backed_up, "backup", "now")
        listed = drill.machine_cli(backed_up, "backup", "list", "--json")
        backup_id = listed.split('"backup_id": "')[1].split('"')[0]
        assert backup_id.startswith("bk_")

        await drill.queue_prompts()
        old_home = tmp_path / "old-home"
        drill.lose_control_plane(keep_copy=old_home)
        assert not drill.home.exists()
        before = {m.machine_id: drill.identity(m) for m in drill.machines}

        report = await drill.recover()
        assert report.not_connected == 0 and report.repaired == 0, report
        assert report.prompts_queued == 6 and report.prompts_delivered == 6, report
        assert {m.machine_id: drill.identity(m) for m in drill.machines} == before
        assert load_home_keys(drill.home) == keys

        # The backup link's channel reconnects on its own schedule (at most every
        # few seconds, machine.link.client), not with the machine's link.
        def listed_again() -> str | None:
            try:
                return drill.machine_cli(backed_up, "backup", "list", "--json")
            except InvalidState:
                return None

        listing = await apoll_until(
            listed_again, deadline=30, what="the backup listed again", step=0.5
        )
        assert backup_id in listing
        drill.machine_cli(backed_up, "backup", "verify", backup_id)
        print(f"\nDR on moto, {MACHINES} machines: {report.to_dict()}")

        # The old home comes back (its VM rebooted): fenced out at start, no write.
        drill.close()  # the restored one too, so that nothing else writes meanwhile
        frozen = _bucket(moto_endpoint, s3_bucket)
        old = subprocess.run(
            [str(agents_control_exe()), "serve", "--home", str(old_home)],
            env=env,
            capture_output=True,
            text=True,
            timeout=DEADLINE,
        )
        assert old.returncode == 1, old.stderr
        assert "fenced out" in old.stderr.strip().splitlines()[-1], old.stderr
        assert "Traceback" not in old.stderr
        assert _bucket(moto_endpoint, s3_bucket) == frozen
        _no_secret_in_clear(frozen, secrets)


def test_restore_killed_after_taking_the_epoch_is_completed_by_running_it_again(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    """restore's one store write is the epoch; killed right after it (before the
    rename, its commit point) the home is still absent, the old home is already
    fenced out, and a second restore completes with the next epoch."""
    with crash_proxy(moto_endpoint) as proxy:
        env = {**os.environ, **s3_env(proxy.url)}
        url = f"s3://{s3_bucket}/cp"
        cp = run_init(tmp_path / "home", url, env)
        key = str(recovery_key_path(cp.home))
        home = tmp_path / "restored"
        argv = [str(agents_control_exe()), "restore", "--home", str(home), "--store", url]
        restore = subprocess.Popen(
            [*argv, "--recovery-key", key],
            env=cp.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        proxy.arm(restore.pid, after=1)
        restore.communicate(timeout=DEADLINE)
        assert proxy.crashed.is_set() and restore.returncode == -9
        assert proxy.writes == [f"PUT cp/{EPOCH_KEY}"], proxy.writes
        proxy.disarm()
        assert not home.exists() and list(tmp_path.glob(".restore-restored-*"))
        old = subprocess.run(
            [str(agents_control_exe()), "serve", "--home", str(cp.home)],
            env=cp.env,
            capture_output=True,
            text=True,
            timeout=DEADLINE,
        )
        assert old.returncode == 1 and "fenced out: epoch 1" in old.stderr, old.stderr

        again = subprocess.run(
            [*argv, "--recovery-key", key, "--json"],
            env=cp.env,
            capture_output=True,
            text=True,
            timeout=DEADLINE,
        )
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["epoch"] == 2
        assert load_home_keys(home) == load_home_keys(cp.home)
        assert not list(tmp_path.glob(".restore-restored-*"))
