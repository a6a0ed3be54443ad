"""The link client's own contract, against a real TLS gRPC server.

``FakeControl`` is a small MachineLink servicer in this process, served like
the real control plane: a public listener with server TLS only (Join) and a
link listener that requires a client certificate from its CA (Connect,
RenewCertificate). ControlLink's and join's logic are tested on the in-process
fake of the client (test_link.py); here the client's encoding, TLS and stream
handling are.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import inspect
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf import timestamp_pb2
from prometheus_client import CollectorRegistry

from machine.link import identity
from machine.link.client import (
    AccountDeleted,
    AgentRoster,
    Delivery,
    DeliveryAck,
    LinkClient,
    LinkStream,
    MachineInfo,
    RenewNow,
    Revoked,
    Welcome,
)
from machine.link.connection import ControlLink, LinkState
from machine.link.join import join_control_plane
from shared import tls
from shared.crypto import BoxKeyPair
from shared.errors import InvalidState, Unauthenticated
from shared.ids import new_id
from shared.pb.control.v1 import link_pb2, link_pb2_grpc
from shared.rpc import ErrorInterceptor, domain_error
from tests.helpers.fake_link_client import GOOD_SECRET, FakeLinkClient, FakeStream
from tests.helpers.poll import apoll_until


def _token() -> str:
    return f"{new_id('token')}.{GOOD_SECRET}"


@dataclass
class Stream:
    """One Connect stream as the fake control plane saw it."""

    machine_id: str
    hello: link_pb2.Hello
    heartbeats: int = 0
    acks: list[str] = field(default_factory=list)
    rosters: list[tuple[list[str], list[str]]] = field(default_factory=list)
    outbox: asyncio.Queue[link_pb2.ControlMessage | None] = field(default_factory=asyncio.Queue)
    ended_by_client: bool = False


class FakeControl(link_pb2_grpc.MachineLinkServicer):
    """A MachineLink control plane in this process (see the module docstring)."""

    def __init__(self, ca: tls.CertKey, heartbeat_ms: int = 100) -> None:
        self.ca = ca
        self.next_ca: tls.CertKey | None = None
        """During a CA rollover: signs joins, and joins hand out both CAs."""
        self.heartbeat_ms = heartbeat_ms
        self.cert_lifetime = dt.timedelta(hours=1)
        self.tokens: set[str] = set()
        self.repairs: dict[str, str] = {}
        """Repair token -> the machine it repairs."""
        self.join_calls = 0
        self.renew_calls = 0
        self.connects = 0
        self.streams: list[Stream] = []
        self.revoked: set[str] = set()
        self.unknown: set[str] = set()
        self.account_deleting = False
        self.link_port = 0
        self.account_id = new_id("account")
        self.recovery = BoxKeyPair.generate()

    def new_token(self) -> str:
        value = _token()
        self.tokens.add(value)
        return value

    async def Join(self, request: Any, context: Any) -> link_pb2.JoinResponse:  # noqa: N802
        self.join_calls += 1
        if request.token not in self.tokens:
            raise Unauthenticated("join: token refused")
        # Like controlplane.machines.pairing: a re-pair needs a repair token for that machine.
        repairs = self.repairs.get(request.token, "")
        if request.repair_machine_id and request.repair_machine_id != repairs:
            raise InvalidState("join", "this box is already joined; the token was not used")
        self.tokens.discard(request.token)
        machine_id = repairs or new_id("machine")
        issued = tls.sign_client_csr(
            self.next_ca or self.ca,
            request.csr_pem,
            account_id=self.account_id,
            machine_id=machine_id,
            lifetime=self.cert_lifetime,
        )
        not_after = timestamp_pb2.Timestamp()
        not_after.FromDatetime(issued.not_after)
        bundle = self.ca.cert_pem + (self.next_ca.cert_pem if self.next_ca else b"")
        return link_pb2.JoinResponse(
            certificate_pem=issued.cert_pem.decode(),
            ca_certificate_pem=bundle.decode(),
            machine_id=machine_id,
            account_id=self.account_id,
            account_recovery_public_key=self.recovery.public_key,
            heartbeat_interval_ms=self.heartbeat_ms,
            certificate_not_after=not_after,
            link_port=self.link_port,
        )

    def _peer(self, context: Any) -> tls.PeerIdentity:
        pem = context.auth_context().get("x509_pem_cert")
        if not pem:
            raise Unauthenticated("no client certificate")
        return tls.identity_from_cert(pem[0])

    async def RenewCertificate(  # noqa: N802
        self, request: Any, context: Any
    ) -> link_pb2.RenewCertificateResponse:
        peer = self._peer(context)
        self.renew_calls += 1
        issued = tls.sign_client_csr(
            self.ca,
            request.csr_pem,
            account_id=peer.account_id,
            machine_id=peer.machine_id,
            lifetime=self.cert_lifetime,
        )
        return link_pb2.RenewCertificateResponse(
            certificate_pem=issued.cert_pem.decode(), ca_certificate_pem=self.ca.cert_pem.decode()
        )

    # Driven by context.read()/write() (so notices can be pushed at any time),
    # not by yielding, hence the different signature.
    async def Connect(  # type: ignore[override]  # noqa: N802
        self, request_iterator: Any, context: Any
    ) -> None:
        self.connects += 1
        # Like the real control plane: read the hello before refusing, or the
        # machine may see INTERNAL (its write raced our abort) instead of the refusal.
        first = await context.read()
        peer = self._peer(context)
        if peer.machine_id in self.revoked:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "link: machine revoked")
        if peer.machine_id in self.unknown:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "link: unknown machine")
        if self.account_deleting:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "link: account is being deleted")
        stream = Stream(machine_id=peer.machine_id, hello=first.hello)
        self.streams.append(stream)
        await context.write(
            link_pb2.ControlMessage(
                welcome=link_pb2.Welcome(
                    heartbeat_interval_ms=self.heartbeat_ms, machine_id=peer.machine_id
                )
            )
        )

        async def reader() -> None:
            while True:
                msg = await context.read()
                if not isinstance(msg, link_pb2.MachineMessage):  # EOF: the machine hung up
                    stream.ended_by_client = True
                    await stream.outbox.put(None)
                    return
                if msg.HasField("heartbeat"):
                    stream.heartbeats += 1
                elif msg.HasField("ack"):
                    stream.acks.append(msg.ack.delivery_id)
                elif msg.HasField("roster"):
                    stream.rosters.append(
                        (list(msg.roster.active_agent_ids), list(msg.roster.archived_agent_ids))
                    )

        task = asyncio.create_task(reader())
        try:
            while (out := await stream.outbox.get()) is not None:
                if out.HasField("welcome"):  # a marker: drop the stream with an error
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "dropped by test")
                await context.write(out)
                if out.HasField("revoked"):
                    return
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def drop(self, stream: Stream) -> None:
        stream.outbox.put_nowait(link_pb2.ControlMessage(welcome=link_pb2.Welcome()))

    def send(self, stream: Stream, msg: link_pb2.ControlMessage) -> None:
        stream.outbox.put_nowait(msg)


@dataclass
class Running:
    """A FakeControl served on two ports."""

    fake: FakeControl
    public_address: str
    link_address: str
    ca_hash: str


@contextlib.asynccontextmanager
async def serve_fake(fake: FakeControl) -> AsyncIterator[Running]:
    server_cert = tls.issue_server_cert(fake.ca)
    chain = server_cert.cert_pem + fake.ca.cert_pem  # the CA rides along for the pin check
    public = grpc.aio.server(interceptors=[ErrorInterceptor()])
    link = grpc.aio.server(interceptors=[ErrorInterceptor()])
    for server in (public, link):
        link_pb2_grpc.add_MachineLinkServicer_to_server(fake, server)
    public_port = public.add_secure_port(
        "127.0.0.1:0", grpc.ssl_server_credentials([(server_cert.key_pem, chain)])
    )
    link_port = link.add_secure_port(
        "127.0.0.1:0",
        grpc.ssl_server_credentials(
            [(server_cert.key_pem, chain)],
            root_certificates=fake.ca.cert_pem,
            require_client_auth=True,
        ),
    )
    fake.link_port = link_port
    await public.start()
    await link.start()
    try:
        yield Running(
            fake,
            f"127.0.0.1:{public_port}",
            f"127.0.0.1:{link_port}",
            tls.ca_hash(fake.ca.cert_pem),
        )
    finally:
        await public.stop(None)
        await link.stop(None)


@pytest.fixture(scope="module")
def ca() -> tls.CertKey:
    return tls.make_ca()


@pytest.fixture
async def control(ca: tls.CertKey) -> AsyncIterator[Running]:
    async with serve_fake(FakeControl(ca)) as running:
        yield running


async def _until(pred: Any, timeout: float = 5.0) -> None:
    await apoll_until(pred, deadline=timeout, what="condition")


def _machine() -> MachineInfo:
    return MachineInfo("m", "1.2.3", "host", b"b" * 32, b"s" * 32)


async def _join(control: Running, key: Any) -> Any:
    client = LinkClient.for_join(control.public_address, control.fake.ca.cert_pem)
    async with contextlib.aclosing(client):
        return await client.join(
            control.fake.new_token(), tls.build_csr(key).decode(), _machine(), timeout=10
        )


def _mutual(control: Running, key: Any, cert_pem: bytes) -> LinkClient:
    return LinkClient.mutual(
        control.link_address,
        ca_pem=control.fake.ca.cert_pem,
        key_pem=tls.private_key_pem(key),
        cert_pem=cert_pem,
    )


async def test_join_returns_the_reply_as_a_dataclass(control: Running) -> None:
    key = tls.new_tls_key()
    reply = await _join(control, key)
    assert reply.account_id == control.fake.account_id
    assert reply.account_recovery_public_key == control.fake.recovery.public_key
    assert reply.heartbeat_interval_ms == control.fake.heartbeat_ms
    assert (reply.link_host, reply.link_port) == ("", control.fake.link_port)
    assert tls.identity_from_cert(reply.certificate_pem).machine_id == reply.machine_id
    assert reply.ca_certificate_pem.encode() == control.fake.ca.cert_pem


async def test_a_refused_join_raises_the_grpc_error_with_its_domain_error(
    control: Running,
) -> None:
    client = LinkClient.for_join(control.public_address, control.fake.ca.cert_pem)
    async with contextlib.aclosing(client):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.join(
                _token(), tls.build_csr(tls.new_tls_key()).decode(), _machine(), timeout=10
            )
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert isinstance(domain_error(info.value), Unauthenticated)
    assert control.fake.join_calls == 1


async def test_connect_stream_speaks_every_message(control: Running) -> None:
    key = tls.new_tls_key()
    reply = await _join(control, key)
    client = _mutual(control, key, reply.certificate_pem.encode())
    async with contextlib.aclosing(client):
        stream = client.connect()
        await stream.hello("9.9.9", 7, 1234.5)
        welcome = await asyncio.wait_for(stream.read(), 5)
        assert welcome == Welcome(reply.machine_id, control.fake.heartbeat_ms / 1000)
        seen = control.fake.streams[0]
        assert (seen.hello.version, seen.hello.agent_count) == ("9.9.9", 7)
        assert seen.hello.next_fire_at.seconds == 1234
        a, b = new_id("agent"), new_id("agent")
        await stream.heartbeat(3)
        await stream.roster(AgentRoster(active=(a,), archived=(b,)))
        prompt_id = new_id("prompt")
        sent = dt.datetime(2026, 5, 1, tzinfo=dt.UTC)
        created = timestamp_pb2.Timestamp()
        created.FromDatetime(sent)
        for msg in (
            link_pb2.ControlMessage(
                delivery=link_pb2.Delivery(
                    id=prompt_id, agent_id=a, sealed_prompt=b"x", created_at=created
                )
            ),
            link_pb2.ControlMessage(renew_now=link_pb2.RenewNow(reason="rollover")),
            link_pb2.ControlMessage(account_deleted=link_pb2.AccountDeleted()),
        ):
            control.fake.send(seen, msg)
        assert await stream.read() == Delivery(prompt_id, a, b"x", sent)
        assert await stream.read() == RenewNow("rollover")
        assert await stream.read() == AccountDeleted()
        await stream.ack(prompt_id, DeliveryAck(run_id="run_1"))
        await _until(lambda: seen.heartbeats == 1 and seen.acks == [prompt_id])
        assert seen.rosters == [([a], [b])]
        control.fake.send(seen, link_pb2.ControlMessage(revoked=link_pb2.Revoked(reason="r")))
        assert await stream.read() == Revoked("r")
        assert await stream.read() is None  # the handler returned: a clean end


@contextlib.asynccontextmanager
async def _welcomed(control: Running) -> AsyncIterator[LinkStream]:
    """A joined machine's Connect stream, past its hello and the welcome."""
    key = tls.new_tls_key()
    reply = await _join(control, key)
    client = _mutual(control, key, reply.certificate_pem.encode())
    async with contextlib.aclosing(client):
        stream = client.connect()
        await stream.hello("1", 0)
        assert isinstance(await stream.read(), Welcome)
        yield stream


