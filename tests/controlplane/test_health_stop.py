"""gRPC health goes NOT_SERVING as soon as a graceful stop begins, before the drain."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.controlplane.access.test_security import control


async def test_health_not_serving_at_start_of_graceful_stop(tmp_path: Path) -> None:
    async with control(tmp_path) as env:
        async with env.public_channel() as ch:
            watch: Any = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service="")
            )
            first = await asyncio.wait_for(watch.read(), 5)
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            stopping = asyncio.create_task(env.cp.stop(2))
            try:
                update = await asyncio.wait_for(watch.read(), 5)
                assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING
            finally:
                await stopping
