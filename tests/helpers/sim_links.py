"""Simulated machines for replica tests: the real link protocol over real TLS.

A :class:`SimMachine` joined with a token (tests.helpers.link_client.join) keeps
one Connect stream up: hello, then a heartbeat every interval the welcome
names; it records each delivery and acknowledges it at once, records every
other notice, and stops for good on ``revoked`` / ``account_deleted``. When
its stream breaks (a replica killed) it dials the next of its link addresses
at once, then every ``retry`` seconds around the list: a machine whose join
listed several replicas. Far lighter than a real ``agents-machine`` (30 of
them fit on two cores with three replicas).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from shared import tls
from shared.crypto import BoxKeyPair
from shared.pb.control.v1 import link_pb2, link_pb2_grpc

__all__ = ["SimMachine", "join_sim"]


async def join_sim(public: str, ca_pem: bytes, token: str) -> tuple[str, bytes, bytes]:
    """Join with ``token`` (with a box key, so prompts can be sealed to it);
    (machine id, certificate, key)."""
    key = tls.new_tls_key()
    info = link_pb2.MachineInfo(
        name="sim", version="sim", hostname="sim", box_public_key=BoxKeyPair.generate().public_key
    )
    async with grpc.aio.secure_channel(public, grpc.ssl_channel_credentials(ca_pem)) as ch:
        reply = await link_pb2_grpc.MachineLinkStub(ch).Join(
            link_pb2.JoinRequest(token=token, csr_pem=tls.build_csr(key).decode(), machine=info),
            timeout=20,
        )
    return reply.machine_id, reply.certificate_pem.encode(), tls.private_key_pem(key)


@dataclass
class SimMachine:
    """One simulated machine; :meth:`run` in a task, cancel it to stop."""

    machine_id: str
    cert: bytes
    key: bytes
    ca_pem: bytes
    addresses: list[str]
    retry: float = 0.2
    linked_to: str | None = None
    """The link address of the replica it is linked to now (None: offline)."""
    deliveries: Counter[str] = field(default_factory=Counter)
    """Delivery ids received, with how often."""
    notices: list[str] = field(default_factory=list)
    """Kinds of every other notice received (renew_now, revoked, ...)."""
    stopped: str = ""
    """Why it stopped for good ("" while it runs)."""
    links: int = 0
    """Streams welcomed so far."""
    offline_since: float | None = None

    async def run(self) -> None:
        """Stay linked (failing over across ``addresses``) until stopped or cancelled."""
        turn = 0
        while not self.stopped:
            address = self.addresses[turn % len(self.addresses)]
            turn += 1
            try:
                await self._link(address)
            except (grpc.aio.AioRpcError, OSError, TimeoutError):
                pass
            was_linked = self.linked_to is not None
            self.linked_to = None
            if self.offline_since is None:
                self.offline_since = time.monotonic()
            if not was_linked:
                await asyncio.sleep(self.retry)  # pacing between dials, not synchronisation

    async def _link(self, address: str) -> None:
        creds = grpc.ssl_channel_credentials(
            self.ca_pem, private_key=self.key, certificate_chain=self.cert
        )
        async with grpc.aio.secure_channel(address, creds) as ch:
            stub: Any = link_pb2_grpc.MachineLinkStub(ch)
            call = stub.Connect()
            lock = asyncio.Lock()

            async def write(msg: link_pb2.MachineMessage) -> None:
                async with lock:  # one write at a time on a stream
                    await call.write(msg)

            await write(link_pb2.MachineMessage(hello=link_pb2.Hello(version="sim")))
            first = await asyncio.wait_for(call.read(), 5)
            if first is grpc.aio.EOF or first.WhichOneof("kind") != "welcome":
                call.cancel()
                return
            interval = max(0.05, first.welcome.heartbeat_interval_ms / 1000)
            self.linked_to, self.offline_since = address, None
            self.links += 1

            async def beat() -> None:
                while True:
                    await asyncio.sleep(interval)  # the protocol's period
                    await write(link_pb2.MachineMessage(heartbeat=link_pb2.Heartbeat()))

            beats = asyncio.create_task(beat())
            try:
                while True:
                    msg = await call.read()
                    if msg is grpc.aio.EOF:
                        return
                    kind = msg.WhichOneof("kind")
                    if kind == "delivery":
                        self.deliveries[msg.delivery.id] += 1
                        ack = link_pb2.Ack(delivery_id=msg.delivery.id, run_id="run_sim")
                        await write(link_pb2.MachineMessage(ack=ack))
                        continue
                    self.notices.append(kind)
                    if kind in ("revoked", "account_deleted"):
                        self.stopped = kind
                        with contextlib.suppress(grpc.aio.AioRpcError):
                            async with lock:
                                await call.done_writing()
                        return
            finally:
                beats.cancel()
                await asyncio.gather(beats, return_exceptions=True)
                call.cancel()
