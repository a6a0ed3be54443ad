"""Replacing a lost machine (issue 10's first two "must show" bullets), real processes.

A real control plane on moto's S3 server; a real ``agents-machine join`` makes
the machine and serves it; 50 agents with conversations, tool logs and
attachments are made through that daemon's RPCs (echo runtime), and
``agents-machine backup now`` sends a sealed backup to the control plane. Then
the data folder is deleted, ``agents-control machine repair M`` prints a join
command, and a real ``agents-machine join … --recovery-key FILE`` on a fresh
folder takes over M's id, restores with only the account recovery key, and
serves: its exports are byte-equal to the old ones, and its agents run again
once unarchived.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from machine.cli.client import MachineClient
from machine.config import MachineConfig
from machine.formats.backup import BackupManifest, seal_manifest
from machine.link import identity
from machine.models import AgentState, EventKind
from shared.crypto import BoxKeyPair, encode_private_key, encode_public_key
from shared.ids import new_id
from shared.recovery_key import write_recovery_key
from tests.conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY, _s3_client
from tests.helpers.control_proc import CliResult, ControlProc, control_plane
from tests.helpers.link_client import connect_once
from tests.helpers.poll import poll_until

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


def _ok(result: CliResult) -> str:
    assert result.code == 0, result.err
    return result.out


def _printed_command(out: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith("agents-machine join "))
    return shlex.split(line)


class Joined:
    """One ``agents-machine join`` process (it serves once joined); stopped by the test."""

    def __init__(
        self, argv: list[str], data_dir: Path, log: Path, extra: dict[str, str] | None = None
    ) -> None:
        self.log = log
        env = {k: v for k, v in os.environ.items() if k != "AGENTS_DATA_DIR"}
        env.update(extra or {})
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


async def _populate(client: MachineClient, work: Path, agents: int) -> list[str]:
    """Agents with an attachment, a conversation, a summary and a tool call each (echo
    runtime), made through the running daemon's RPCs; then archived."""
    ids = []
    for i in range(agents):
        agent = (await client.create_agent(f"agent-{i}", str(work))).id
        ids.append(agent)
        data = f"attachment {i} MARKER-ATT ".encode() * 500 + os.urandom(16)
        rec = await client.upload_attachment(agent, f"f{i}.txt", len(data), [data])
        async for _ in client.prompt(agent, f"MARKER-PROMPT {i} hello", [rec.sha256]):
            pass
        async for ev in client.prompt(agent, f"/tool ls MARKER-TOOL-{i}"):
            if ev.kind is EventKind.PERMISSION_REQUEST:
                await client.answer_permission(ev.run_id, ev.payload["request_id"], "allow_once")
        await client.archive_agent(agent)
    return ids


async def _exported(client: MachineClient, agents: list[str]) -> dict[str, bytes]:
    """The export's conversation, summaries, tool log and attachment files."""
    blob = b"".join([chunk async for chunk in client.export(agents)])
    out: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for member in tar:
            f = tar.extractfile(member)
            if f is not None and not member.name.endswith(("record.json", "manifest.json")):
                out[member.name] = f.read()
    return out


def _client(data_dir: Path) -> MachineClient:
    return MachineClient(MachineConfig(data_dir=data_dir).validate())


