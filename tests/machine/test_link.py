"""Unit tests of join (input checks, the CA pin, staging) and of ControlLink.

A small in-process control plane (``FakeControl``) speaks the real MachineLink
protocol over real TLS: a public listener with server TLS only (Join) and a
link listener that requires a client certificate from its CA (Connect,
RenewCertificate), like the real control plane. It records every call so
tests can prove what the machine did (and did not) send.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import stat
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf import timestamp_pb2
from prometheus_client import CollectorRegistry

from machine import identity
from machine.join import join_control_plane, parse_address, validate_ca_hash, validate_token
from machine.link import ControlLink, Delivery, LinkState
from machine.link_client import AgentRoster
from shared import tls
from shared.crypto import BoxKeyPair
from shared.errors import (
    IntegrityError,
    InvalidArgument,
    InvalidState,
    TransientError,
    Unauthenticated,
)
from shared.ids import new_id
from shared.pb.control.v1 import link_pb2, link_pb2_grpc
from shared.rpc import ErrorInterceptor
from tests.helpers.poll import apoll_until

GOOD_SECRET = "s" * 43


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
        # Like controlplane.pairing: a re-pair needs a repair token for that machine.
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

    async def _unused(self, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in this fake")

    async def HaveSegments(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._unused(context)

    async def PutSegment(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        return await self._unused(context)

    async def PutManifest(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._unused(context)

    async def ListBackups(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._unused(context)

    async def GetManifest(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._unused(context)

    async def GetSegment(  # noqa: N802
        self, request: Any, context: Any
    ) -> AsyncIterator[link_pb2.GetSegmentChunk]:
        await self._unused(context)
        yield link_pb2.GetSegmentChunk()

    async def Prune(self, request: Any, context: Any) -> Any:  # noqa: N802
        return await self._unused(context)

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


async def _until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    fail = AssertionError("condition not met before the deadline")
    await apoll_until(pred, deadline=timeout, what="condition", fail=lambda: fail)


async def _joined(control: Running, data_dir: Path) -> None:
    await join_control_plane(
        data_dir=data_dir,
        address=control.public_address,
        token=control.fake.new_token(),
        ca_hash=control.ca_hash,
        name="test-machine",
    )


def _listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


# ------------------------------------------------------------------ join input


@pytest.mark.parametrize(
    "token",
    [
        "",
        "abc",
        "tok_123.secret",
        f"{new_id('token')}",
        f"{new_id('agent')}.{GOOD_SECRET}",
        f"{new_id('token')}.short",
        f"{new_id('token')}.{GOOD_SECRET}.x",
    ],
)
def test_token_shape_is_checked(token: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_token(token)
    assert info.value.field == "token"
    if "." in token and len(token.split(".")[-1]) > 8:
        assert token.split(".")[1] not in str(info.value)  # the secret is never echoed


@pytest.mark.parametrize(
    "value",
    ["", "sha256:", "sha256:" + "g" * 64, "md5:" + "0" * 64, "0" * 64, "sha256:" + "0" * 63],
)
def test_ca_hash_shape_is_checked(value: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_ca_hash(value)
    assert info.value.field == "ca_hash"


def test_ca_hash_is_normalised() -> None:
    assert validate_ca_hash("SHA256:" + "AB" * 32) == "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    "value", ["", "host", "host:", ":80", "host:0", "host:70000", "ho st:80", "[::zz]:80", "a/b:1"]
)
def test_address_shape_is_checked(value: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_address(value)
    assert info.value.field == "address"


def test_address_forms() -> None:
    assert parse_address("127.0.0.1:7443") == ("127.0.0.1", 7443)
    assert parse_address("cp.example.com:443") == ("cp.example.com", 443)
    assert parse_address("[::1]:7443") == ("::1", 7443)


@pytest.mark.parametrize(
    ("field_name", "kwargs"),
    [
        ("token", {"token": "nope"}),
        ("ca_hash", {"ca_hash": "sha256:xyz"}),
        ("address", {"address": "nowhere"}),
        ("name", {"name": "bad\nname"}),
        ("name", {"name": "x" * 65}),
    ],
)
async def test_join_validates_before_contacting_anyone(
    control: Running, tmp_path: Path, field_name: str, kwargs: dict[str, str]
) -> None:
    args: dict[str, Any] = {
        "data_dir": tmp_path / "data",
        "address": control.public_address,
        "token": control.fake.new_token(),
        "ca_hash": control.ca_hash,
        "name": "m",
    }
    args.update(kwargs)
    with pytest.raises(InvalidArgument) as info:
        await join_control_plane(**args)
    assert info.value.field == field_name
    assert control.fake.join_calls == 0
    assert _listing(tmp_path) == []


# ------------------------------------------------------------------ join flow


async def test_join_writes_private_identity(control: Running, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    result = await join_control_plane(
        data_dir=data_dir,
        address=control.public_address,
        token=control.fake.new_token(),
        ca_hash=control.ca_hash,
        name="laptop",
    )
    assert result.account_id == control.fake.account_id
    assert result.control_address == control.link_address
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    keys = data_dir / identity.KEYS_DIR
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert _listing(keys) == sorted(
        [
            identity.SIGNING_KEY,
            identity.BOX_KEY,
            identity.TLS_KEY,
            identity.TLS_CERT,
            identity.CA_CERT,
        ]
    )
    for f in [*keys.iterdir(), data_dir / identity.LINK_FILE]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    doc = json.loads((data_dir / identity.LINK_FILE).read_text())
    assert doc["machine_id"] == result.machine_id
    assert doc["control_address"] == control.link_address
    assert doc["heartbeat_interval_ms"] == control.fake.heartbeat_ms
    link = identity.load_link(data_dir)
    assert link.account_recovery_public_key == control.fake.recovery.public_key
    loaded = identity.load_keys(data_dir)
    assert tls.identity_from_cert(loaded.tls_cert_pem).machine_id == result.machine_id
    assert tls.ca_hash(loaded.ca_cert_pem) == control.ca_hash
    # No staging folder is left beside the data folder.
    assert _listing(tmp_path) == ["data"]
    # Nothing private in the link record.
    assert "PRIVATE" not in (data_dir / identity.LINK_FILE).read_text()


async def test_wrong_pin_is_refused_before_join(control: Running, tmp_path: Path) -> None:
    other = tls.ca_hash(tls.make_ca().cert_pem)
    with pytest.raises(IntegrityError) as info:
        await join_control_plane(
            data_dir=tmp_path / "data",
            address=control.public_address,
            token=control.fake.new_token(),
            ca_hash=other,
            name=None,
        )
    assert info.value.what == "ca_hash"
    assert "does not present the pinned CA" in str(info.value)
    assert control.fake.join_calls == 0  # the token never left the machine
    assert _listing(tmp_path) == []


async def test_join_reads_the_injected_clock(control: Running, tmp_path: Path) -> None:
    # Ten years on, the server certificate has expired: refused before the token is sent.
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=3650)
    with pytest.raises(IntegrityError) as info:
        await join_control_plane(
            data_dir=tmp_path / "data",
            address=control.public_address,
            token=control.fake.new_token(),
            ca_hash=control.ca_hash,
            name=None,
            clock=lambda: later,
        )
    assert "is not valid now" in str(info.value)
    assert control.fake.join_calls == 0


async def test_server_without_ca_in_chain_is_refused(ca: tls.CertKey, tmp_path: Path) -> None:
    fake = FakeControl(ca)
    server_cert = tls.issue_server_cert(ca)
    server = grpc.aio.server()
    link_pb2_grpc.add_MachineLinkServicer_to_server(fake, server)
    port = server.add_secure_port(
        "127.0.0.1:0", grpc.ssl_server_credentials([(server_cert.key_pem, server_cert.cert_pem)])
    )
    await server.start()
    try:
        with pytest.raises(IntegrityError):
            await join_control_plane(
                data_dir=tmp_path / "data",
                address=f"127.0.0.1:{port}",
                token=fake.new_token(),
                ca_hash=tls.ca_hash(ca.cert_pem),
                name=None,
            )
        assert fake.join_calls == 0
    finally:
        await server.stop(None)
    assert _listing(tmp_path) == []


async def test_refused_token_writes_nothing(control: Running, tmp_path: Path) -> None:
    with pytest.raises(Unauthenticated):
        await join_control_plane(
            data_dir=tmp_path / "data",
            address=control.public_address,
            token=_token(),  # unknown to the control plane
            ca_hash=control.ca_hash,
            name=None,
        )
    assert control.fake.join_calls == 1
    assert _listing(tmp_path) == []


async def test_unreachable_control_plane(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransientError):
        await join_control_plane(
            data_dir=tmp_path / "data",
            address=f"127.0.0.1:{port}",
            token=_token(),
            ca_hash="sha256:" + "0" * 64,
            name=None,
        )
    assert _listing(tmp_path) == []


async def test_joined_data_dir_is_refused_without_spending_a_token(
    control: Running, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    before = (data_dir / identity.LINK_FILE).read_bytes()
    token = control.fake.new_token()
    with pytest.raises(InvalidState) as info:
        await join_control_plane(
            data_dir=data_dir,
            address=control.public_address,
            token=token,
            ca_hash=control.ca_hash,
            name=None,
        )
    assert "already joined" in str(info.value)
    assert token in control.fake.tokens  # not spent
    assert (data_dir / identity.LINK_FILE).read_bytes() == before


async def test_repair_token_re_pairs_a_joined_box_keeping_its_id_and_keys(
    control: Running, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    link = identity.load_link(data_dir)
    held = identity.load_keys(data_dir)
    token = control.fake.new_token()
    control.fake.repairs[token] = link.machine_id
    result = await join_control_plane(
        data_dir=data_dir,
        address=control.public_address,
        token=token,
        ca_hash=control.ca_hash,
        name=None,
    )
    assert result.repaired and result.machine_id == link.machine_id
    now = identity.load_keys(data_dir)
    assert now.box.public_key == held.box.public_key  # queued prompts still open
    assert now.tls_key_pem != held.tls_key_pem and now.tls_cert_pem != held.tls_cert_pem
    assert tls.identity_from_cert(now.tls_cert_pem).machine_id == link.machine_id
    assert not list(data_dir.rglob("*.new"))


async def test_join_during_a_ca_rollover_trusts_both_cas(control: Running, tmp_path: Path) -> None:
    control.fake.next_ca = tls.make_ca()
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    keys = identity.load_keys(data_dir)
    assert tls.split_certs(keys.ca_cert_pem) == [
        control.fake.ca.cert_pem,
        control.fake.next_ca.cert_pem,
    ]
    tls.verify_issued_by(keys.tls_cert_pem, control.fake.next_ca.cert_pem)


def test_re_pair_interrupted_after_its_commit_point_is_finished_at_load(tmp_path: Path) -> None:
    ca = tls.make_ca()
    data_dir = tmp_path / "data"
    keys = identity.NewKeys.generate()
    first = tls.sign_client_csr(
        ca,
        keys.csr_pem(),
        account_id=new_id("account"),
        machine_id=new_id("machine"),
        lifetime=dt.timedelta(hours=1),
    )
    ident = tls.identity_from_cert(first.cert_pem)
    link = identity.LinkRecord(
        control_address="127.0.0.1:1",
        machine_id=ident.machine_id,
        account_id=ident.account_id,
        account_recovery_public_key=bytes(32),
        heartbeat_interval=1.0,
        cert_not_after=first.not_after,
        cert_received_at=first.not_after,
    )
    identity.write_identity(
        data_dir, keys, cert_pem=first.cert_pem, ca_cert_pem=ca.cert_pem, link=link
    )
    new_key = tls.new_tls_key()
    second = tls.sign_client_csr(
        ca,
        tls.build_csr(new_key),
        account_id=ident.account_id,
        machine_id=ident.machine_id,
        lifetime=dt.timedelta(hours=2),
    )
    moved = dataclasses.replace(link, control_address="127.0.0.1:2")
    # Staged, then killed right after the first rename (the commit point).
    for folder, name, data in (
        ("keys", "tls.key", tls.private_key_pem(new_key)),
        ("keys", "tls.crt", second.cert_pem),
        ("keys", "ca.crt", ca.cert_pem),
        (".", "link.json", moved.to_json()),
    ):
        (data_dir / folder / f"{name}.new").write_bytes(data)
    os.replace(data_dir / "keys" / "tls.key.new", data_dir / "keys" / "tls.key")

    assert identity.load_link(data_dir).control_address == "127.0.0.1:2"
    now = identity.load_keys(data_dir)
    assert now.tls_cert_pem == second.cert_pem
    tls.check_client_cert(
        now.tls_cert_pem,
        now.ca_cert_pem,
        public_key=new_key.public_key(),
        account_id=ident.account_id,
    )


async def test_join_into_a_used_data_dir_keeps_its_files(control: Running, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    (data_dir / "keys").mkdir(parents=True)
    (data_dir / "machine.db").write_bytes(b"db")
    (data_dir / "keys" / "backup.key").write_bytes(b"other key")
    await _joined(control, data_dir)
    assert (data_dir / "machine.db").read_bytes() == b"db"
    assert (data_dir / "keys" / "backup.key").read_bytes() == b"other key"
    assert identity.is_joined(data_dir)
    assert identity.load_keys(data_dir).tls_cert_pem
    assert _listing(tmp_path) == ["data"]


# ------------------------------------------------------------------ the link


def _sample(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name)
    return 0.0 if value is None else value


def _sample_ok(registry: CollectorRegistry) -> float:
    value = registry.get_sample_value("agents_machine_link_renewals_total", {"outcome": "ok"})
    return 0.0 if value is None else value


def _link(data_dir: Path, registry: CollectorRegistry, **kw: Any) -> ControlLink:
    async def count() -> int:
        return 7

    return ControlLink(
        data_dir=data_dir,
        agent_count=count,
        version="9.9.9",
        registry=registry,
        backoff_initial=0.05,
        backoff_max=0.2,
        stable_after=0.5,
        **kw,
    )


async def test_link_says_hello_and_beats(control: Running, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    registry = CollectorRegistry()
    assert ControlLink.is_joined(data_dir)
    async with _link(data_dir, registry) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        assert _sample(registry, "agents_machine_link_connected") == 1
        stream = control.fake.streams[0]
        assert (stream.hello.version, stream.hello.agent_count) == ("9.9.9", 7)
        await _until(lambda: stream.heartbeats >= 3)
        assert _sample(registry, "agents_machine_link_heartbeats_total") >= 3
    # Leaving the block half-closes the stream: the server sees a clean end.
    await _until(lambda: stream.ended_by_client)
    assert link.state is LinkState.STOPPED
    assert _sample(registry, "agents_machine_link_connected") == 0


async def test_link_sends_the_roster_at_connect_on_change_and_before_goodbye(
    control: Running, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    a, b = new_id("agent"), new_id("agent")
    current = AgentRoster(active=(a,))

    async def roster() -> AgentRoster:
        return current

    async with _link(data_dir, CollectorRegistry(), roster=roster) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        stream = control.fake.streams[0]
        await _until(lambda: stream.rosters == [([a], [])])
        await _until(lambda: stream.heartbeats >= 3)
        assert len(stream.rosters) == 1  # unchanged: not sent again with each beat
        current = AgentRoster(active=(b,), archived=(a,))
        await _until(lambda: stream.rosters[-1] == ([b], [a]))
        current = AgentRoster(active=(a, b))  # changed just before the goodbye
    await _until(lambda: stream.ended_by_client)
    assert stream.rosters[-1] == ([a, b], [])


async def test_link_not_joined(tmp_path: Path) -> None:
    assert not ControlLink.is_joined(tmp_path)
    with pytest.raises(InvalidState):
        async with _link(tmp_path, CollectorRegistry()):
            pass


async def test_link_reconnects_after_a_drop(control: Running, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    registry = CollectorRegistry()
    async with _link(data_dir, registry) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        control.fake.drop(control.fake.streams[0])
        await _until(lambda: len(control.fake.streams) == 2)
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        assert _sample(registry, "agents_machine_link_reconnects_total") >= 1


async def test_link_survives_a_control_plane_restart(ca: tls.CertKey, tmp_path: Path) -> None:
    fake = FakeControl(ca)
    data_dir = tmp_path / "data"
    async with serve_fake(fake) as running:
        await _joined(running, data_dir)
    # The control plane is down: the link backs off and keeps trying.
    registry = CollectorRegistry()
    async with _link(data_dir, registry) as link:
        await link.wait_for_state(LinkState.BACKING_OFF, timeout=5)
        await _until(lambda: _sample(registry, "agents_machine_link_reconnects_total") >= 2)
        # Bring it back on the same link port.
        link_port = fake.link_port
        server_cert = tls.issue_server_cert(ca)
        server = grpc.aio.server(interceptors=[ErrorInterceptor()])
        link_pb2_grpc.add_MachineLinkServicer_to_server(fake, server)
        server.add_secure_port(
            f"127.0.0.1:{link_port}",
            grpc.ssl_server_credentials(
                [(server_cert.key_pem, server_cert.cert_pem + ca.cert_pem)],
                root_certificates=ca.cert_pem,
                require_client_auth=True,
            ),
        )
        await server.start()
        try:
            await link.wait_for_state(LinkState.CONNECTED, timeout=5)
            assert fake.streams
        finally:
            await link.close()
            await server.stop(None)


async def test_revoked_notice_stops_the_link(control: Running, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    async with _link(data_dir, CollectorRegistry()) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        stream = control.fake.streams[0]
        control.fake.revoked.add(stream.machine_id)
        control.fake.send(
            stream, link_pb2.ControlMessage(revoked=link_pb2.Revoked(reason="test says so"))
        )
        await link.wait_for_state(LinkState.REVOKED, timeout=1)
        assert "test says so" in link.final_reason
        # The background task is over: nothing will dial again.
        assert link._task is not None
        await asyncio.wait_for(asyncio.shield(link._task), 1)
    assert control.fake.connects == 1


async def test_refused_handshake_stops_the_link(control: Running, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    control.fake.revoked.add(identity.load_link(data_dir).machine_id)
    async with _link(data_dir, CollectorRegistry()) as link:
        await link.wait_for_state(LinkState.REVOKED, timeout=5)
        assert "refused" in link.final_reason
    assert control.fake.connects == 1


async def test_unknown_machine_keeps_identity_and_retries_slowly(
    control: Running, tmp_path: Path
) -> None:
    """A control plane whose store is being restored may not know us yet: not final."""
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    machine_id = identity.load_link(data_dir).machine_id
    control.fake.unknown.add(machine_id)
    async with _link(data_dir, CollectorRegistry(), refused_retry=0.3) as link:
        await _until(lambda: control.fake.connects >= 2)
        assert link.state not in (LinkState.REVOKED, LinkState.STOPPED), link.final_reason
        assert link.final_reason == ""
        control.fake.unknown.discard(machine_id)
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
    assert ControlLink.is_joined(data_dir)


async def test_dropped_stream_is_retried_at_once(
    control: Running, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a control-plane restart the first retry is immediate, not a random pause."""
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    monkeypatch.setattr("machine.link.random.random", lambda: 1.0)
    link = ControlLink(
        data_dir=data_dir,
        agent_count=_seven,
        version="1",
        registry=CollectorRegistry(),
        backoff_initial=5.0,
        backoff_max=5.0,
        stable_after=0.0,
    )
    async with link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        control.fake.drop(control.fake.streams[0])
        started = time.monotonic()
        await _until(lambda: len(control.fake.streams) == 2)
        assert time.monotonic() - started < 2.0


