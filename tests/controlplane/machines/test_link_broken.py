"""A machine killed with SIGKILL is a ``broken`` link; one that says goodbye is ``closed``.

The control plane runs in-process (both TLS listeners, a folder store); the
killed machine is a real subprocess holding a Connect stream.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from shared.pb.control.v1 import link_pb2, link_pb2_grpc
from tests.controlplane.access.test_security import Env, control, new_token, wait_for_value
from tests.helpers.link_client import join

# The machine side of a Connect stream, heartbeating until it is killed.
_CHILD = """
import asyncio, sys
import grpc, grpc.aio
from shared.pb.control.v1 import link_pb2, link_pb2_grpc

async def main():
    link, ca, cert, key = sys.argv[1], *(open(p, "rb").read() for p in sys.argv[2:5])
    creds = grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)
    async with grpc.aio.secure_channel(link, creds) as ch:
        call = link_pb2_grpc.MachineLinkStub(ch).Connect()
        await call.write(link_pb2.MachineMessage(hello=link_pb2.Hello(version="1")))
        await call.read()
        print("welcomed", flush=True)
        while True:
            await call.write(link_pb2.MachineMessage(heartbeat=link_pb2.Heartbeat()))
            await asyncio.sleep(0.1)

asyncio.run(main())
"""


async def _machine(env: Env, tmp: Path) -> tuple[bytes, bytes]:
    _, token = await new_token(env)
    _, cert, key = await join(env.public, env.ca, token)
    return cert, key


async def test_killed_machine_is_broken_not_closed(tmp_path: Path) -> None:
    async with control(tmp_path, heartbeat_interval=5) as env:
        cert, key = await _machine(env, tmp_path)
        files = []
        for name, data in (("ca", env.ca), ("cert", cert), ("key", key)):
            (tmp_path / name).write_bytes(data)
            files.append(str(tmp_path / name))
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, env.link, *files],
            stdout=subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[3],
        )
        try:
            assert child.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 20)
            assert line.strip() == b"welcomed"
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
        finally:
            child.kill()
            child.wait(timeout=10)
            if child.stdout is not None:
                child.stdout.close()
        assert await wait_for_value(lambda: env.disconnects("broken"), 1.0) == 1.0
        assert env.disconnects("closed") == 0


async def test_machine_that_half_closes_is_closed(tmp_path: Path) -> None:
    async with control(tmp_path, heartbeat_interval=5) as env:
        cert, key = await _machine(env, tmp_path)
        async with env.link_channel(cert, key) as ch:
            call: Any = link_pb2_grpc.MachineLinkStub(ch).Connect()  # type: ignore[call-arg]
            await call.write(link_pb2.MachineMessage(hello=link_pb2.Hello(version="1")))
            assert (await call.read()).WhichOneof("kind") == "welcome"
            await call.done_writing()
            assert await asyncio.wait_for(call.code(), 5) == grpc.StatusCode.OK
        assert await wait_for_value(lambda: env.disconnects("closed"), 1.0) == 1.0
        assert env.disconnects("broken") == 0
