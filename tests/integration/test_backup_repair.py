"""Replacing a lost machine (issue 10's first two "must show" bullets), real processes.

A real control plane on moto's S3 server; a real ``agents-machine join`` makes
the machine; 50 agents with conversations, tool logs and attachments are made
through the machine's own code paths (echo runtime); a sealed backup goes to the
control plane through :class:`machine.backup_link.ControlPlaneTarget`. Then
the data folder is deleted, ``agents-control machine repair M`` prints a join
command, and a real ``agents-machine join … --recovery-key FILE`` on a fresh
folder takes over M's id and restores with only the account recovery key.
"""

from __future__ import annotations

import datetime as dt
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from machine import identity
from machine.app import open_machine
from machine.backup_format import BackupManifest, seal_manifest
from machine.backup_keys import load_backup_keys
from machine.backup_link import ControlPlaneTarget
from machine.backup_service import BackupService
from machine.config import MachineConfig
from machine.link_client import LinkClient
from machine.models import AgentState
from shared.crypto import BoxKeyPair, encode_public_key
from shared.ids import new_id
from shared.recovery_key import write_recovery_key
from tests.conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY, _s3_client
from tests.helpers.control_proc import CliResult, ControlProc, control_plane
from tests.helpers.link_client import connect_once
from tests.helpers.poll import poll_until
from tests.machine.test_transfer import _export_files, _populate

pytestmark = pytest.mark.integration

MACHINE_EXE = Path(sys.executable).parent / "agents-machine"
AGENTS = 50


@pytest.fixture
def cp(tmp_path: Path, moto_endpoint: str, s3_bucket: str) -> Iterator[ControlProc]:
    env = {
        "AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": TEST_SECRET_KEY,
        "AGENTS_CONTROL_STORE_ENDPOINT": moto_endpoint,
    }
    with control_plane(tmp_path / "cp-home", f"s3://{s3_bucket}/cp", env) as proc:
        yield proc


def _config(data_dir: Path) -> MachineConfig:
    return MachineConfig(
        data_dir=data_dir,
        background_loops=False,
        shutdown_grace_seconds=0,
        attachment_limit=256 * 1024,
        prompt_limit=4096,
    ).validate()


def _ok(result: CliResult) -> str:
    assert result.code == 0, result.err
    return result.out


def _printed_command(out: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith("agents-machine join "))
    return shlex.split(line)