async def test_done_writing_is_a_clean_goodbye(control: Running) -> None:
    async with _welcomed(control) as stream:
        await stream.done_writing()
        assert await asyncio.wait_for(stream.read(), 5) is None
    assert control.fake.streams[0].ended_by_client


async def test_a_write_on_an_ended_stream_raises_the_streams_status(control: Running) -> None:
    async with _welcomed(control) as stream:
        control.fake.drop(control.fake.streams[0])
        with pytest.raises(grpc.aio.AioRpcError) as read:
            await asyncio.wait_for(stream.read(), 5)
        # The RPC is over: a write says why, as the read did (gRPC itself
        # raises InvalidStateError "RPC already finished", which names nothing).
        for write in (stream.heartbeat(1), stream.ack(new_id("prompt"))):
            with pytest.raises(grpc.aio.AioRpcError) as written:
                await write
            assert written.value.code() == read.value.code() == grpc.StatusCode.UNAVAILABLE
            assert written.value.details() == "dropped by test"
        await stream.done_writing()  # a goodbye on an ended stream is no error


async def test_renew_returns_a_certificate_for_the_same_machine(control: Running) -> None:
    key = tls.new_tls_key()
    reply = await _join(control, key)
    client = _mutual(control, key, reply.certificate_pem.encode())
    async with contextlib.aclosing(client):
        renewed = await client.renew(tls.build_csr(key).decode(), timeout=10)
    assert tls.identity_from_cert(renewed.certificate_pem).machine_id == reply.machine_id
    assert renewed.certificate_pem != reply.certificate_pem
    assert renewed.ca_certificate_pem.encode() == control.fake.ca.cert_pem


