"""An in-process control plane behind a fake of the machine's link client.

:class:`FakeControlPlane` stands where the real ``MachineLink`` service would,
without gRPC or sockets: ``fake.for_join`` is a
:class:`~machine.link.client.JoinDialer` and ``fake.mutual`` a
:class:`~machine.link.client.LinkDialer`, so ``join_control_plane(dial=...)``
and ``ControlLink(dial=...)`` talk to it directly. It behaves like the real
service where the machine's logic depends on it:

- the mutual-TLS checks: a certificate not issued by its CA, or expired, fails
  every call with UNAVAILABLE (the handshake) before any handler runs; the
  peer's identity comes from the certificate, never from a request field;
- refusals arrive as :class:`grpc.aio.AioRpcError`, with the rich status the
  server's error interceptor would attach (:func:`domain_rpc_error`) or with
  words only (:func:`rpc_error`), whichever a test scripts;
- a Connect stream is refused at its first read, after the hello.

It records every call so tests prove what the machine sent (and did not), and
is scriptable: ``fail(rpc, error)`` queues a failure for the next call of an
RPC, ``send``/``drop`` push notices or a broken stream to a live Connect,
``down`` refuses every mutual-TLS call like a stopped control plane. The
backup RPCs run the control plane's own backup domain
(:class:`controlplane.machines.backups.MachineBackups`) on a memory store.

The pin check before a join is a real TLS handshake, so join tests serve
:func:`serve_pin_check` (a bare TLS listener presenting the server chain).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ssl
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio

from controlplane.machines.backups import MachineBackups
from machine.link.client import (
    AgentRoster,
    BackupEntry,
    ControlNotice,
    DeliveryAck,
    JoinReply,
    MachineInfo,
    Renewed,
    Welcome,
)
from shared import tls
from shared.crypto import BoxKeyPair
from shared.errors import AgentsError, InvalidState, Unauthenticated
from shared.ids import new_id
from shared.rpc import _DETAILS_KEY, _rich_status, status_for
from shared.store import MemoryStore

__all__ = [
    "FakeControlPlane",
    "FakeLinkClient",
    "FakeStream",
    "GOOD_SECRET",
    "Hello",
    "Stream",
    "domain_rpc_error",
    "rpc_error",
    "serve_pin_check",
]

GOOD_SECRET = "s" * 43
"""A well-formed token secret (a token is ``<tok_id>.<secret>``)."""


def rpc_error(
    code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, bytes], ...] = ()
) -> grpc.aio.AioRpcError:
    """A failed call as the client sees it (``trailing``: the trailing metadata)."""
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details
    )


def domain_rpc_error(exc: AgentsError) -> grpc.aio.AioRpcError:
    """The error a client sees when a servicer raised ``exc`` (shared.rpc's interceptor)."""
    code = status_for(exc)
    status = _rich_status(exc, code)
    return rpc_error(code, exc.message, ((_DETAILS_KEY, status.SerializeToString()),))


def _unavailable(what: str) -> grpc.aio.AioRpcError:
    # No status detail: a transport failure, as join's "connection lost" check expects.
    return rpc_error(grpc.StatusCode.UNAVAILABLE, what)


@dataclass(frozen=True)
class Hello:
    """The hello a stream opened with."""

    version: str
    agent_count: int
    next_fire_at: float | None


@dataclass
class Stream:
    """One welcomed Connect stream as the fake control plane saw it."""

    machine_id: str
    hello: Hello
    cert_pem: bytes
    """The client certificate the stream presented."""
    heartbeats: int = 0
    acks: list[tuple[str, DeliveryAck | None]] = field(default_factory=list)
    rosters: list[tuple[list[str], list[str]]] = field(default_factory=list)
    ended_by_client: bool = False
    inbox: asyncio.Queue[ControlNotice | grpc.aio.AioRpcError | None] = field(
        default_factory=asyncio.Queue
    )

    @property
    def ack_ids(self) -> list[str]:
        """The delivery ids acknowledged, in order."""
        return [delivery_id for delivery_id, _ in self.acks]


class FakeStream:
    """The machine's end of one Connect stream (a :class:`ControlStream`)."""

    def __init__(self, fake: FakeControlPlane, client: FakeLinkClient) -> None:
        self._fake = fake
        self._client = client
        self._inbox: asyncio.Queue[ControlNotice | grpc.aio.AioRpcError | None] = asyncio.Queue()
        self._error: grpc.aio.AioRpcError | None = client.handshake_error()
        self._record: Stream | None = None
        self.cancelled = False
        if self._error is None:
            fake.connects += 1

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self.cancelled:
            raise asyncio.InvalidStateError("the call was cancelled")

    async def hello(
        self, version: str, agent_count: int, next_fire_at: float | None = None
    ) -> None:
        self._check()
        hello = Hello(version, agent_count, next_fire_at)
        # Like the real control plane: the hello is read before any refusal,
        # which then ends the stream at the machine's first read.
        refusal = self._fake.connect_refusal(self._client.peer.machine_id)
        if refusal is not None:
            self._inbox.put_nowait(refusal)
            return
        record = Stream(self._client.peer.machine_id, hello, self._client.cert_pem)
        record.inbox = self._inbox
        self._record = record
        self._fake.streams.append(record)
        self._inbox.put_nowait(
            Welcome(
                record.machine_id,
                self._fake.heartbeat_ms / 1000,
                self._fake.clock(),
                self._fake.control_addresses,
            )
        )

    def _live(self) -> Stream:
        self._check()
        if self._record is None:
            raise AssertionError("the machine wrote before its hello was welcomed")
        return self._record

    async def heartbeat(self, agent_count: int, next_fire_at: float | None = None) -> None:
        self._live().heartbeats += 1

    async def roster(self, roster: AgentRoster) -> None:
        self._live().rosters.append((list(roster.active), list(roster.archived)))

    async def ack(self, delivery_id: str, answer: DeliveryAck | None = None) -> None:
        self._live().acks.append((delivery_id, answer))

    async def read(self) -> ControlNotice | None:
        self._check()
        item = await self._inbox.get()
        if isinstance(item, grpc.aio.AioRpcError):
            self._error = item
            raise item
        return item

    async def done_writing(self) -> None:
        record = self._live()
        record.ended_by_client = True
        # The control plane's handler returns at the machine's EOF: a clean end.
        self._inbox.put_nowait(None)

    def cancel(self) -> None:
        self.cancelled = True


class FakeLinkClient:
    """One channel to :class:`FakeControlPlane` (the fake of :class:`LinkClient`)."""

    def __init__(
        self,
        fake: FakeControlPlane,
        target: str,
        ca_pem: bytes,
        cert_pem: bytes = b"",
        key_pem: bytes = b"",
    ) -> None:
        self._fake = fake
        self.target = target
        self.ca_pem = ca_pem
        self.cert_pem = cert_pem
        self._key_pem = key_pem
        self._shaken = False
        self.closed = False

    @property
    def peer(self) -> tls.PeerIdentity:
        """Who the client certificate says we are (mutual TLS only)."""
        return tls.identity_from_cert(self.cert_pem)

    def handshake_error(self) -> grpc.aio.AioRpcError | None:
        """Why a mutual-TLS call fails before any handler runs, if it does.

        Like a gRPC channel, the TLS handshake happens once, on the first call:
        a certificate that expires later keeps serving the channel.
        """
        fake = self._fake
        if fake.down or self.target != fake.link_address:
            return _unavailable(f"failed to connect to {self.target}: connection refused")
        if not self._shaken:
            error = self._handshake()
            if error is not None:
                return error
            self._shaken = True
        return None

    def _handshake(self) -> grpc.aio.AioRpcError | None:
        if self._fake.handshake_failure:
            return _unavailable(f"Tls handshake failed: {self._fake.handshake_failure}")
        fake = self._fake
        try:
            tls.verify_issued_by(self.cert_pem, fake.trusted_cas())
        except AgentsError:
            return _unavailable("handshake failed: certificate verify failed")
        key = tls.load_private_key(self._key_pem).public_key()
        if tls.load_cert(self.cert_pem).public_key() != key:
            return _unavailable("handshake failed: the key does not match the certificate")
        if tls.cert_not_after(self.cert_pem) <= fake.clock():
            return _unavailable("handshake failed: certificate expired")
        if fake.ca.cert_pem not in self.ca_pem:
            return _unavailable("handshake failed: the server's CA is not trusted")
        return None

    async def _mutual(self, rpc: str) -> tls.PeerIdentity:
        if self.closed:
            raise ValueError("the channel is closed")
        error = self.handshake_error() or self._fake.next_failure(rpc)
        if error is not None:
            raise error
        return self.peer

    async def aclose(self) -> None:
        self.closed = True

    async def join(
        self,
        token: str,
        csr_pem: str,
        machine: MachineInfo,
        *,
        timeout: float,
        repair_machine_id: str = "",
        take_over: bool = False,
        recovery_public_key: bytes = b"",
    ) -> JoinReply:
        return self._fake.join(
            self, token, csr_pem, machine, repair_machine_id, take_over, recovery_public_key
        )

    async def renew(self, csr_pem: str, *, timeout: float) -> Renewed:
        peer = await self._mutual("renew")
        return self._fake.renew(peer, csr_pem, self.cert_pem)

    def connect(self) -> FakeStream:
        return FakeStream(self._fake, self)

    # Backups: the control plane's own domain (controlplane.machines.backups) on a memory
    # store, its errors as the servicer's interceptor sends them.

    async def _backups(self, rpc: str, machine_id: str = "") -> tuple[str, str]:
        """(account, owner) of a backup call: the caller's, or a source it names."""
        peer = await self._mutual(rpc)
        try:
            owner = await self._fake.backups.source(peer.account_id, peer.machine_id, machine_id)
        except AgentsError as e:
            raise domain_rpc_error(e) from None
        return peer.account_id, owner

    async def have_segments(self, names: Iterable[str], *, timeout: float) -> dict[str, int]:
        account, me = await self._backups("have_segments")
        with _as_rpc_error():
            return await self._fake.backups.have_segments(account, me, list(names))

    async def put_segment(
        self,
        name: str,
        size: int,
        data: AsyncIterable[bytes],
        *,
        timeout: float,
        replace: bool = False,
    ) -> int:
        account, me = await self._backups("put_segment")
        with _as_rpc_error():
            return await self._fake.backups.put_segment(
                account, me, name, data, declared=size or None, replace=replace
            )

    async def put_manifest(
        self, backup_id: str, blob: bytes, names: Iterable[str], *, timeout: float
    ) -> None:
        account, me = await self._backups("put_manifest")
        with _as_rpc_error():
            await self._fake.backups.put_manifest(account, me, backup_id, blob, list(names))

    async def list_backups(self, machine_id: str = "", *, timeout: float) -> list[BackupEntry]:
        account, owner = await self._backups("list_backups", machine_id)
        with _as_rpc_error():
            infos = await self._fake.backups.list_manifests(account, owner)
        # Newest first, like the servicer.
        return [BackupEntry(i.backup_id, owner, i.size) for i in reversed(infos)]

    async def get_manifest(self, backup_id: str, machine_id: str = "", *, timeout: float) -> bytes:
        account, owner = await self._backups("get_manifest", machine_id)
        with _as_rpc_error():
            return await self._fake.backups.get_manifest(account, owner, backup_id)

    async def get_segment(
        self, name: str, machine_id: str = "", *, timeout: float
    ) -> AsyncIterator[bytes]:
        account, owner = await self._backups("get_segment", machine_id)
        with _as_rpc_error():
            async for chunk in self._fake.backups.get_segment(account, owner, name):
                yield chunk

    async def prune(self, keep: int, *, timeout: float) -> tuple[list[str], int]:
        account, me = await self._backups("prune")
        with _as_rpc_error():
            result = await self._fake.backups.prune(account, me, keep)
        return list(result.manifests), result.segments


@contextlib.contextmanager
def _as_rpc_error() -> Iterator[None]:
    try:
        yield
    except AgentsError as e:
        raise domain_rpc_error(e) from None


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class FakeControlPlane:
    """A scriptable MachineLink control plane in this process (see the module doc)."""

    def __init__(
        self,
        ca: tls.CertKey,
        *,
        heartbeat_ms: int = 25,
        link_address: str = "127.0.0.1:7444",
        clock: Callable[[], dt.datetime] = _utc_now,
    ) -> None:
        self.ca = ca
        self.next_ca: tls.CertKey | None = None
        """During a CA rollover: signs joins, and joins hand out both CAs."""
        self.heartbeat_ms = heartbeat_ms
        self.link_address = link_address
        """Where the mutual-TLS listener is (the join reply names its port)."""
        self.control_addresses: tuple[str, ...] = ()
        """The live replicas' link addresses the join reply and each welcome list."""
        self.public_address = ""
        """Where joins go (set by whoever serves the pin check)."""
        self.clock = clock
        self.cert_lifetime = dt.timedelta(hours=1)
        self.account_id = new_id("account")
        self.recovery = BoxKeyPair.generate()
        self.tokens: set[str] = set()
        self.repairs: dict[str, str] = {}
        """Repair token -> the machine it repairs."""
        self.revoked: set[str] = set()
        self.unknown: set[str] = set()
        self.account_deleting = False
        self.down = False
        """Refuse every mutual-TLS call like a stopped control plane."""
        self.handshake_failure = ""
        """When set, every mutual-TLS handshake fails with these words (BoringSSL's
        "certificate is not yet valid" for a machine whose clock is behind)."""
        self.failures: dict[str, list[grpc.aio.AioRpcError]] = {}
        self.accounts: dict[str, str] = {}
        """Machine id -> account id of every machine joined here."""
        self.tamper_join: Callable[[JoinReply], JoinReply] | None = None
        """Rewrites the next join reply (a broken or hostile control plane)."""
        self.join_calls = 0
        self.joined: list[MachineInfo] = []
        self.renew_calls = 0
        self.refuse_renewals: AgentsError | None = None
        """Every renewal that reaches the handler is refused with this (e.g. "not due")."""
        self.renewed: list[bytes] = []
        """The certificates renewals handed out, in order."""
        self.current: dict[str, bytes] = {}
        """Machine id -> its current certificate: like controlplane.machines.pairing,
        only that one may renew (the one before it still connects)."""
        self.connects = 0
        self.streams: list[Stream] = []
        self.backups = MachineBackups(MemoryStore(), exists=self._exists)
        """Backups kept (the control plane's own domain, on a memory store)."""

    # -------------------------------------------------------------- dialers

    def for_join(self, target: str, ca_pem: bytes) -> FakeLinkClient:
        """A :class:`~machine.link.client.JoinDialer`."""
        return FakeLinkClient(self, target, ca_pem)

    def mutual(
        self, target: str, *, ca_pem: bytes, key_pem: bytes, cert_pem: bytes
    ) -> FakeLinkClient:
        """A :class:`~machine.link.client.LinkDialer`."""
        return FakeLinkClient(self, target, ca_pem, cert_pem, key_pem)

    async def _exists(self, account_id: str, machine_id: str) -> bool:
        return self.accounts.get(machine_id) == account_id

    def trusted_cas(self) -> bytes:
        """The CAs whose client certificates the link listener accepts."""
        return self.ca.cert_pem + (self.next_ca.cert_pem if self.next_ca else b"")

    # -------------------------------------------------------------- scripting

    def new_token(self) -> str:
        value = f"{new_id('token')}.{GOOD_SECRET}"
        self.tokens.add(value)
        return value

    def fail(self, rpc: str, error: grpc.aio.AioRpcError) -> None:
        """Fail the next call of ``rpc`` (join, renew, connect, have_segments, ...)."""
        self.failures.setdefault(rpc, []).append(error)

    def next_failure(self, rpc: str) -> grpc.aio.AioRpcError | None:
        queued = self.failures.get(rpc)
        return queued.pop(0) if queued else None

    def send(self, stream: Stream, notice: ControlNotice) -> None:
        """Push a notice to a live stream."""
        stream.inbox.put_nowait(notice)

    def drop(self, stream: Stream) -> None:
        """Break a live stream, as a control plane that went away does."""
        stream.inbox.put_nowait(_unavailable("dropped by test"))

    # -------------------------------------------------------------- the service

    def connect_refusal(self, machine_id: str) -> grpc.aio.AioRpcError | None:
        """Why Connect refuses this machine now, if it does (after the hello)."""
        if (scripted := self.next_failure("connect")) is not None:
            return scripted
        if machine_id in self.revoked:
            # Without the error detail, as an older control plane answers.
            return rpc_error(grpc.StatusCode.UNAUTHENTICATED, "link: machine revoked")
        if machine_id in self.unknown:
            return rpc_error(grpc.StatusCode.UNAUTHENTICATED, "link: unknown machine")
        if self.account_deleting:
            return rpc_error(grpc.StatusCode.PERMISSION_DENIED, "link: account is being deleted")
        return None

    def join(
        self,
        client: FakeLinkClient,
        token: str,
        csr_pem: str,
        machine: MachineInfo,
        repair_machine_id: str,
        take_over: bool = False,
        recovery_public_key: bytes = b"",
    ) -> JoinReply:
        if client.target != self.public_address:
            raise _unavailable(f"failed to connect to {client.target}")
        if self.ca.cert_pem not in client.ca_pem:
            raise _unavailable("handshake failed: the server's CA is not trusted")
        self.join_calls += 1
        if (scripted := self.next_failure("join")) is not None:
            raise scripted
        if token not in self.tokens:
            raise domain_rpc_error(Unauthenticated("join: token refused"))
        # Like controlplane.machines.pairing: a re-pair needs a repair token for that machine.
        repairs = self.repairs.get(token, "")
        if repair_machine_id and repair_machine_id != repairs:
            raise domain_rpc_error(
                InvalidState("join", "this box is already joined; the token was not used")
            )
        if repairs and not repair_machine_id and not take_over:
            raise domain_rpc_error(
                InvalidState("join", "this is a repair token: this box would take over machine")
            )
        if repairs and recovery_public_key and recovery_public_key != self.recovery.public_key:
            raise domain_rpc_error(
                InvalidState("join", "the recovery key given is not the recovery key of this")
            )
        self.tokens.discard(token)
        self.joined.append(machine)
        machine_id = repairs or new_id("machine")
        self.accounts[machine_id] = self.account_id
        issued = tls.sign_client_csr(
            self.next_ca or self.ca,
            csr_pem,
            account_id=self.account_id,
            machine_id=machine_id,
            lifetime=self.cert_lifetime,
            now=self.clock(),
        )
        self.current[machine_id] = issued.cert_pem
        bundle = self.trusted_cas()
        reply = JoinReply(
            certificate_pem=issued.cert_pem.decode(),
            ca_certificate_pem=bundle.decode(),
            machine_id=machine_id,
            account_id=self.account_id,
            account_recovery_public_key=self.recovery.public_key,
            heartbeat_interval_ms=self.heartbeat_ms,
            link_host="",  # the join's host, like a control plane on one address
            link_port=int(self.link_address.rpartition(":")[2]),
            control_addresses=self.control_addresses,
        )
        tamper, self.tamper_join = self.tamper_join, None
        return tamper(reply) if tamper else reply

    def renew(self, peer: tls.PeerIdentity, csr_pem: str, presented: bytes = b"") -> Renewed:
        self.renew_calls += 1
        if self.refuse_renewals is not None:
            raise domain_rpc_error(self.refuse_renewals)
        current = self.current.get(peer.machine_id)
        if current is not None and presented and presented != current:
            raise domain_rpc_error(Unauthenticated("renew: only the current certificate may renew"))
        issued = tls.sign_client_csr(
            self.ca,
            csr_pem,
            account_id=peer.account_id,
            machine_id=peer.machine_id,
            lifetime=self.cert_lifetime,
            now=self.clock(),
        )
        self.renewed.append(issued.cert_pem)
        self.current[peer.machine_id] = issued.cert_pem
        return Renewed(issued.cert_pem.decode(), self.ca.cert_pem.decode())


#: An HTTP/2 SETTINGS frame with no settings (length 0, type 4, no flags, stream
#: 0): the first thing a gRPC server sends on a new connection.
_EMPTY_H2_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@contextlib.asynccontextmanager
async def serve_pin_check(
    ca: tls.CertKey, *, with_ca: bool = True, speaks_first: bool = True
) -> AsyncIterator[str]:
    """A bare TLS listener presenting a server certificate of ``ca``; its address.

    ``with_ca=False`` leaves the CA out of the chain (a misconfigured server).
    Like the control plane's public port it sends an HTTP/2 SETTINGS frame after
    the handshake, which tells the pin check it is not the link port at once;
    ``speaks_first=False`` stays silent instead (a proxy that waits for the
    client), which the pin check waits out (machine.link.join._HANGUP_WAIT, 2 s).
    """
    server_cert = tls.issue_server_cert(ca)
    chain = server_cert.cert_pem + (ca.cert_pem if with_ca else b"")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as folder:
        cert_file, key_file = Path(folder, "chain.pem"), Path(folder, "key.pem")
        cert_file.write_bytes(chain)
        key_file.write_bytes(server_cert.key_pem)
        ctx.load_cert_chain(cert_file, key_file)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # The join's pin check only shakes hands and hangs up.
        with contextlib.suppress(OSError, ssl.SSLError):
            if speaks_first:
                writer.write(_EMPTY_H2_SETTINGS)
                await writer.drain()
            await reader.read()
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()