class Joined:
    """One ``agents-machine join`` process (it serves once joined); stopped by the test."""

    def __init__(self, argv: list[str], data_dir: Path, log: Path) -> None:
        self.log = log
        env = {k: v for k, v in os.environ.items() if k != "AGENTS_DATA_DIR"}
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(MACHINE_EXE), *argv[1:], "--data-dir", str(data_dir)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, deadline: float = 60) -> None:
        def seen() -> bool:
            if text in self.output():
                return True
            if self.proc.poll() is not None:
                raise AssertionError(f"agents-machine exited:\n{self.output()}")
            return False

        poll_until(seen, deadline=deadline, what=text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


async def _backup(data_dir: Path, work: Path) -> str:
    """Back the machine up to the control plane, as the daemon's BackupService would."""
    link = identity.load_link(data_dir)
    keys = identity.load_keys(data_dir)
    client = LinkClient.mutual(
        link.control_address,
        ca_pem=keys.ca_cert_pem,
        key_pem=keys.tls_key_pem,
        cert_pem=keys.tls_cert_pem,
    )
    try:
        async with open_machine(_config(data_dir)) as m:
            service = BackupService(
                m.db,
                ControlPlaneTarget(client),
                target_name="control plane",
                machine_id=m.ids.canonical,
                keys=load_backup_keys(data_dir),
                data_dir=data_dir,
                attachments_dir=m.config.attachments_dir,
                keep=3,
                daily_at=dt.time(3, 0),
            )
            made = await service.backup_now()
            assert made.segments >= AGENTS
            return made.backup_id
    finally:
        await client.aclose()


async def test_lost_machine_is_replaced_and_restored_with_only_the_recovery_key(
    cp: ControlProc, tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    started = time.monotonic()
    recovery = BoxKeyPair.generate()
    key_file = tmp_path / "recovery.key"
    write_recovery_key(key_file, recovery, "the test account's backups")
    account = _ok(
        cp.cli(
            "account",
            "create",
            "--github-id",
            "9100",
            "--github-login",
            "carol",
            "--recovery-public-key",
            encode_public_key(recovery.public_key),
        )
    )
    account_id = next(w for w in account.split() if w.startswith("acct_"))

    # A joined machine with 50 agents (conversations, tool logs, attachments).
    old_dir = tmp_path / "old"
    argv = _printed_command(_ok(cp.cli("token", "create", "--account", account_id)))
    first = Joined(argv, old_dir, tmp_path / "old.log")
    try:
        first.wait_for("joined as machine")
    finally:
        first.stop()
    machine_id = identity.load_link(old_dir).machine_id
    async with open_machine(_config(old_dir)) as old:
        assert old.ids.canonical == machine_id
        agents = await _populate(old, tmp_path, AGENTS)
        names = [(await old.agents.get(a)).name for a in agents]
        before = await _export_files(old, agents, tmp_path / "before.tar.gz")
    backup_id = await _backup(old_dir, tmp_path / "work")

    # The disk dies; its certificate and key survive only in our hands (a thief's).
    old_keys = identity.load_keys(old_dir)
    shutil.rmtree(old_dir)
    # Someone with the bucket's write credentials plants a newer backup sealed to
    # the account's recovery key: refused (no MAC), and the genuine one restores.
    forged = new_id("backup")
    s3 = _s3_client(moto_endpoint)
    s3.put_object(
        Bucket=s3_bucket,
        Key=f"cp/accounts/{account_id}/backups/{machine_id}/manifests/{forged}.sealed",
        Body=seal_manifest(
            BackupManifest(forged, machine_id, time.time(), os.urandom(32), ()),
            [recovery.public_key],
        ),
    )

    repair = _ok(cp.cli("machine", "repair", machine_id))
    argv = _printed_command(repair)
    assert argv[-2:] == ["--recovery-key", "RECOVERY-KEY-FILE"]
    argv[-1] = str(key_file)
    new_dir = tmp_path / "new"
    second = Joined(argv, new_dir, tmp_path / "new.log")
    try:
        second.wait_for(f"restored {AGENTS} agents (archived) from backup {backup_id}")
        assert f"joined as machine {machine_id}" in second.output()
        assert f"warning: backup {forged} was refused" in second.output()
    finally:
        second.stop()

    # The old box's certificate is refused now.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await connect_once(cp.link, cp.ca_pem, old_keys.tls_cert_pem, old_keys.tls_key_pem)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

    async with open_machine(_config(new_dir)) as new:
        assert new.ids.canonical == machine_id
        after = await _export_files(new, agents, tmp_path / "after.tar.gz")
        assert after.keys() == before.keys()
        assert after == before, "conversations, summaries, tool logs and attachments"
        for agent in agents:
            rec = await new.agents.get(agent)
            assert rec.state is AgentState.ARCHIVED and rec.local, rec
        # Own and runnable after unarchive.
        await new.agents.unarchive(agents[7])
        stream = await new.runs.prompt(agents[7], "after the repair")
        kinds = [ev.kind.name async for ev in stream]
        assert kinds[-1] == "RUN_FINISHED", kinds
    # The repaired machine backs up under its own naming key (a forged backup must
    # not choose the keys of the next ones).
    again = await _backup(new_dir, tmp_path / "work2")
    assert again != backup_id

    # No plaintext in the bucket: every object, whole.
    keys = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket)
        for o in page.get("Contents", [])
    ]
    assert sum("/backups/" in k for k in keys) > AGENTS
    needles = [b"MARKER", *(n.encode() for n in names)]
    for k in keys:
        blob = s3.get_object(Bucket=s3_bucket, Key=k)["Body"].read()
        for needle in needles:
            assert needle not in blob, (k, needle)
    assert time.monotonic() - started < 120


def test_a_bad_recovery_key_file_is_refused_before_the_join(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-key"
    bad.write_text("hello\nworld\n")
    token = "tok_" + "0" * 26 + "." + "A" * 43
    proc = subprocess.run(
        [
            str(MACHINE_EXE),
            "join",
            "127.0.0.1:9",  # nothing listens: the key is read before any connection
            "--token",
            token,
            "--ca-hash",
            "sha256:" + "0" * 64,
            "--recovery-key",
            str(bad),
            "--data-dir",
            str(tmp_path / "data"),
        ],
        capture_output=True,
        timeout=30,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert "recovery_key" in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and not (tmp_path / "data" / "link.json").exists()
