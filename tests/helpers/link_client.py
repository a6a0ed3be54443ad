"""A bare machine-side client for integration tests: Join and one Connect, over real TLS."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio

from shared import tls
from shared.pb.control.v1 import link_pb2, link_pb2_grpc

__all__ = ["connect_once", "join"]


async def join(public: str, ca_pem: bytes, token: str) -> tuple[str, bytes, bytes]:
    """Join with ``token`` on the public listener; (machine id, certificate, key)."""
    key = tls.new_tls_key()
    async with grpc.aio.secure_channel(public, grpc.ssl_channel_credentials(ca_pem)) as ch:
        reply = await link_pb2_grpc.MachineLinkStub(ch).Join(
            link_pb2.JoinRequest(
                token=token,
                csr_pem=tls.build_csr(key).decode(),
                machine=link_pb2.MachineInfo(name="m", version="1", hostname="h"),
                take_over=True,  # a repair token's tests take the machine over
            ),
            timeout=20,
        )
    return reply.machine_id, reply.certificate_pem.encode(), tls.private_key_pem(key)


async def connect_once(link: str, ca_pem: bytes, cert: bytes, key: bytes) -> None:
    """Connect with a machine certificate until welcomed (this confirms a join), then leave."""
    creds = grpc.ssl_channel_credentials(ca_pem, private_key=key, certificate_chain=cert)
    async with grpc.aio.secure_channel(link, creds) as ch:
        stub: Any = link_pb2_grpc.MachineLinkStub(ch)
        call = stub.Connect()
        await call.write(link_pb2.MachineMessage(hello=link_pb2.Hello(version="1")))
        first = await asyncio.wait_for(call.read(), 10)
        assert first is not grpc.aio.EOF and first.WhichOneof("kind") == "welcome", first  # type: ignore[attr-defined]
        call.cancel()
