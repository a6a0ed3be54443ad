"""``agents-control fsck`` against a real control plane on moto's S3, after normal use:
it stays clean (no false finding), then names every object a bucket writer plants
(keys of no known shape, genuine objects copied to other keys, genuine objects whose
owner is gone), and ``--repair`` removes only what is garbage. And the
``store_object_lock`` setting: a bucket without Object Lock is refused at start."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.cli.client import AdminClient
from controlplane.integrity.records import (
    machine_revoked_key,
    presence_key,
    token_use_key,
)
from shared.ids import new_id
from tests.helpers.bucket import PREFIX, Bucket, locked_bucket
from tests.helpers.control_proc import (
    ControlProc,
    init_argv,
    join_new_account,
    run_init,
    s3_env,
    start_serve,
    stop_serve,
)
from tests.helpers.link_client import connect_once, join
from tests.helpers.machine_proc import run_cli
from tests.helpers.poll import poll_until

pytestmark = pytest.mark.integration

DEADLINE = 40.0
MACHINE_EXE = Path(sys.executable).parent / "agents-machine"


@pytest.fixture
def cp(tmp_path: Path, moto_endpoint: str, s3_bucket: str) -> Iterator[ControlProc]:
    running = run_init(tmp_path / "cp-home", f"s3://{s3_bucket}/cp", s3_env(moto_endpoint))
    try:
        start_serve(running)
        yield running
    finally:
        stop_serve(running)


def _ok(res: Any) -> str:
    assert res.code == 0, res.err
    return str(res.out)


def _json(cp: ControlProc, *args: str) -> Any:
    return json.loads(_ok(cp.cli(*args, "--json")))


def _online(cp: ControlProc, machine_id: str, want: bool) -> bool:
    listed = _json(cp, "machine", "list")["machines"]
    return any(m["machine_id"] == machine_id and m["online"] is want for m in listed)


def _fsck(cp: ControlProc, *args: str) -> tuple[int, dict[str, Any]]:
    res = cp.cli("fsck", "--json", *args, timeout=60)
    assert res.code in (0, 1), res.err
    return res.code, json.loads(res.out)


def _use(cp: ControlProc, tmp_path: Path) -> dict[str, str]:
    """Normal use: two accounts, a machine daemon joined (presence, roster), an agent,
    a backup, a keyed prompt queued while it is stopped and acknowledged once it runs
    again, a second machine revoked, a token never used, and the other account deleted."""
    data = tmp_path / "machine"
    joined = join_new_account(cp, data, tmp_path / "join.log", github_id=21, login="fsck")
    serving: subprocess.Popen[bytes] | None = None
    try:
        machine_id = poll_until(
            lambda: next((m["machine_id"] for m in _json(cp, "machine", "list")["machines"]), None),
            deadline=DEADLINE,
            what="the machine joined",
        )
        poll_until(lambda: _online(cp, machine_id, True), deadline=DEADLINE, what="online")
        made = run_cli(data, "agent", "create", "a", "--folder", str(tmp_path), "--json")
        assert made.returncode == 0, made.stderr
        agent = json.loads(made.stdout)["agent_id"]
        backup = run_cli(data, "backup", "now", "--json")
        assert backup.returncode == 0, backup.stderr
        joined.send_signal(signal.SIGTERM)
        assert joined.wait(timeout=DEADLINE) == 0
        poll_until(lambda: _online(cp, machine_id, False), deadline=DEADLINE, what="offline")
        account = _json(cp, "machine", "show", machine_id)["account_id"]
        sent = _ok(
            cp.cli(
                "prompt", "send", "--machine", machine_id, "--agent", agent,
                "--text", "hello", "--idempotency-key", "k-fsck",
            )
        )  # fmt: skip
        prompt = re.match(r"prompt (pr_[0-9a-z]{26}) queued", sent)
        assert prompt, sent
        with (tmp_path / "machine.log").open("wb") as log:
            serving = subprocess.Popen(
                [str(MACHINE_EXE), "--data-dir", str(data), "serve", "--no-background"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

        def acknowledged() -> bool:
            listed = _json(cp, "prompt", "list", "--machine", machine_id)["prompts"]
            return [p["state"] for p in listed] == ["acknowledged"]

        poll_until(acknowledged, deadline=DEADLINE, what="the prompt acknowledged")
        serving.send_signal(signal.SIGTERM)
        assert serving.wait(timeout=DEADLINE) == 0
    finally:
        for proc in (joined, serving):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=DEADLINE)
    # A second machine of the account, joined, confirmed and revoked; a token nobody
    # uses; another account with a token, deleted.
    revoked = asyncio.run(_joined(cp, account))
    _ok(cp.cli("machine", "revoke", revoked))
    _ok(cp.cli("token", "create", "--account", account))
    gone = _json(cp, "account", "create", "--github-id", "22", "--github-login", "two")
    _ok(cp.cli("token", "create", "--account", gone["account_id"]))
    deleted = _json(cp, "account", "delete", gone["account_id"], "--wait")
    assert deleted["state"] == "deleted"
    return {
        "account": account,
        "machine": machine_id,
        "gone": gone["account_id"],
        "revoked": revoked,
    }


async def _joined(cp: ControlProc, account: str) -> str:
    """A machine joined to ``account`` and confirmed by one connection."""
    async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=10) as admin:
        token = await admin.create_token(account)
    machine_id, cert, key = await join(cp.public, cp.ca_pem, token.token_value)
    await connect_once(cp.link, cp.ca_pem, cert, key)
    return machine_id


def test_fsck_stays_clean_after_use_and_names_every_planted_key(
    tmp_path: Path, cp: ControlProc, moto_endpoint: str, s3_bucket: str
) -> None:
    ids = _use(cp, tmp_path)
    acct, machine = ids["account"], ids["machine"]
    bucket = Bucket(moto_endpoint, s3_bucket, cp.home)
    try:
        everything = [k.removeprefix(PREFIX) for k in bucket.everything()]
        for part in (
            "/token-uses/",
            "/revoked/",
            "/queue-acked/",
            "/presence/",
            "/rosters/",
            "/backups/",
        ):
            assert any(part in k for k in everything), part
        assert f"deleted/{ids['gone']}.json" in everything
        # The most important check: normal use leaves nothing to report.
        code, report = _fsck(cp)
        assert (code, report["findings"]) == (0, []), report

        (acked,) = [k for k in everything if "/queue-acked/" in k]
        record = f"accounts/{acct}/machines/{machine}.json"
        ghost_machine, ghost_token = new_id("machine"), new_id("token")
        # kind, and whether --repair removes it.
        planted: dict[str, tuple[str, bool]] = {
            "notes.txt": ("unknown", False),  # no MAC: someone's file, kept
            f"{record}.bak": ("unknown", True),  # a genuine record's copy: garbage
            f"accounts/{acct}/backups/{machine}/segments/x": ("unknown", False),
            f"accounts/{acct}/revoked/{machine}.json": ("refused", False),
            acked.replace(machine, ids["revoked"]): ("misplaced", True),
            f"accounts/{ids['gone']}/machines/{machine}.json": ("deleted_leftover", True),
            presence_key(acct, ghost_machine): ("orphan", True),
            machine_revoked_key(acct, ghost_machine): ("orphan", False),
            token_use_key(acct, ghost_token, new_id("intent")): ("orphan", False),
            # Keys no store call of ours can read or delete: named, kept, no crash.
            "odd key.txt": ("unknown", False),
            f"accounts/{ids['gone']}/.hidden": ("unknown", False),
        }
        bucket.put("odd key.txt", b"x")
        bucket.put(f"accounts/{ids['gone']}/.hidden", b"x")
        bucket.put("notes.txt", b"someone's file")
        bucket.put(f"{record}.bak", bucket.get(record))
        bucket.put(f"accounts/{acct}/backups/{machine}/segments/x", b"bytes")
        bucket.put(f"accounts/{acct}/revoked/{machine}.json", bucket.get(record))
        bucket.put(acked.replace(machine, ids["revoked"]), bucket.get(acked))
        bucket.put(f"accounts/{ids['gone']}/machines/{machine}.json", bucket.get(record))
        for key in list(planted)[-5:-2]:
            # Genuine (sealed with the home's key) but owned by nothing.
            bucket.put(key, json.dumps({"machine_id": ghost_machine}).encode(), genuine=True)

        code, report = _fsck(cp)  # read-only, beside the running daemon
        found = {f["key"]: (f["kind"], f["repaired"]) for f in report["findings"]}
        assert code == 1
        assert found == {k: (kind, False) for k, (kind, _) in planted.items()}, report
        assert set(bucket.everything()) >= {PREFIX + k for k in planted}

        stop_serve(cp)
        code, report = _fsck(cp, "--repair")
        found = {f["key"]: (f["kind"], f["repaired"]) for f in report["findings"]}
        assert code == 1 and found == planted, report
        left = {k.removeprefix(PREFIX) for k in bucket.everything()}
        assert not {k for k, (_, removed) in planted.items() if removed} & left
        assert {k for k, (_, removed) in planted.items() if not removed} <= left
        assert {record, acked} <= left

        start_serve(cp)
        code, report = _fsck(cp)
        assert {f["key"] for f in report["findings"]} == {
            k for k, (_, removed) in planted.items() if not removed
        }
        # The deployment still works after the repair.
        assert _json(cp, "machine", "show", machine)["machine_id"] == machine
    finally:
        bucket.close()


def _serve_once(home: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "agents-control"
    return subprocess.run(
        [str(exe), "serve", "--home", str(home)],
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )


def test_store_object_lock_refuses_a_bucket_without_it_and_serves_one_with_it(
    tmp_path: Path, moto_endpoint: str, s3_bucket: str
) -> None:
    env = s3_env(moto_endpoint)
    # init with the setting on a bucket made without Object Lock: refused, one line.
    home = tmp_path / "refused"
    argv = init_argv(home, f"s3://{s3_bucket}/cp", ["--store-object-lock"])
    full_env = {**os.environ, **env}
    refused = subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and s3_bucket in lines[0] and "ObjectLockEnabled" in lines[0], lines
    assert "store_object_lock" in lines[0]

    # A deployment made without it, then told its bucket has it: serve refuses.
    cp = run_init(tmp_path / "plain", f"s3://{s3_bucket}/cp", env)
    with (cp.home / "config.toml").open("a") as f:
        f.write("store_object_lock = true\n")
    served = _serve_once(cp.home, cp.env)
    assert served.returncode == 2, served.stderr
    # Its one line (serve logs before it opens the store: only the log lines besides).
    lines = [x for x in served.stderr.splitlines() if x.startswith("agents-control:")]
    assert len(lines) == 1 and s3_bucket in lines[0] and "ObjectLockEnabled" in lines[0], lines
    assert served.stderr.strip().splitlines()[-1] == lines[0]

    # A bucket with Object Lock and a default retention: init writes the setting, serve
    # checks it and runs, and normal use leaves fsck clean.
    with locked_bucket(moto_endpoint) as name:
        locked = run_init(tmp_path / "locked", f"s3://{name}/cp", env, ["--store-object-lock"])
        assert "store_object_lock = true" in (locked.home / "config.toml").read_text()
        try:
            start_serve(locked)
            made = _json(locked, "account", "create", "--github-id", "5", "--github-login", "l")
            _ok(locked.cli("token", "create", "--account", made["account_id"]))
            code, report = _fsck(locked)
            assert (code, report["findings"]) == (0, []), report
        finally:
            stop_serve(locked)
