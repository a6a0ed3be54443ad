"""A stopped machine is woken for its schedule: agents-control with the `local`
provider and a joined agents-machine, for real (moto's S3 server as the store).

The machine runs a schedule (the seconds test hook: `* * * * *` fires every
20 s) and reports its next fire time in its heartbeats. It is stopped right
after a fire; with no prompt queued, the control plane asks the provider to
start it `wake_lead_seconds` before the next fire time, and that fire runs on
time: recorded as `fired` (with the default `skip` policy, a late start would
have skipped it).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import signal
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from controlplane.cli.admin_types import Machine
from controlplane.cli.client import AdminClient
from tests.helpers.control_proc import (
    ControlProc,
    join_new_account,
    run_init,
    s3_env,
    start_serve,
    stop_serve,
)
from tests.helpers.machine_proc import run_cli
from tests.helpers.poll import apoll_until

pytestmark = pytest.mark.integration

HEARTBEAT = 0.3
# A fire every 20 s (a test waits up to two periods); the wake comes 16 s before
# the next fire: the 4 s after a fire are for stopping the machine (a stop that
# takes longer is woken at once), the 16 s before the next for the provider to
# start it and for it to connect, on a loaded machine too.
EVERY = 20
LEAD = 16
DEADLINE = 40.0
MACHINE_EXE = Path(sys.executable).parent / "agents-machine"


@pytest.fixture
def cp(tmp_path: Path, moto_endpoint: str, s3_bucket: str) -> Iterator[ControlProc]:
    running = run_init(
        tmp_path / "home",
        f"s3://{s3_bucket}/cp",
        s3_env(moto_endpoint),
        ["--heartbeat-interval", str(HEARTBEAT)],
    )
    with (running.home / "config.toml").open("a") as f:
        f.write(f"wake_lead_seconds = {LEAD}\nwake_check_seconds = 0.5\n")
    try:
        start_serve(running)
        yield running
    finally:
        stop_serve(running)


def _ok(res: Any) -> str:
    assert res.code == 0, res.err
    return str(res.out)


def _fires(data: Path) -> list[tuple[float, str, str]]:
    conn = sqlite3.connect(f"file:{data / 'machine.db'}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT fire_time, result, run_id FROM schedule_runs ORDER BY fire_time"
        ).fetchall()
    finally:
        conn.close()
    return [(float(f), str(r), str(run)) for f, r, run in rows]


def _run_state(data: Path, run_id: str) -> str:
    conn = sqlite3.connect(f"file:{data / 'machine.db'}?mode=ro", uri=True)
    try:
        return str(conn.execute("SELECT state FROM runs WHERE id = ?", (run_id,)).fetchone()[0])
    finally:
        conn.close()


def _serving_started(data: Path) -> float | None:
    """When the machine the local provider started was created (None: not running)."""
    for proc in psutil.process_iter(["cmdline", "create_time"]):
        cmd = proc.info.get("cmdline") or []
        if str(data) in cmd and "serve" in cmd:
            return float(proc.info["create_time"])
    return None


def _kill_serving(data: Path) -> None:
    """Kill the machine the local provider started (its own session outlives the test)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if str(data) in cmd and "serve" in cmd:
            with contextlib.suppress(psutil.Error):
                proc.kill()
                proc.wait(timeout=DEADLINE)


async def test_stopped_machine_is_started_for_its_schedule(tmp_path: Path, cp: ControlProc) -> None:
    data = tmp_path / "machine"
    data.mkdir(mode=0o700)
    # The test hook (machine.toml only): fires at :00, :20 and :40 of each minute.
    (data / "machine.toml").write_text(f"schedule_test_seconds = {EVERY}\n")
    joined = join_new_account(cp, data, tmp_path / "join.log", github_id=7, login="w")
    try:
        async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=15) as client:

            async def joined_id() -> str | None:
                listed = await client.list_machines()
                return listed[0].machine_id if listed and listed[0].online else None

            machine_id = await apoll_until(joined_id, deadline=DEADLINE, what="joined")
            made = run_cli(data, "agent", "create", "w", "--folder", str(tmp_path), "--json")
            assert made.returncode == 0, made.stderr
            agent = json.loads(made.stdout)["agent_id"]
            added = run_cli(data, "schedule", "add", agent, "--cron", "* * * * *", "--text", "tick")
            assert added.returncode == 0, added.stderr

            async def reported() -> Machine | None:
                m = await client.get_machine(machine_id)
                return m if m.next_fire_at else None

            await apoll_until(reported, deadline=DEADLINE, what="next fire reported")
            # No provider: nothing would wake it, and the listing says so.
            listing = _ok(cp.cli("machine", "list"))
            assert "no provider set" in listing, listing
            serve = [str(MACHINE_EXE), "--data-dir", str(data), "serve", "--no-background"]
            settings = json.dumps({"command": serve})
            _ok(cp.cli("machine", "provider", "set", machine_id, "local", "--settings", settings))

            # Stop the machine right after a fire, once the control plane knows the next one.
            seen = len(_fires(data))
            await apoll_until(lambda: len(_fires(data)) > seen, deadline=DEADLINE, what="a fire")
            last = _fires(data)[-1][0]

            async def next_known() -> bool:
                m = await client.get_machine(machine_id)
                return m.next_fire_at is not None and m.next_fire_at.timestamp() > last

            await apoll_until(next_known, deadline=DEADLINE, what="the next fire reported")
            joined.send_signal(signal.SIGTERM)
            assert joined.wait(timeout=DEADLINE) == 0
            stopped_at = dt.datetime.now(dt.UTC).timestamp()
            due = last + EVERY
            assert due > stopped_at, "stopped after the next fire already came"

            m = await client.get_machine(machine_id)
            assert m.has_provider and m.next_wake_at

            # The stopped link must be seen closed first: the control plane writes
            # last seen before it forgets the session, and an `online` read in
            # that moment is the old process, not the woken one.
            async def stopped() -> bool:
                return not (await client.get_machine(machine_id)).online

            await apoll_until(stopped, deadline=DEADLINE, what="seen offline")

            async def restarted() -> bool:
                return (await client.get_machine(machine_id)).online

            await apoll_until(restarted, deadline=DEADLINE, what="woken by its provider")
            started = _serving_started(data)
            assert started is not None and started < due, (
                f"woken too late for the fire: started {started}, fire at {due}"
            )
            after = await apoll_until(
                lambda: [f for f in _fires(data) if f[0] >= due] or None,
                deadline=DEADLINE,
                what="the fire after the wake",
            )
            assert after[0][:2] == (due, "fired")
            await apoll_until(
                lambda: _run_state(data, after[0][2]) == "finished",
                deadline=DEADLINE,
                what="the scheduled run",
            )
    finally:
        if joined.poll() is None:
            joined.kill()
            joined.wait(timeout=DEADLINE)
        _kill_serving(data)
