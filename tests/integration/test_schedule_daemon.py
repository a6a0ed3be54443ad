"""Schedules on a real daemon: the CLI, fires recorded as schedule runs, SIGKILL after a fire."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from tests.helpers.machine_proc import MachineProc, run_cli
from tests.helpers.poll import poll_until

pytestmark = pytest.mark.integration

DEADLINE = 30.0
#: The test hook (machine.toml only): `* * * * *` fires every this many seconds.
EVERY = 2


def rows(data_dir: Path, sql: str, *args: object) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(f"file:{data_dir / 'machine.db'}?mode=ro", uri=True)
    try:
        return list(conn.execute(sql, args))
    finally:
        conn.close()


def fires(data_dir: Path, schedule_id: str) -> list[tuple[float, str, str]]:
    got = rows(
        data_dir,
        "SELECT fire_time, run_id, result FROM schedule_runs WHERE schedule_id = ?"
        " ORDER BY fire_time",
        schedule_id,
    )
    return [(float(str(f)), str(r), str(res)) for f, r, res in got]


def cli_ok(data_dir: Path, *args: str) -> str:
    done = run_cli(data_dir, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def cli_refused(data_dir: Path, *args: str) -> str:
    done = run_cli(data_dir, *args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) <= 2  # the message and maybe a hint
    return done.stderr.strip().splitlines()[0]


def test_schedule_fires_survive_sigkill_neither_lost_nor_repeated(
    machine_proc: Callable[..., MachineProc], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / "machine.toml").write_text(f"schedule_test_seconds = {EVERY}\nprompt_limit = 1000\n")
    proc = machine_proc().start()
    with grpc.insecure_channel(proc.target) as channel:
        stub = pb_grpc.MachineServiceStub(channel)
        agent = stub.CreateAgent(pb.CreateAgentRequest(name="a", folder=str(tmp_path))).id
        other = stub.CreateAgent(pb.CreateAgentRequest(name="b", folder=str(tmp_path))).id
        stub.ArchiveAgent(pb.ArchiveAgentRequest(agent_id=other))
        for request, code, what in (
            (
                pb.CreateScheduleRequest(
                    agent_id=agent, cron="* * * * *", prompt="x", time_zone="Mars/Base"
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "time_zone",
            ),
            (
                pb.CreateScheduleRequest(agent_id=agent, cron="* * * * *", prompt="x" * 2000),
                grpc.StatusCode.INVALID_ARGUMENT,
                "prompt",
            ),
            (
                pb.CreateScheduleRequest(agent_id=other, cron="* * * * *", prompt="x"),
                grpc.StatusCode.FAILED_PRECONDITION,
                "archived",
            ),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                stub.CreateSchedule(request)
            assert refused.value.code() == code and what in (refused.value.details() or "")
    # The CLI: one line, exit 2, nothing written.
    assert "cron" in cli_refused(
        data, "schedule", "add", agent, "--cron", "61 * * * *", "--text", "x"
    )
    assert "archived" in cli_refused(
        data, "schedule", "add", other, "--cron", "* * * * *", "--text", "x"
    )
    assert rows(data, "SELECT COUNT(*) FROM schedules") == [(0,)]

    sid = cli_ok(
        data, "schedule", "add", agent, "--cron", "* * * * *", "--text", "tick", "--missed", "once"
    ).strip()
    listed = json.loads(cli_ok(data, "--json", "schedule", "list", agent))["schedules"]
    assert [(s["schedule_id"], s["enabled"], s["missed"]) for s in listed] == [(sid, True, "once")]

    # Two fires recorded, then SIGKILL the moment a third is.
    poll_until(lambda: len(fires(data, sid)) >= 2, deadline=DEADLINE, what="two fires")
    seen = len(fires(data, sid))
    poll_until(lambda: len(fires(data, sid)) > seen, deadline=DEADLINE, what="the next fire")
    proc.kill()
    before = fires(data, sid)

    proc.start()
    poll_until(
        lambda: len(fires(data, sid)) >= len(before) + 2, deadline=DEADLINE, what="fires after"
    )
    after = fires(data, sid)
    # Nothing recorded before the crash was lost or changed...
    assert after[: len(before)] == before
    # ...no fire time twice, fire times on the schedule's grid, one run per fire
    # and no run without its fire (they commit together).
    times = [f for f, _, _ in after]
    assert times == sorted(set(times))
    assert all(f % EVERY == 0 for f in times)
    assert all(result in ("fired", "caught_up") for _, _, result in after)
    orphan_runs = rows(
        data,
        "SELECT COUNT(*) FROM runs r LEFT JOIN schedule_runs s ON s.run_id = r.id"
        " WHERE r.agent_id = ? AND s.run_id IS NULL",
        agent,
    )
    fires_without_run = rows(
        data,
        "SELECT COUNT(*) FROM schedule_runs s LEFT JOIN runs r ON r.id = s.run_id"
        " WHERE s.schedule_id = ? AND r.id IS NULL",
        sid,
    )
    assert orphan_runs == [(0,)] and fires_without_run == [(0,)]

    # The last fire before the crash ran (or ends interrupted, as any run in
    # flight at a crash does); nothing stays queued.
    last_run = before[-1][1]

    def ended() -> bool:
        state = rows(data, "SELECT state FROM runs WHERE id = ?", last_run)[0][0]
        return state in ("finished", "interrupted")

    poll_until(ended, deadline=DEADLINE, what="the last fire's run")

    out = json.loads(cli_ok(data, "--json", "schedule", "runs", sid, "--limit", "1000"))["runs"]
    assert {r["run_id"] for r in out} >= {run_id for _, run_id, _ in before}

    cli_ok(data, "schedule", "pause", sid)
    assert rows(data, "SELECT state FROM schedules WHERE id = ?", sid) == [("paused",)]
    deleted = json.loads(cli_ok(data, "--json", "schedule", "delete", sid))
    assert deleted == {"schedule_id": sid, "deleted": True}
    assert fires(data, sid) == []
    assert rows(data, "SELECT id FROM schedules WHERE id = ?", sid) == []
    # Deleting it again: it is gone (NOT_FOUND, exit 2), and a malformed id is named.
    assert sid in cli_refused(data, "schedule", "delete", sid)
    with grpc.insecure_channel(proc.target) as channel:
        with pytest.raises(grpc.RpcError) as gone:
            pb_grpc.MachineServiceStub(channel).DeleteSchedule(
                pb.DeleteScheduleRequest(schedule_id=sid)
            )
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    proc.stop()
