"""The machine's one client of the control plane's MachineLink service.

It is the only machine module that imports ``link_pb2`` or builds a link
channel: join (server-authenticated TLS against the pinned CA), certificate
renewal and the Connect stream (mutual TLS), and the backup RPCs to come.
Callers get dataclasses. A failed call raises :class:`grpc.aio.AioRpcError`
unchanged: the join and the link each decide what a failure means (a lost
connection, a revoked machine) before mapping it to a domain error.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Final, Protocol, TypeAlias

import grpc
import grpc.aio

from shared.limits import LINK_MAX_MESSAGE
from shared.pb.control.v1 import link_pb2, link_pb2_grpc
from shared.timestamps import field_datetime, from_seconds

__all__ = [
    "AccountDeleted",
    "AgentRoster",
    "BackupEntry",
    "ControlNotice",
    "Delivery",
    "DeliveryAck",
    "ControlStream",
    "JoinDialer",
    "JoinReply",
    "JoinSession",
    "LinkClient",
    "LinkDialer",
    "LinkSession",
    "LinkStream",
    "MachineInfo",
    "Renewed",
    "RenewNow",
    "Revoked",
    "Unknown",
    "Welcome",
]

logger = logging.getLogger(__name__)

# HTTP/2 pings find a control plane that vanished without closing the socket
# (power cut, partition) within about 40 s. The control plane accepts pings
# every 20 s (controlplane/server.py); gRPC's default floor is 5 minutes.
_CHANNEL_OPTIONS: Final = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    # One known peer: after an outage (a control-plane restore or restart), a
    # channel tries again at least every 5 s, not after gRPC's default of up to
    # 120 s, during which every call on it fails at once as unreachable.
    ("grpc.max_reconnect_backoff_ms", 5_000),
    # What the control plane sends back (a backup's manifest) can pass gRPC's default.
    ("grpc.max_receive_message_length", LINK_MAX_MESSAGE),
    ("grpc.max_send_message_length", LINK_MAX_MESSAGE),
)


#: Link addresses taken from a reply or a welcome: no more are ever kept
#: (machine.link.identity.MAX_CONTROL_ADDRESSES).
_MOST_LISTED: Final = 16


@dataclass(frozen=True)
class MachineInfo:
    """What a joining machine tells about itself."""

    name: str
    version: str
    hostname: str
    box_public_key: bytes
    signing_public_key: bytes


@dataclass(frozen=True)
class JoinReply:
    """The control plane's answer to a join (checked by the caller)."""

    certificate_pem: str
    ca_certificate_pem: str
    machine_id: str
    account_id: str
    account_recovery_public_key: bytes
    heartbeat_interval_ms: int
    link_host: str
    link_port: int
    control_addresses: tuple[str, ...] = ()
    """Every live replica's link address, as the control plane lists them
    (unchecked here: identity.LinkRecord.learning checks them)."""


@dataclass(frozen=True)
class Renewed:
    """A renewed client certificate; the CA is empty when unchanged."""

    certificate_pem: str
    ca_certificate_pem: str


@dataclass(frozen=True)
class Welcome:
    """The control plane accepted the stream."""

    machine_id: str
    heartbeat_interval: float
    """Seconds; 0 when the control plane names none."""
    server_time: dt.datetime | None = None
    """The control plane's clock as it sent the welcome (None from one that sends none)."""
    control_addresses: tuple[str, ...] = ()
    """Every live replica's link address (unchecked here, as in JoinReply)."""


@dataclass(frozen=True)
class Revoked:
    """This machine was revoked: the link stops for good."""

    reason: str


@dataclass(frozen=True)
class AccountDeleted:
    """The machine's account was deleted: the link stops for good."""


@dataclass(frozen=True)
class RenewNow:
    """The control plane asks for a certificate renewal now."""

    reason: str


@dataclass(frozen=True)
class Delivery:
    """A prompt the control plane delivered, still sealed to our box key."""

    id: str
    """The prompt id (``pr_...``); acknowledged once ``on_delivery`` returns."""
    agent_id: str
    """The agent it is for (``ag_...``)."""
    sealed_prompt: bytes = field(repr=False)
    """The prompt, sealed (shared.crypto) to the machine's box public key."""
    created_at: dt.datetime | None
    """When it was sent (UTC)."""


