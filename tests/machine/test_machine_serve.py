"""serve() in-process: socket mode, TCP on loopback, health, metrics, clean stop."""

from __future__ import annotations

import asyncio
import stat
import urllib.request
from pathlib import Path

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from machine.config import MachineConfig
from machine.daemon import ServeInfo, serve
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc


async def test_serve_until_stopped(tmp_path: Path) -> None:
    cfg = MachineConfig(
        data_dir=tmp_path / "data",
        tcp_address="127.0.0.1:0",
        metrics_address="127.0.0.1:0",
        background_loops=False,
        shutdown_grace_seconds=0,
    )
    ready: asyncio.Future[ServeInfo] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(serve(cfg, ready=ready.set_result, stop=stop))
    try:
        info = await asyncio.wait_for(ready, 10)
        assert stat.S_IMODE(info.socket.stat().st_mode) == 0o600
        assert stat.S_IMODE(cfg.data_dir.stat().st_mode) == 0o700
        assert info.tcp_port and info.metrics_port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{info.tcp_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = pb_grpc.MachineServiceStub(channel)
            agent = await stub.CreateAgent(pb.CreateAgentRequest(name="m", folder=str(tmp_path)))
            _ = [e async for e in stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="hi"))]
            status = await stub.Status(pb.StatusRequest())
            assert status.active_agents == 1 and "echo" in status.runtimes
            try:
                await stub.BackupNow(pb.BackupNowRequest())
                raise AssertionError("BackupNow should be unimplemented")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNIMPLEMENTED
                assert "later issue" in (e.details() or "")
        url = f"http://127.0.0.1:{info.metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        text = body.decode()
        assert 'agents_machine_runs_finished_total{outcome="finished"} 1.0' in text
        assert "agents_machine_db_commit_batch_size_bucket" in text
        assert "ag_" not in text  # no ids as label values
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    assert not info.socket.exists()
