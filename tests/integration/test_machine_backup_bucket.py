"""A stand-alone machine backing up to an S3 bucket (moto), restored on a fresh data folder
from it: its credentials in no object of the bucket and no line of either daemon's log."""

from __future__ import annotations

import json
import secrets
import subprocess
import tarfile
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from tests.conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY
from tests.helpers.machine_proc import MachineProc, run_cli

pytestmark = pytest.mark.integration


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def _conversations(data: Path, agent: str, dest: Path) -> dict[str, bytes]:
    _ok(run_cli(data, "export", agent, "-o", str(dest)))
    with tarfile.open(dest) as tar:
        return {
            m.name: f.read()
            for m in tar.getmembers()
            if m.name.endswith(".jsonl") and (f := tar.extractfile(m)) is not None
        }


def _objects(endpoint: str, bucket: str) -> dict[str, bytes]:
    """Every object in the bucket, read whole (moto accepts any key: ours are its own)."""
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=TEST_ACCESS_KEY,
        aws_secret_access_key=TEST_SECRET_KEY,
        config=Config(s3={"addressing_style": "path"}),
    )
    keys = [
        item["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for item in page.get("Contents", [])
    ]
    return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def test_a_stand_alone_machine_backs_up_to_a_bucket_that_never_holds_its_keys(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    # Credentials of our own making, unlike anything else in a log or an object.
    access = "AKIA" + secrets.token_hex(8).upper()
    secret = secrets.token_urlsafe(30)
    creds = tmp_path / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = {access}\naws_secret_access_key = {secret}\n")
    creds.chmod(0o600)
    url = f"s3://{s3_bucket}/laptop"
    data, work = tmp_path / "data", tmp_path / "work"
    data.mkdir(mode=0o700)
    work.mkdir()
    (data / "machine.toml").write_text(
        f'backup_target = "{url}"\nbackup_store_endpoint = "{moto_endpoint}"\n'
        f'backup_credentials_file = "{creds}"\n'
    )
    key_file = tmp_path / "recovery.key"
    fresh = tmp_path / "fresh"
    fresh_env = {
        "AGENTS_MACHINE_BACKUP_STORE_ENDPOINT": moto_endpoint,
        "AWS_ACCESS_KEY_ID": access,
        "AWS_SECRET_ACCESS_KEY": secret,
    }
    first = MachineProc(data, "--log-level", "debug")
    second = MachineProc(fresh, "--log-level", "debug", env=fresh_env)
    try:
        with first:
            status = _ok(run_cli(data, "status"))
            assert f"bucket s3://{s3_bucket}/laptop/ at {moto_endpoint}" in status
            assert "same device" not in status
            agent = _ok(run_cli(data, "agent", "create", "bucket", "--folder", str(work))).strip()
            _ok(run_cli(data, "agent", "prompt", agent, "remember the bucket words"))
            key_file.write_text(_ok(run_cli(data, "backup", "recovery-key")))
            key_file.chmod(0o600)
            made = _ok(run_cli(data, "backup", "now"))
            listed = json.loads(_ok(run_cli(data, "--json", "backup", "list")))["backups"]
            assert len(listed) == 1 and listed[0]["backup_id"] in made
            backup_id = listed[0]["backup_id"]
            assert "ok" in _ok(run_cli(data, "backup", "verify", backup_id))
            before = _conversations(data, agent, tmp_path / "before.tar.gz")
            assert any(b"remember the bucket words" in v for v in before.values())
        assert first.log()  # the daemon wrote its lines (at DEBUG)

        # A fresh machine (its credentials from the environment) restores from the
        # bucket with --from and the recovery key (backing up to that prefix, another
        # machine's, it is refused: tests/machine/backups/test_bucket_target.py).
        with second:
            shown = _ok(run_cli(fresh, "backup", "list", "--from", url))
            assert backup_id in shown and "no (another key)" in shown
            restored = _ok(
                run_cli(fresh, "backup", "restore", backup_id, "--from", url,
                        "--recovery-key", str(key_file))
            )  # fmt: skip
            assert "restored 1 agents" in restored
            assert _conversations(fresh, agent, tmp_path / "after.tar.gz") == before
    finally:
        first.kill()
        second.kill()

    objects = _objects(moto_endpoint, s3_bucket)
    assert "laptop/machine.json" in objects
    assert any(k.startswith("laptop/manifests/") for k in objects)
    assert any(k.startswith("laptop/segments/") for k in objects)
    assert all(k.startswith("laptop/") for k in objects)  # the probe cleaned up after itself
    for key, body in objects.items():
        for word in (access, secret, "remember the bucket words"):
            assert word.encode() not in body, (key, word)
    for log in (first.log(), second.log()):
        assert access not in log and secret not in log
