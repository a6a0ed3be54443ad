"""The machine daemon's stop and restart as a real process: health while draining,
the duration of a run interrupted by a crash."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
from collections.abc import Callable
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from tests.helpers.machine_proc import MachineProc

pytestmark = pytest.mark.integration

DEADLINE = 20.0
HOUR = 3600.0


async def test_health_is_not_serving_from_the_start_of_a_graceful_stop(
    machine_proc: Callable[..., MachineProc], tmp_path: Path
) -> None:
    proc = machine_proc().start()
    assert proc.proc is not None
    async with grpc.aio.insecure_channel(proc.target) as channel:
        stub = pb_grpc.MachineServiceStub(channel)
        agent = await stub.CreateAgent(pb.CreateAgentRequest(name="a", folder=str(tmp_path)))
        # A run that outlasts the grace period keeps the daemon draining.
        slow = stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="/slow 500 " + "w " * 40))
        assert (await asyncio.wait_for(slow.read(), DEADLINE)).kind == pb.RUN_STARTED
        proc.proc.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(channel)
        # The first answer after the signal already says NOT_SERVING, for every service.
        for service in ("", "shared.pb.machine.v1.MachineService"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING, service
        slow.cancel()
    assert proc.stop() == 0


async def test_interrupted_run_duration_excludes_the_downtime(
    machine_proc: Callable[..., MachineProc], tmp_path: Path
) -> None:
    proc = machine_proc().start()
    async with grpc.aio.insecure_channel(proc.target) as channel:
        stub = pb_grpc.MachineServiceStub(channel)
        agent = await stub.CreateAgent(pb.CreateAgentRequest(name="a", folder=str(tmp_path)))
        slow = stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="/slow 200 " + "w " * 40))
        seen = [await asyncio.wait_for(slow.read(), DEADLINE) for _ in range(3)]
        proc.kill()  # a crash mid-run
        slow.cancel()
    run_id = seen[0].run_id
    # The crash was an hour ago: move everything the run stored back by an hour.
    conn = sqlite3.connect(proc.data_dir / "machine.db")
    with conn:
        conn.execute("UPDATE runs SET started_at = started_at - ? WHERE id = ?", (HOUR, run_id))
        conn.execute("UPDATE events SET time = time - ? WHERE run_id = ?", (HOUR, run_id))
    conn.close()

    proc.start()
    async with grpc.aio.insecure_channel(proc.target) as channel:
        stub = pb_grpc.MachineServiceStub(channel)
        run = await stub.GetRun(pb.GetRunRequest(run_id=run_id))
    assert run.state == pb.RUN_STATE_INTERRUPTED
    # It ran for well under a minute before the crash; the hour down is not counted.
    assert 0 <= run.duration_ms < 60_000, run.duration_ms
    assert proc.stop() == 0