@dataclass(frozen=True)
class BackupEntry:
    """One backup the control plane keeps (its manifest is sealed)."""

    backup_id: str
    machine_id: str
    manifest_size: int


@dataclass(frozen=True)
class DeliveryAck:
    """What the machine answers for a stored delivery."""

    run_id: str = ""
    """The run the prompt became (the same one for a redelivery)."""
    refused: str = ""
    """Instead of a run: why the machine will never run it."""


@dataclass(frozen=True)
class Unknown:
    """A message this machine does not know (a newer control plane)."""

    kind: str


ControlNotice: TypeAlias = Welcome | Revoked | AccountDeleted | RenewNow | Delivery | Unknown
"""What the control plane sends on the Connect stream."""


def _notice(msg: link_pb2.ControlMessage) -> ControlNotice:
    kind = msg.WhichOneof("kind")
    if kind == "welcome":
        return Welcome(
            msg.welcome.machine_id,
            msg.welcome.heartbeat_interval_ms / 1000,
            field_datetime(msg.welcome, "server_time"),
            tuple(msg.welcome.control_addresses[:_MOST_LISTED]),
        )
    if kind == "revoked":
        return Revoked(msg.revoked.reason)
    if kind == "account_deleted":
        return AccountDeleted()
    if kind == "renew_now":
        return RenewNow(msg.renew_now.reason)
    if kind == "delivery":
        pb = msg.delivery
        return Delivery(
            id=pb.id,
            agent_id=pb.agent_id,
            sealed_prompt=bytes(pb.sealed_prompt),
            created_at=field_datetime(pb, "created_at"),
        )
    return Unknown(str(kind))


@dataclass(frozen=True)
class AgentRoster:
    """The ids of this machine's agents the control plane may queue prompts for."""

    active: tuple[str, ...] = ()
    archived: tuple[str, ...] = ()


class ControlStream(Protocol):
    """What the link needs of one Connect stream (:class:`LinkStream`, or a test's fake).

    Writes and reads raise :class:`grpc.aio.AioRpcError` when the stream failed.
    """

    async def hello(
        self, version: str, agent_count: int, next_fire_at: float | None = None
    ) -> None:
        """Open the conversation; the first :meth:`read` answers it."""
        ...

    async def heartbeat(self, agent_count: int, next_fire_at: float | None = None) -> None:
        """Say the machine is alive."""
        ...

    async def roster(self, roster: AgentRoster) -> None:
        """Tell the whole roster."""
        ...

    async def ack(self, delivery_id: str, answer: DeliveryAck | None = None) -> None:
        """Acknowledge a stored delivery."""
        ...

    async def read(self) -> ControlNotice | None:
        """The next message, or None at a clean end."""
        ...

    async def done_writing(self) -> None:
        """End our side of the stream."""
        ...

    def cancel(self) -> None:
        """Abandon the stream."""
        ...


class LinkSession(Protocol):
    """What :class:`~machine.link.connection.ControlLink` needs of a mutual-TLS channel."""

    def connect(self) -> ControlStream:
        """Open the Connect stream."""
        ...

    async def renew(self, csr_pem: str, *, timeout: float) -> Renewed:
        """Renew the client certificate this channel presents."""
        ...

    async def aclose(self) -> None:
        """Close the channel."""
        ...


class LinkDialer(Protocol):
    """Opens a mutual-TLS channel (:meth:`LinkClient.mutual`, or a test's fake)."""

    def __call__(
        self, target: str, *, ca_pem: bytes, key_pem: bytes, cert_pem: bytes
    ) -> LinkSession: ...


class JoinSession(Protocol):
    """What :func:`~machine.link.join.join_control_plane` needs of a join channel."""

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
        """Join with a one-time token."""
        ...

    async def aclose(self) -> None:
        """Close the channel."""
        ...


class JoinDialer(Protocol):
    """Opens a join channel trusting the pinned CA (:meth:`LinkClient.for_join`, or a fake)."""

    def __call__(self, target: str, ca_pem: bytes) -> JoinSession: ...


_Call: TypeAlias = "grpc.aio.StreamStreamCall[link_pb2.MachineMessage, link_pb2.ControlMessage]"


