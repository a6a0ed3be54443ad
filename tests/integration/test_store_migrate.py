"""``agents-control store migrate`` for real: folder -> moto S3 (SIGKILLed in the
middle of the copy, then run again), ``serve`` on the migrated home, and back to
a folder."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers.control_proc import (
    ControlProc,
    agents_control_exe,
    run_init,
    s3_env,
    start_serve,
    stop_serve,
)

pytestmark = pytest.mark.integration


def _migrate(
    cp: ControlProc, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [str(agents_control_exe()), "store", "migrate", "--home", str(cp.home), *args]
    return subprocess.run(
        argv, env={**cp.env, **(env or {})}, capture_output=True, text=True, timeout=60
    )


def _accounts(cp: ControlProc) -> str:
    start_serve(cp)
    try:
        listed = cp.cli("account", "list")
        assert listed.code == 0, listed.err
        return listed.out
    finally:
        stop_serve(cp)


@pytest.mark.timeout(120)
def test_migrate_to_s3_killed_midway_then_serve_and_back_to_a_folder(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    env = s3_env(moto_endpoint)
    # Only the credentials come from the environment: a store setting there would
    # override config.toml, which the migration switches (it refuses that).
    env.pop("AGENTS_CONTROL_STORE_ENDPOINT")
    base = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_CONTROL_STORE")}
    os_env = {**base, **env}
    cp = run_init(tmp_path / "home", str(tmp_path / "folder"), os_env)
    start_serve(cp)
    try:
        made = cp.cli("account", "create", "--github-id", "7", "--github-login", "octo")
        assert made.code == 0, made.err
        account = re.search(r"acct_[0-9a-z]{26}", made.out)
        assert account
        token = cp.cli("token", "create", "--account", account.group(0))
        assert token.code == 0, token.err
    finally:
        stop_serve(cp)

    to = ["--to", f"s3://{s3_bucket}/cp", "--store-endpoint", moto_endpoint]
    killed = _migrate(cp, *to, env={"AGENTS_CONTROL_TEST_CRASH_IN_MIGRATE_AFTER": "10"})
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert (cp.home / "store-migrate.json").exists()
    assert str(tmp_path / "folder") in (cp.home / "config.toml").read_text()  # not switched

    done = _migrate(cp, *to)
    assert done.returncode == 0, done.stderr
    summary = re.search(r"migrated (\d+) objects \((\d+) bytes\) .* \((\d+) copied", done.stdout)
    assert summary, done.stdout
    objects, copied = int(summary.group(1)), int(summary.group(3))
    # The killed run saved its progress every 8 objects: the rerun skipped those.
    assert copied <= objects - 8, done.stdout
    assert not (cp.home / "store-migrate.json").exists()
    config = (cp.home / "config.toml").read_text()
    assert f"s3://{s3_bucket}/cp" in config and "testing-secret" not in config

    assert "octo" in _accounts(cp)  # served from the bucket

    back = _migrate(cp, "--to", str(tmp_path / "back"))
    assert back.returncode == 0, back.stderr
    assert "octo" in _accounts(cp)