async def test_a_stranger_certificate_fails_the_handshake(control: Running) -> None:
    key = tls.new_tls_key()
    forged = tls.sign_client_csr(
        tls.make_ca(),
        tls.build_csr(key),
        account_id=new_id("account"),
        machine_id=new_id("machine"),
        lifetime=dt.timedelta(hours=1),
    )
    client = _mutual(control, key, forged.cert_pem)
    async with contextlib.aclosing(client):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.renew(tls.build_csr(key).decode(), timeout=10)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert control.fake.renew_calls == 0  # no handler ran


async def test_join_and_link_over_real_tls(control: Running, tmp_path: Path) -> None:
    """The default dialers: join and ControlLink end to end over real TLS."""
    data_dir = tmp_path / "data"
    await join_control_plane(
        data_dir=data_dir,
        address=control.public_address,
        token=control.fake.new_token(),
        ca_hash=control.ca_hash,
        name="m",
    )
    assert identity.load_link(data_dir).control_address == control.link_address

    async def count() -> int:
        return 2

    link = ControlLink(
        data_dir=data_dir, agent_count=count, version="1", registry=CollectorRegistry()
    )
    async with link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        stream = control.fake.streams[0]
        assert stream.hello.agent_count == 2
    await _until(lambda: stream.ended_by_client)
    assert link.state is LinkState.STOPPED


@pytest.mark.parametrize(("real", "fake"), [(LinkClient, FakeLinkClient), (LinkStream, FakeStream)])
def test_the_fake_has_the_real_clients_methods(real: type, fake: type) -> None:
    """The fake keeps up with the client (tests are not type-checked strictly)."""
    for name, method in vars(real).items():
        if name.startswith("_") or isinstance(method, classmethod):
            continue
        params = list(inspect.signature(method).parameters.values())
        twin = list(inspect.signature(getattr(fake, name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in params] == [
            (p.name, p.kind, p.default) for p in twin
        ], name
        assert inspect.iscoroutinefunction(method) == inspect.iscoroutinefunction(
            getattr(fake, name)
        ), name