async def _seven() -> int:
    return 7


async def test_account_deleted_stops_the_link(control: Running, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    async with _link(data_dir, CollectorRegistry()) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        control.fake.send(
            control.fake.streams[0],
            link_pb2.ControlMessage(account_deleted=link_pb2.AccountDeleted()),
        )
        await link.wait_for_state(LinkState.ACCOUNT_DELETED, timeout=2)


async def test_refused_account_stops_the_link(control: Running, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    control.fake.account_deleting = True
    async with _link(data_dir, CollectorRegistry()) as link:
        await link.wait_for_state(LinkState.ACCOUNT_DELETED, timeout=5)
        assert "being deleted" in link.final_reason
    assert control.fake.connects == 1


async def test_client_cert_of_another_ca_is_refused(control: Running, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    # Swap in a certificate for the same key, signed by a stranger CA.
    stranger = tls.make_ca()
    keys = identity.load_keys(data_dir)
    link = identity.load_link(data_dir)
    csr = tls.build_csr(tls.load_private_key(keys.tls_key_pem))
    forged = tls.sign_client_csr(
        stranger,
        csr,
        account_id=link.account_id,
        machine_id=link.machine_id,
        lifetime=dt.timedelta(hours=1),
    )
    (data_dir / "keys" / identity.TLS_CERT).write_bytes(forged.cert_pem)
    registry = CollectorRegistry()
    async with _link(data_dir, registry) as running:
        await _until(lambda: _sample(registry, "agents_machine_link_reconnects_total") >= 2)
        assert running.state is not LinkState.CONNECTED
    assert control.fake.connects == 0  # the handshake failed before any handler ran


async def test_delivery_is_acked_after_the_callback(control: Running, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    got: list[Delivery] = []

    async def store(delivery: Delivery) -> None:
        got.append(delivery)

    async with _link(data_dir, CollectorRegistry(), on_delivery=store) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        stream = control.fake.streams[0]
        prompt_id, agent_id = new_id("prompt"), new_id("agent")
        control.fake.send(
            stream,
            link_pb2.ControlMessage(
                delivery=link_pb2.Delivery(id=prompt_id, agent_id=agent_id, sealed_prompt=b"x")
            ),
        )
        await _until(lambda: stream.acks == [prompt_id])
    assert [(d.id, d.agent_id, d.sealed_prompt) for d in got] == [(prompt_id, agent_id, b"x")]


async def test_link_renews_a_short_lived_certificate(control: Running, tmp_path: Path) -> None:
    control.fake.cert_lifetime = dt.timedelta(seconds=3)
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    first = identity.load_keys(data_dir).tls_cert_pem
    registry = CollectorRegistry()
    async with _link(data_dir, registry, renew_fraction=0.5) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        await _until(lambda: _sample_ok(registry) >= 2, timeout=10)
        assert link.state is LinkState.CONNECTED
    renewed = identity.load_keys(data_dir)
    assert renewed.tls_cert_pem != first
    assert tls.cert_not_after(renewed.tls_cert_pem) > tls.cert_not_after(first)
    assert identity.load_link(data_dir).cert_not_after == tls.cert_not_after(renewed.tls_cert_pem)
    assert stat.S_IMODE((data_dir / "keys" / identity.TLS_CERT).stat().st_mode) == 0o600
    assert control.fake.renew_calls >= 2


async def test_renew_now_renews_at_once(control: Running, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    async with _link(data_dir, CollectorRegistry()) as link:
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)
        assert control.fake.renew_calls == 0
        control.fake.send(
            control.fake.streams[0],
            link_pb2.ControlMessage(renew_now=link_pb2.RenewNow(reason="rollover")),
        )
        await _until(lambda: control.fake.renew_calls == 1)
        # After a renewal the next connection presents the new certificate.
        control.fake.drop(control.fake.streams[0])
        await _until(lambda: len(control.fake.streams) == 2)
        await link.wait_for_state(LinkState.CONNECTED, timeout=5)


def test_link_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        _link(tmp_path, CollectorRegistry(), renew_fraction=1.5)


def test_no_os_environ_here() -> None:
    # The house rule: only config modules read the environment.
    for mod in ("link", "join", "identity", "service_unit"):
        text = (Path(__file__).parents[2] / "machine" / f"{mod}.py").read_text()
        assert "os.environ" not in text, mod
        assert "print(" not in text, mod
    assert os.sep  # keep the import used on every platform