class LinkStream:
    """One Connect stream: typed writes (serialised) and reads."""

    def __init__(self, call: _Call) -> None:
        self._call = call
        self._write_lock = asyncio.Lock()

    async def _send(self, msg: link_pb2.MachineMessage) -> None:
        async with self._write_lock:
            try:
                await self._call.write(msg)
            except asyncio.InvalidStateError:
                # The RPC ended before this write: its status says why (a
                # refusal, a dropped connection), not gRPC's "RPC already finished".
                raise await self._ended() from None

    async def _ended(self) -> grpc.aio.AioRpcError:
        call = self._call
        return grpc.aio.AioRpcError(
            await call.code(),
            await call.initial_metadata(),
            await call.trailing_metadata(),
            await call.details(),
            None,
        )

    async def hello(
        self, version: str, agent_count: int, next_fire_at: float | None = None
    ) -> None:
        """Open the conversation (``next_fire_at``: the soonest schedule fire, Unix seconds)."""
        hello = link_pb2.Hello(
            version=version, agent_count=agent_count, next_fire_at=from_seconds(next_fire_at)
        )
        await self._send(link_pb2.MachineMessage(hello=hello))

    async def heartbeat(self, agent_count: int, next_fire_at: float | None = None) -> None:
        """Say the machine is alive (and when its next schedule fires, if any)."""
        beat = link_pb2.Heartbeat(agent_count=agent_count, next_fire_at=from_seconds(next_fire_at))
        await self._send(link_pb2.MachineMessage(heartbeat=beat))

    async def roster(self, roster: AgentRoster) -> None:
        """Tell the ids of the machine's agents (the whole roster)."""
        await self._send(
            link_pb2.MachineMessage(
                roster=link_pb2.AgentRoster(
                    active_agent_ids=roster.active, archived_agent_ids=roster.archived
                )
            )
        )

    async def ack(self, delivery_id: str, answer: DeliveryAck | None = None) -> None:
        """Acknowledge a stored delivery (with its run id or refusal)."""
        answer = answer or DeliveryAck()
        await self._send(
            link_pb2.MachineMessage(
                ack=link_pb2.Ack(
                    delivery_id=delivery_id, run_id=answer.run_id, refused_reason=answer.refused
                )
            )
        )

    async def read(self) -> ControlNotice | None:
        """The next message, or None at a clean end (a failed stream raises AioRpcError)."""
        msg = await self._call.read()
        return _notice(msg) if isinstance(msg, link_pb2.ControlMessage) else None

    async def done_writing(self) -> None:
        """End our side of the stream (a clean goodbye)."""
        async with self._write_lock:
            await self._call.done_writing()  # nothing to do on an ended RPC

    def cancel(self) -> None:
        """Abandon the stream."""
        self._call.cancel()


