"""serve() in-process: socket mode, TCP on loopback, health, metrics, clean stop."""

from __future__ import annotations

import asyncio
import stat
import urllib.request
from pathlib import Path

import grpc
import grpc.aio
import pytest
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
        token_file = cfg.data_dir / "keys" / "local-api-token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{info.tcp_port}") as channel:
            # TCP reaches every local user: without the data folder's token, nothing.
            stub = pb_grpc.MachineServiceStub(channel)
            for md in [(), (("authorization", "Bearer wrong"),), (("authorization", token),)]:
                try:
                    await stub.Status(pb.StatusRequest(), metadata=md)
                    raise AssertionError("TCP call without the token must be refused")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
                    # ...and no hint about the host: not where the token lives.
                    assert "missing or wrong bearer token" in (e.details() or "")
                    assert "local-api-token" not in (e.details() or "")
                    assert str(cfg.data_dir) not in (e.details() or "")
            try:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                raise AssertionError("health on TCP also needs the token")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED
        auth = grpc.metadata_call_credentials(
            lambda _ctx, callback: callback((("authorization", f"Bearer {token}"),), None)
        )
        creds = grpc.composite_channel_credentials(grpc.local_channel_credentials(), auth)
        async with grpc.aio.secure_channel(f"127.0.0.1:{info.tcp_port}", creds) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = pb_grpc.MachineServiceStub(channel)
            agent = await stub.CreateAgent(pb.CreateAgentRequest(name="m", folder=str(tmp_path)))
            _ = [e async for e in stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="hi"))]
            status = await stub.Status(pb.StatusRequest())
            assert status.active_agents == 1 and "echo" in status.runtimes
            listed = await stub.ListSchedules(pb.ListSchedulesRequest())
            assert list(listed.schedules) == []
            # A refused streaming call answers with our status too.
            with pytest.raises(grpc.aio.AioRpcError) as export:
                _ = [c async for c in stub.Export(pb.ExportRequest())]
            assert export.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at least one agent" in (export.value.details() or "")
        url = f"http://127.0.0.1:{info.metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        text = body.decode()
        assert 'agents_machine_runs_finished_total{outcome="finished"} 1.0' in text
        assert "agents_machine_db_commit_batch_size_bucket" in text
        assert "agents_machine_backup_last_success_timestamp_seconds" in text
        assert "agents_machine_restore_check_ok" in text
        # Every MachineService call is counted once, streams and refusals included.
        calls = 'agents_machine_calls_total{code="%s",method="%s"} %s'
        assert calls % ("UNAUTHENTICATED", "Status", "3.0") in text
        assert calls % ("OK", "Status", "1.0") in text
        assert calls % ("OK", "Prompt", "1.0") in text
        assert calls % ("INVALID_ARGUMENT", "Export", "1.0") in text
        assert "Check" not in text  # health is not MachineService
        assert "ag_" not in text  # no ids as label values
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    assert not info.socket.exists()


MIB = 1024 * 1024


async def test_default_limits(tmp_path: Path) -> None:
    # Built as `agents-machine serve` builds it with no limit flags, env or file.
    cfg = MachineConfig.build(
        flags={"data_dir": str(tmp_path / "data"), "background_loops": False},
        env={},
        home=tmp_path,
    )
    assert (cfg.prompt_limit, cfg.attachment_limit) == (1 * MIB, 20 * MIB)
    assert MachineConfig(data_dir=tmp_path).prompt_limit == 1 * MIB
    assert MachineConfig(data_dir=tmp_path).attachment_limit == 20 * MIB
    ready: asyncio.Future[ServeInfo] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(serve(cfg, ready=ready.set_result, stop=stop))
    try:
        info = await asyncio.wait_for(ready, 10)
        async with grpc.aio.insecure_channel(f"unix://{info.socket}") as channel:
            stub = pb_grpc.MachineServiceStub(channel)
            agent = await stub.CreateAgent(pb.CreateAgentRequest(name="m", folder=str(tmp_path)))
            call = stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="x" * (MIB + 1)))
            try:
                _ = [e async for e in call]
                raise AssertionError("a prompt over 1 MiB should be refused")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (e.details() or "").startswith("prompt: larger than the limit of 1048576")
            runs = await stub.ListRuns(pb.ListRunsRequest(agent_id=agent.id))
            assert list(runs.runs) == []
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