def _cli(data_dir: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    res = subprocess.run(
        [str(MACHINE_EXE), "--data-dir", str(data_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


# Many daemon starts and kill points: minutes on a loaded machine.
@pytest.mark.timeout(600)
async def test_lost_machine_is_replaced_and_restored_with_only_the_recovery_key(
    cp: ControlProc, tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
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

    # A joined machine (the join command serves once joined) with 50 agents:
    # conversations, tool logs and attachments, made through its RPCs, then backed
    # up by `agents-machine backup now`.
    old_dir = tmp_path / "old"
    argv = _printed_command(_ok(cp.cli("token", "create", "--account", account_id)))
    # A setting of its own: the backup carries it, the repair names it.
    first = Joined(
        argv, old_dir, tmp_path / "old.log", {"AGENTS_MACHINE_EVENT_RETENTION_DAYS": "30"}
    )
    try:
        first.wait_for("joined as machine")
        first.wait_for("serving on")
        machine_id = identity.load_link(old_dir).machine_id
        async with _client(old_dir) as client:
            agents = await _populate(client, tmp_path, AGENTS)
            names = [(await client.get_agent(a)).name for a in agents]
            before = await _exported(client, agents)
        assert any(k.startswith("attachments/") for k in before)
        made = _cli(old_dir, "backup", "now")
        backup_id = next(w.rstrip(":") for w in made.split() if w.startswith("bk_"))
        assert f"{2 * AGENTS} segments" in made, made  # each agent and its attachment
    finally:
        first.stop()

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
    # Without the key (nor --no-restore) the new box would take the machine over
    # empty: refused before the token is used, and nothing is written.
    bare = tmp_path / "bare"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    refused_join = subprocess.run(
        [str(MACHINE_EXE), *argv[1:-2], "--data-dir", str(bare)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert refused_join.returncode == 2, refused_join.stderr
    assert f"this box would take over machine {machine_id}" in refused_join.stderr
    assert "the token was not used" in refused_join.stderr
    assert not (bare / "keys").exists()
    # Another account's recovery key: refused before the takeover (before, the box
    # took the machine over, cutting the old box off, then failed to restore).
    wrong_key = tmp_path / "wrong.key"
    wrong_key.write_text(encode_private_key(BoxKeyPair.generate().private_key) + "\n")
    wrong_key.chmod(0o600)
    wrong_join = subprocess.run(
        [str(MACHINE_EXE), *argv[1:-1], str(wrong_key), "--data-dir", str(bare)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert wrong_join.returncode == 2, wrong_join.stderr
    assert "not the recovery key of this machine's account" in wrong_join.stderr
    assert "the token was not used" in wrong_join.stderr
    assert not (bare / "keys").exists()
    argv[-1] = str(key_file)
    new_dir = tmp_path / "new"
    # Killed in the middle of the restore (SIGKILL by a test fault point once 5
    # agents are loaded, before the restore's commit): the box is joined and holds
    # no agent; the daemon refuses to start empty (it would back up nothing and in
    # time prune the backup); the same command run again finishes the restore.
    killed = subprocess.run(
        [str(MACHINE_EXE), *argv[1:], "--data-dir", str(new_dir)],
        capture_output=True, text=True, timeout=120, check=False,
        env={**env, "AGENTS_MACHINE_TEST_CRASH_IN_TRANSFER_AFTER_AGENTS": "5"},
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert f"joined as machine {machine_id}" in killed.stdout
    assert identity.is_joined(new_dir) and identity.restore_pending(new_dir)
    with contextlib.closing(sqlite3.connect(new_dir / "machine.db")) as db:
        assert db.execute("SELECT COUNT(*) FROM agents").fetchone()[0] == 0
    # What it had downloaded (attachments decoded) stays until the join runs again.
    assert [p.name[:16] for p in (new_dir / "backup-work").iterdir()] == [".restore-repair-"]
    serve = subprocess.run(
        [str(MACHINE_EXE), "serve", "--data-dir", str(new_dir)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert serve.returncode == 2, serve.stderr
    assert "the restore of its backup did not finish" in serve.stderr
    status = subprocess.run(
        [str(MACHINE_EXE), "--data-dir", str(new_dir), "status"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert status.returncode == 1 and "Try: the same `agents-machine join" in status.stderr
    assert "run the same `agents-machine join` command again" in serve.stderr
    keyless = subprocess.run(
        [str(MACHINE_EXE), *argv[1:-2], "--data-dir", str(new_dir)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert keyless.returncode == 2, keyless.stderr
    assert "--recovery-key FILE to restore it (the token is not used again)" in keyless.stderr
    assert identity.restore_pending(new_dir)
    second = Joined(argv, new_dir, tmp_path / "new.log")
    try:
        second.wait_for(f"restored {AGENTS} agents (archived) from backup {backup_id}")
        assert f"machine {machine_id} is joined already; restoring" in second.output()
        assert f"warning: backup {forged} was refused" in second.output()
        assert "  event_retention_days = 30 (here 7)" in second.output()
        assert not identity.restore_pending(new_dir)
        # Backed up at once under this box's keys (the stored ones open with the
        # recovery key only), every segment under its own naming key: a forged
        # backup must not choose the keys of the next ones.
        second.wait_for(f"{2 * AGENTS} new segments, under this box's keys")
        # The restore's download is gone (the backup keeps its segment cache there).
        work = [p.name for p in (new_dir / "backup-work").iterdir()]
        assert not [name for name in work if name.startswith(".")], work
        second.wait_for("serving on")

        # The old box's certificate is refused now.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await connect_once(cp.link, cp.ca_pem, old_keys.tls_cert_pem, old_keys.tls_key_pem)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

        async with _client(new_dir) as client:
            after = await _exported(client, agents)
            assert after.keys() == before.keys()
            assert after == before, "conversations, summaries, tool logs and attachments"
            for agent in agents:
                rec = await client.get_agent(agent)
                assert rec.state is AgentState.ARCHIVED and rec.local, rec
            # Own and runnable after unarchive.
            for agent in agents[::16]:
                await client.unarchive_agent(agent)
                kinds = [ev.kind.name async for ev in client.prompt(agent, "after the repair")]
                assert kinds[-1] == "RUN_FINISHED", kinds
        # Its own backup is listed and opens with this box's key (no recovery key).
        found = re.search(r"backup (bk_[0-9a-z]+) uploaded to the control plane", second.output())
        assert found, second.output()
        listing = _cli(new_dir, "backup", "list")
        assert re.search(rf"{found[1]} .* yes", listing), listing
        _cli(new_dir, "backup", "verify", found[1])
        # The next backup sends only what changed since (the agents run above).
        again = _cli(new_dir, "backup", "now")
        assert backup_id not in again and f"({len(agents[::16])} new, " in again, again
    finally:
        second.stop()

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


async def test_a_revoked_box_joins_again_as_a_new_machine_keeping_its_agents(
    cp: ControlProc, tmp_path: Path
) -> None:
    """Revoked (or its account deleted), a box's link stops for good and a re-pair
    is refused: ``join --as-new`` with a plain token makes it a new machine with
    the same data, and its agents still run (the old id stays one of its own).
    A live machine is refused (the same agents would run under two ids)."""
    account = _ok(cp.cli("account", "create", "--github-id", "9200", "--github-login", "dan"))
    account_id = next(w for w in account.split() if w.startswith("acct_"))
    data = tmp_path / "box"
    argv = _printed_command(_ok(cp.cli("token", "create", "--account", account_id)))
    first = Joined(argv, data, tmp_path / "first.log")
    try:
        first.wait_for("serving on")
        old_id = identity.load_link(data).machine_id
        async with _client(data) as client:
            agent = (await client.create_agent("kept", str(tmp_path))).id
            kinds = [ev.kind.name async for ev in client.prompt(agent, "before")]
            assert kinds[-1] == "RUN_FINISHED", kinds
    finally:
        first.stop()

    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}

    def join(*extra: str, folder: Path = data) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(MACHINE_EXE), *argv[1:], *extra, "--data-dir", str(folder)],
            capture_output=True, text=True, timeout=60, env=env, check=False,
        )  # fmt: skip

    live = join("--as-new")  # not revoked: refused before the token is used
    assert live.returncode == 2 and "has not been stopped for good" in live.stderr, live.stderr
    never = join("--as-new", folder=tmp_path / "never")
    assert never.returncode == 2, never.stderr
    assert "--as-new is for a data folder that was joined" in never.stderr

    _ok(cp.cli("machine", "revoke", old_id))
    serving = Joined(["agents-machine", "serve"], data, tmp_path / "serve.log")
    try:
        serving.wait_for("control link stopped for good")
        assert "--as-new" in serving.output()
    finally:
        serving.stop()

    again_argv = _printed_command(_ok(cp.cli("token", "create", "--account", account_id)))
    second = Joined([*again_argv, "--as-new"], data, tmp_path / "second.log")
    try:
        second.wait_for("joined again as the new machine")
        second.wait_for("serving on")
        new_id_ = identity.load_link(data).machine_id
        assert new_id_ != old_id and f"was {old_id}" in second.output()
        async with _client(data) as client:
            kinds = [ev.kind.name async for ev in client.prompt(agent, "after")]
            assert kinds[-1] == "RUN_FINISHED", kinds
            assert [a.id for a in await client.list_agents()] == [agent]
        listed = json.loads(_ok(cp.cli("machine", "list", "--json")))["machines"]
        assert {m["machine_id"] for m in listed} >= {new_id_}
    finally:
        second.stop()