class LinkClient:
    """One channel to the MachineLink service; close it with :meth:`aclose`."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel
        self._stub = link_pb2_grpc.MachineLinkStub(channel)

    @classmethod
    def for_join(cls, target: str, ca_pem: bytes) -> LinkClient:
        """Server-authenticated TLS against the pinned CA (no client certificate yet)."""
        creds = grpc.ssl_channel_credentials(root_certificates=ca_pem)
        return cls(grpc.aio.secure_channel(target, creds))

    @classmethod
    def mutual(cls, target: str, *, ca_pem: bytes, key_pem: bytes, cert_pem: bytes) -> LinkClient:
        """Mutual TLS with the machine's certificate, with keepalive pings."""
        creds = grpc.ssl_channel_credentials(
            root_certificates=ca_pem, private_key=key_pem, certificate_chain=cert_pem
        )
        return cls(grpc.aio.secure_channel(target, creds, options=_CHANNEL_OPTIONS))

    async def aclose(self) -> None:
        """Close the channel at once (so ``contextlib.aclosing`` fits)."""
        await self._channel.close(grace=None)

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
        """Join with a one-time token and a certificate request (a re-pair names our
        id; ``take_over``: a new box may take over a machine, with the public half
        of the recovery key it will restore with; see link.proto)."""
        reply = await self._stub.Join(
            link_pb2.JoinRequest(
                token=token,
                csr_pem=csr_pem,
                repair_machine_id=repair_machine_id,
                take_over=take_over,
                recovery_public_key=recovery_public_key,
                machine=link_pb2.MachineInfo(
                    name=machine.name,
                    version=machine.version,
                    hostname=machine.hostname,
                    box_public_key=machine.box_public_key,
                    signing_public_key=machine.signing_public_key,
                ),
            ),
            timeout=timeout,
        )
        return JoinReply(
            certificate_pem=reply.certificate_pem,
            ca_certificate_pem=reply.ca_certificate_pem,
            machine_id=reply.machine_id,
            account_id=reply.account_id,
            account_recovery_public_key=bytes(reply.account_recovery_public_key),
            heartbeat_interval_ms=reply.heartbeat_interval_ms,
            link_host=reply.link_host,
            link_port=reply.link_port,
            control_addresses=tuple(reply.control_addresses[:_MOST_LISTED]),
        )

    async def renew(self, csr_pem: str, *, timeout: float) -> Renewed:
        """Renew the client certificate this channel presents."""
        reply = await self._stub.RenewCertificate(
            link_pb2.RenewCertificateRequest(csr_pem=csr_pem), timeout=timeout
        )
        return Renewed(reply.certificate_pem, reply.ca_certificate_pem)

    def connect(self) -> LinkStream:
        """Open the Connect stream (driven by the stream's writes and reads)."""
        # Called without an iterator, the call is driven by write()/read();
        # grpc-stubs does not know that form.
        return LinkStream(self._stub.Connect())  # type: ignore[call-arg]

    # Backups (mutual TLS): the control plane takes our identity from the certificate.

    async def have_segments(self, names: Iterable[str], *, timeout: float) -> dict[str, int]:
        """Which of ``names`` (at most 10,000) the control plane holds, with sizes."""
        reply = await self._stub.HaveSegments(
            link_pb2.HaveSegmentsRequest(hashes=list(names)), timeout=timeout
        )
        return dict(zip(reply.present, reply.present_sizes, strict=False))

    async def put_segment(
        self,
        name: str,
        size: int,
        data: AsyncIterable[bytes],
        *,
        timeout: float,
        replace: bool = False,
    ) -> int:
        """Upload one sealed segment of ``size`` bytes (over the stored one when
        ``replace``: it was found damaged); returns the bytes stored."""

        async def messages() -> AsyncIterator[link_pb2.PutSegmentRequest]:
            header = link_pb2.SegmentHeader(hash=name, size=size, replace=replace)
            yield link_pb2.PutSegmentRequest(header=header)
            async for chunk in data:
                yield link_pb2.PutSegmentRequest(chunk=chunk)

        reply = await self._stub.PutSegment(messages(), timeout=timeout)
        return reply.stored_bytes

    async def put_manifest(
        self, backup_id: str, blob: bytes, names: Iterable[str], *, timeout: float
    ) -> None:
        """Store a sealed manifest (the backup's commit point)."""
        await self._stub.PutManifest(
            link_pb2.PutManifestRequest(
                backup_id=backup_id, sealed_manifest=blob, segment_hashes=list(names)
            ),
            timeout=timeout,
        )

    async def list_backups(self, machine_id: str = "", *, timeout: float) -> list[BackupEntry]:
        """Backups of this machine (or of ``machine_id`` of our account), newest first."""
        reply = await self._stub.ListBackups(
            link_pb2.ListBackupsRequest(machine_id=machine_id), timeout=timeout
        )
        return [BackupEntry(b.backup_id, b.machine_id, b.manifest_size) for b in reply.backups]

    async def get_manifest(self, backup_id: str, machine_id: str = "", *, timeout: float) -> bytes:
        """One sealed manifest."""
        reply = await self._stub.GetManifest(
            link_pb2.GetManifestRequest(machine_id=machine_id, backup_id=backup_id),
            timeout=timeout,
        )
        return bytes(reply.sealed_manifest)

    async def get_segment(
        self, name: str, machine_id: str = "", *, timeout: float
    ) -> AsyncIterator[bytes]:
        """One sealed segment's bytes, as they arrive."""
        call = self._stub.GetSegment(
            link_pb2.GetSegmentRequest(machine_id=machine_id, hash=name), timeout=timeout
        )
        async for msg in call:
            yield bytes(msg.data)

    async def prune(self, keep: int, *, timeout: float) -> tuple[list[str], int]:
        """Keep our newest ``keep`` backups: (backup ids, segment count) deleted."""
        reply = await self._stub.Prune(link_pb2.PruneRequest(keep=keep), timeout=timeout)
        return list(reply.deleted_backup_ids), reply.deleted_segments
