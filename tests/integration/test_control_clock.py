"""A control plane whose clock jumps: real processes, the clock moved by Debian's
libfaketime (tests/helpers/faketime.py), moto's S3 server as the store (its Date
header is the true time).

One deployment, restarted three times: 8 days ahead, a day behind, then on
time. Ahead, the queued prompt and its idempotency key survive (before, the
first read expired them all); behind, a token that expired by the store's clock
is refused (before, the slow clock kept it alive). Each time the log says how
far the clock is off and the skew gauge shows it; on time again, the machine
starts and the prompt runs exactly once.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.control_proc import (
    ControlProc,
    join_new_account,
    run_init,
    s3_env,
    start_serve,
    stop_serve,
)
from tests.helpers.faketime import faketime_env
from tests.helpers.machine_proc import run_cli
from tests.helpers.moto_server import free_port
from tests.helpers.poll import poll_until

pytestmark = pytest.mark.integration

DEADLINE = 40.0
DAY = 86400.0
MACHINE_EXE = Path(sys.executable).parent / "agents-machine"


@pytest.fixture
def cp(tmp_path: Path, moto_endpoint: str, s3_bucket: str) -> Iterator[ControlProc]:
    # Fixed ports: the machine finds the control plane again after each restart.
    ports = ["--listen", f"127.0.0.1:{free_port()}", "--link-listen", f"127.0.0.1:{free_port()}"]
    running = run_init(
        tmp_path / "home",
        f"s3://{s3_bucket}/cp",
        s3_env(moto_endpoint),
        ["--heartbeat-interval", "0.3", *ports],
    )
    with (running.home / "config.toml").open("a") as f:
        f.write("clock_check_seconds = 0.5\n")
    try:
        start_serve(running)
        yield running
    finally:
        stop_serve(running)


def _ok(res: Any) -> str:
    assert res.code == 0, res.err
    return str(res.out)


def _online(cp: ControlProc, want: bool) -> str:
    def check() -> str | None:
        listed = json.loads(_ok(cp.cli("machine", "list", "--json")))["machines"]
        return listed[0]["machine_id"] if listed and listed[0]["online"] is want else None

    return poll_until(check, deadline=DEADLINE, what=f"machine online={want}")


def _skew(cp: ControlProc) -> float | None:
    with urllib.request.urlopen(f"http://{cp.serve_info['metrics']}/metrics", timeout=15) as r:
        text = r.read().decode()
    m = re.search(r"^agents_cp_clock_skew_seconds (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _logged(cp: ControlProc, text: str) -> bool:
    assert cp.log_path is not None
    return text in cp.log_path.read_text(errors="replace")


def _prompt_ids(cp: ControlProc, machine_id: str, state: str = "queued") -> list[str]:
    listed = json.loads(_ok(cp.cli("prompt", "list", "--machine", machine_id, "--json")))
    return [p["prompt_id"] for p in listed["prompts"] if p["state"] == state]


def _send(cp: ControlProc, machine_id: str, agent: str) -> str:
    out = _ok(
        cp.cli(
            "prompt", "send", "--machine", machine_id, "--agent", agent,
            "--text", "kept through clock jumps", "--idempotency-key", "k-clock",
        )
    )  # fmt: skip
    m = re.match(r"prompt (pr_[0-9a-z]{26}) queued", out)
    assert m, out
    return m.group(1)


def _try_send(cp: ControlProc, machine_id: str, agent: str) -> str | None:
    """The first send: None while the control plane does not know the agent yet."""
    res = cp.cli(
        "prompt", "send", "--machine", machine_id, "--agent", agent,
        "--text", "kept through clock jumps", "--idempotency-key", "k-clock",
    )  # fmt: skip
    if res.code == 2 and f"agent {agent}: not found" in res.err:
        return None
    m = re.match(r"prompt (pr_[0-9a-z]{26}) queued", _ok(res))
    assert m, res.out
    return m.group(1)


def _restart(cp: ControlProc, offset: str | None) -> None:
    stop_serve(cp)
    start_serve(cp, env=faketime_env(offset) if offset else None)


def _runs_of(data: Path, prompt_id: str) -> list[str]:
    conn = sqlite3.connect(f"file:{data / 'machine.db'}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT state FROM runs WHERE prompt_id = ?", (prompt_id,)).fetchall()
    finally:
        conn.close()
    return [str(r[0]) for r in rows]


def test_a_clock_ahead_or_behind_loses_no_prompt_and_stretches_no_token(
    tmp_path: Path, cp: ControlProc
) -> None:
    data = tmp_path / "machine"
    joined = join_new_account(cp, data, tmp_path / "join.log", github_id=11, login="clock")
    serving: subprocess.Popen[bytes] | None = None
    try:
        machine_id = _online(cp, True)
        made = run_cli(data, "agent", "create", "c", "--folder", str(tmp_path), "--json")
        assert made.returncode == 0, made.stderr
        agent = json.loads(made.stdout)["agent_id"]
        joined.send_signal(signal.SIGTERM)
        assert joined.wait(timeout=DEADLINE) == 0
        _online(cp, False)
        account = json.loads(_ok(cp.cli("machine", "show", machine_id, "--json")))["account_id"]
        # A token that lives one second: long expired by the store's clock below.
        token = json.loads(
            _ok(cp.cli("token", "create", "--account", account, "--ttl", "1", "--json"))
        )
        # The stopped machine's roster reaches the store a moment after its
        # goodbye: a send is refused (queueing nothing) until it has.
        prompt = poll_until(
            lambda: _try_send(cp, machine_id, agent),
            deadline=DEADLINE,
            what="the machine's roster known to the control plane",
        )

        # Eight days ahead: a week-long TTL would have dropped the prompt.
        _restart(cp, "+8d")
        poll_until(lambda: _logged(cp, "ahead of the store's"), deadline=DEADLINE, what="log")
        skew = poll_until(lambda: _skew(cp), deadline=DEADLINE, what="the skew gauge")
        assert abs(skew - 8 * DAY) < 60, skew
        assert _prompt_ids(cp, machine_id) == [prompt]
        assert _send(cp, machine_id, agent) == prompt  # the key still answers

        # A day behind: the token is judged by the later clock, the store's.
        _restart(cp, "-1d")
        poll_until(lambda: _logged(cp, "behind the store's"), deadline=DEADLINE, what="log")
        skew = poll_until(lambda: _skew(cp), deadline=DEADLINE, what="the skew gauge")
        assert abs(skew + DAY) < 60, skew
        join = shlex.split(token["join_command"])
        other = tmp_path / "other"
        refused = subprocess.run(
            [str(MACHINE_EXE), *join[1:], "--data-dir", str(other), "--no-background"],
            capture_output=True,
            text=True,
            timeout=DEADLINE,
        )
        assert refused.returncode != 0 and "expired" in refused.stderr, refused.stderr
        assert _prompt_ids(cp, machine_id) == [prompt]

        # On time again: the machine starts and the prompt runs once.
        _restart(cp, None)
        poll_until(lambda: _skew(cp) is not None, deadline=DEADLINE, what="a reading")
        assert abs(_skew(cp) or 0.0) < 60
        with (tmp_path / "machine.log").open("wb") as log:
            serving = subprocess.Popen(
                [str(MACHINE_EXE), "--data-dir", str(data), "serve", "--no-background"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        poll_until(
            lambda: _runs_of(data, prompt) == ["finished"], deadline=DEADLINE, what="the run"
        )
        poll_until(
            lambda: _prompt_ids(cp, machine_id, "acknowledged") == [prompt],
            deadline=DEADLINE,
            what="acknowledged",
        )
        assert _prompt_ids(cp, machine_id) == []
        assert _runs_of(data, prompt) == ["finished"]
    finally:
        for proc in (joined, serving):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=DEADLINE)
