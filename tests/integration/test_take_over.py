"""A lost stand-alone machine's disk is gone: a fresh box takes it over from its bucket
with the recovery key (`backup take-over`), SIGKILLed once inside the restore, then
run again; it is that machine after, its agents run, and it backs up to the same prefix."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY
from tests.helpers.machine_proc import MachineProc, run_cli

pytestmark = pytest.mark.integration


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def _replay(data: Path, agent: str) -> list[str]:
    out = _ok(run_cli(data, "--json", "agent", "replay", agent))
    return [line for line in out.splitlines() if line.strip()]


def test_a_fresh_box_takes_over_a_lost_machine_from_its_bucket(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    url = f"s3://{s3_bucket}/laptop"
    env = {"AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": TEST_SECRET_KEY}
    toml = f'backup_target = "{url}"\nbackup_store_endpoint = "{moto_endpoint}"\n'
    lost, new, work = tmp_path / "lost", tmp_path / "new", tmp_path / "work"
    for folder in (lost, new):
        folder.mkdir(mode=0o700)
        (folder / "machine.toml").write_text(toml)
    work.mkdir()
    key_file = tmp_path / "recovery.key"

    with MachineProc(lost, env=env):
        lost_id = json.loads(_ok(run_cli(lost, "--json", "status")))["machine_id"]
        agent = _ok(run_cli(lost, "agent", "create", "kept", "--folder", str(work))).strip()
        _ok(run_cli(lost, "agent", "prompt", agent, "words from before the fire"))
        key_file.write_text(_ok(run_cli(lost, "backup", "recovery-key")))
        key_file.chmod(0o600)
        _ok(run_cli(lost, "backup", "now"))
        before = _replay(lost, agent)
    # The disk is gone (the folder is not used again).

    # Before: what the lost machine's prefix holds, opened with its recovery key.
    with MachineProc(new, env={**env, "AGENTS_MACHINE_BACKUP_TARGET": str(tmp_path / "b")}):
        blind = _ok(run_cli(new, "backup", "list", "--from", url))
        assert "no (another key)" in blind and " ? " in blind
        keyed = _ok(run_cli(new, "backup", "list", "--from", url, "--recovery-key", str(key_file)))
        assert "no (another key)" not in keyed and " yes " in keyed
    take = ("backup", "take-over", "--from", url, "--recovery-key", str(key_file))
    crash = {**env, "AGENTS_MACHINE_TEST_CRASH_IN_TRANSFER_AFTER_AGENTS": "1"}
    killed = run_cli(new, *take, env=crash, timeout=60)
    assert killed.returncode == -9, killed.stderr  # SIGKILLed inside the transaction
    # Nothing of it committed: this box is still itself, with no agent (and so the
    # lost machine's prefix is not its own: a folder for now).
    elsewhere = {**env, "AGENTS_MACHINE_BACKUP_TARGET": str(tmp_path / "for-now")}
    refused = run_cli(new, "serve", env=env, timeout=60)
    assert refused.returncode == 2 and "backup take-over --from" in refused.stderr
    with MachineProc(new, env=elsewhere):
        st = json.loads(_ok(run_cli(new, "--json", "status")))
        assert st["machine_id"] != lost_id
        assert json.loads(_ok(run_cli(new, "--json", "agent", "list", "--all")))["agents"] == []
        # A running daemon holds the folder: the take-over waits for it to stop.
        busy = run_cli(new, *take, env=elsewhere)
        assert busy.returncode == 2 and "stop the daemon first" in busy.stderr

    done = run_cli(new, *take, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"this machine is now {lost_id}" in done.stdout
    assert "restored 1 agents" in done.stdout

    with MachineProc(new, env=env):
        st = json.loads(_ok(run_cli(new, "--json", "status")))
        assert st["machine_id"] == lost_id
        assert _replay(new, agent) == before  # byte for byte, as the lost machine had it
        _ok(run_cli(new, "agent", "unarchive", agent))
        _ok(run_cli(new, "agent", "prompt", agent, "words from after"))
        # Its backups go on in the lost machine's prefix, under its name.
        _ok(run_cli(new, "backup", "now"))
        listed = json.loads(_ok(run_cli(new, "--json", "backup", "list")))["backups"]
        assert listed[0]["opens"] is True
        after = _replay(new, agent)
    assert after[: len(before)] == before and len(after) > len(before)
