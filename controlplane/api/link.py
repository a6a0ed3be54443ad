"""gRPC MachineLink servicer: thin translation between messages and domain calls.

Connect decodes the machine's messages into :mod:`controlplane.machines.links` dataclasses,
lets :class:`~controlplane.machines.links.LinkSessions` run the link, and encodes its notices.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import grpc
import grpc.aio

from controlplane.machines.backups import MachineBackups
from controlplane.machines.links import (
    Ack,
    DeliveryHooks,
    Heartbeat,
    Hello,
    LinkNotice,
    LinkSessions,
    MachineMessage,
    RosterReport,
    Welcome,
)
from controlplane.machines.pairing import Pairing
from controlplane.machines.presence import (
    AccountDeletedNotice,
    DeliveryNotice,
    PresenceRegistry,
    RevokedNotice,
)
from controlplane.machines.registry import MachineInfo, MachineRegistry
from controlplane.machines.rosters import AgentRosters
from controlplane.metrics import ControlMetrics
from shared.errors import InvalidArgument, Unimplemented
from shared.pb.control.v1 import link_pb2, link_pb2_grpc
from shared.timestamps import Clock, field_datetime, from_datetime

__all__ = ["LinkServicer"]

logger = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]

_NO_BACKUPS = "this control plane keeps no backups"
#: Bytes per GetSegment message (well under the 4 MiB message limit).
_SEGMENT_CHUNK: Final = 1024 * 1024


def _utcnow() -> dt.datetime:
    # The default clock, looked up at each call so a test can move this module's time.
    return dt.datetime.now(dt.UTC)


def _peer_pem(context: Context) -> bytes | None:
    """The client certificate gRPC verified at the handshake, if any."""
    certs = list(context.auth_context().get("x509_pem_cert") or [])
    return certs[0] if certs else None


def _fire_time(msg: link_pb2.Hello | link_pb2.Heartbeat) -> dt.datetime | None:
    return field_datetime(msg, "next_fire_at")


def _decode(msg: link_pb2.MachineMessage) -> MachineMessage:
    kind = msg.WhichOneof("kind")
    if kind == "heartbeat":  # nearly every message: first
        return Heartbeat(msg.heartbeat.agent_count, _fire_time(msg.heartbeat))
    if kind == "hello":
        return Hello(msg.hello.version, msg.hello.agent_count, _fire_time(msg.hello))
    if kind == "ack":
        return Ack(msg.ack.delivery_id, msg.ack.run_id, msg.ack.refused_reason)
    if kind == "roster":
        return RosterReport(
            tuple(msg.roster.active_agent_ids), tuple(msg.roster.archived_agent_ids)
        )
    return Ack()


def _encode(notice: LinkNotice) -> link_pb2.ControlMessage:
    if isinstance(notice, Welcome):
        return link_pb2.ControlMessage(
            welcome=link_pb2.Welcome(
                heartbeat_interval_ms=int(notice.heartbeat_interval * 1000),
                server_time=from_datetime(notice.server_time),
                machine_id=notice.machine_id,
                control_addresses=notice.control_addresses,
            )
        )
    if isinstance(notice, RevokedNotice):
        return link_pb2.ControlMessage(revoked=link_pb2.Revoked(reason=notice.reason))
    if isinstance(notice, AccountDeletedNotice):
        return link_pb2.ControlMessage(
            account_deleted=link_pb2.AccountDeleted(account_id=notice.account_id)
        )
    if isinstance(notice, DeliveryNotice):
        return link_pb2.ControlMessage(
            delivery=link_pb2.Delivery(
                id=notice.prompt_id,
                sealed_prompt=notice.sealed_prompt,
                agent_id=notice.agent_id,
                created_at=from_datetime(notice.created_at),
            )
        )
    return link_pb2.ControlMessage(renew_now=link_pb2.RenewNow(reason=notice.reason))


class LinkServicer(link_pb2_grpc.MachineLinkServicer):
    """Join, certificate renewal and the Connect stream."""

    def __init__(
        self,
        *,
        pairing: Pairing,
        machines: MachineRegistry,
        presence: PresenceRegistry,
        metrics: ControlMetrics,
        heartbeat_interval: float,
        renew_threshold: float,
        link_port: int,
        link_host: str = "",
        backups: MachineBackups | None = None,
        deliveries: DeliveryHooks | None = None,
        rosters: AgentRosters | None = None,
        clock: Clock = _utcnow,
        control_addresses: Callable[[], tuple[str, ...]] = tuple,
    ) -> None:
        self._pairing = pairing
        self._clock = clock
        self._backups = backups
        self._metrics = metrics
        self._heartbeat = heartbeat_interval
        self._renew_threshold = renew_threshold
        self._sessions = LinkSessions(
            # Read at each use: a CA rollover changes both while we serve.
            ca_cert_pem=lambda: pairing.ca_cert_pem,
            current_ca=pairing.issued_by_current_ca,
            machines=machines,
            presence=presence,
            metrics=metrics,
            heartbeat_interval=heartbeat_interval,
            renew_threshold=renew_threshold,
            clock=clock,
            deliveries=deliveries,
            rosters=rosters,
            control_addresses=control_addresses,
        )
        self._control_addresses = control_addresses
        self.link_port = link_port
        self.link_host = link_host

    async def Join(self, request: link_pb2.JoinRequest, context: Context) -> link_pb2.JoinResponse:
        """See link.proto."""
        info = MachineInfo(
            name=request.machine.name,
            version=request.machine.version,
            hostname=request.machine.hostname,
            box_public_key=request.machine.box_public_key,
            signing_public_key=request.machine.signing_public_key,
        )
        result = await self._pairing.join(
            request.token,
            request.csr_pem,
            info,
            request.repair_machine_id,
            take_over=request.take_over,
            recovery_public_key=request.recovery_public_key,
        )
        return link_pb2.JoinResponse(
            certificate_pem=result.cert.cert_pem.decode(),
            ca_certificate_pem=result.ca_cert_pem.decode(),
            machine_id=result.machine.machine_id,
            account_id=result.account.account_id,
            account_recovery_public_key=result.account.recovery_public_key,
            heartbeat_interval_ms=int(self._heartbeat * 1000),
            certificate_not_after=from_datetime(result.cert.not_after),
            link_port=self.link_port,
            link_host=self.link_host,
            control_addresses=self._control_addresses(),
        )

    async def RenewCertificate(
        self, request: link_pb2.RenewCertificateRequest, context: Context
    ) -> link_pb2.RenewCertificateResponse:
        """See link.proto."""
        # authorize refuses a missing certificate.
        peer = await self._sessions.authorize(_peer_pem(context))
        cert = await self._pairing.renew_presented(peer, request.csr_pem, self._renew_threshold)
        return link_pb2.RenewCertificateResponse(
            certificate_pem=cert.cert_pem.decode(),
            ca_certificate_pem=self._pairing.ca_cert_pem.decode(),
            certificate_not_after=from_datetime(cert.not_after),
        )

    async def Connect(
        self, request_iterator: AsyncIterator[link_pb2.MachineMessage], context: Context
    ) -> AsyncIterator[link_pb2.ControlMessage]:
        """See link.proto: hello -> welcome, then heartbeats/acks <-> notices."""
        # Closed here, not at garbage collection: the session's cleanup (presence,
        # disconnect reason) must run as the call ends. Messages are decoded as
        # the session reads them (no generator of our own between it and gRPC).
        notices = self._sessions.run(_peer_pem(context), request_iterator, _decode)
        async with contextlib.aclosing(notices):
            async for notice in notices:
                yield _encode(notice)

    # Backups: the account and machine come from the verified certificate only.

    async def _caller(self, context: Context) -> tuple[MachineBackups, str, str]:
        """The backups domain and the caller's (account id, machine id)."""
        peer = await self._sessions.authorize(_peer_pem(context))
        if self._backups is None:
            raise Unimplemented("backups", _NO_BACKUPS)
        return self._backups, peer.machine.account_id, peer.machine.machine_id

    async def HaveSegments(
        self, request: link_pb2.HaveSegmentsRequest, context: Context
    ) -> link_pb2.HaveSegmentsResponse:
        """See link.proto."""
        backups, account, machine = await self._caller(context)
        have = await backups.have_segments(account, machine, list(request.hashes))
        names = sorted(have)
        return link_pb2.HaveSegmentsResponse(present=names, present_sizes=[have[n] for n in names])

    async def PutSegment(
        self, request_iterator: AsyncIterator[link_pb2.PutSegmentRequest], context: Context
    ) -> link_pb2.PutSegmentResponse:
        """See link.proto: a header, then the chunks, streamed into the store."""
        backups, account, machine = await self._caller(context)
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "header":
            raise InvalidArgument("header", "the first message names the segment")

        async def chunks() -> AsyncIterator[bytes]:
            async for msg in request_iterator:
                if msg.WhichOneof("kind") != "chunk":
                    raise InvalidArgument("chunk", "only chunks follow the header")
                yield msg.chunk

        stored = await backups.put_segment(
            account,
            machine,
            first.header.hash,
            chunks(),
            declared=first.header.size or None,
            replace=first.header.replace,
        )
        if stored:
            self._metrics.backup_stored_bytes.labels("segment").inc(stored)
            self._metrics.backup_stored_objects.labels("segment").inc()
        return link_pb2.PutSegmentResponse(stored_bytes=stored)

    async def PutManifest(
        self, request: link_pb2.PutManifestRequest, context: Context
    ) -> link_pb2.PutManifestResponse:
        """See link.proto."""
        backups, account, machine = await self._caller(context)
        await backups.put_manifest(
            account,
            machine,
            request.backup_id,
            bytes(request.sealed_manifest),
            list(request.segment_hashes),
        )
        self._metrics.backup_stored_bytes.labels("manifest").inc(len(request.sealed_manifest))
        self._metrics.backup_stored_objects.labels("manifest").inc()
        return link_pb2.PutManifestResponse(stored_at=from_datetime(self._clock()))

    async def ListBackups(
        self, request: link_pb2.ListBackupsRequest, context: Context
    ) -> link_pb2.ListBackupsResponse:
        """See link.proto: newest first."""
        backups, account, machine = await self._caller(context)
        owner = await backups.source(account, machine, request.machine_id)
        infos = await backups.list_manifests(account, owner)
        return link_pb2.ListBackupsResponse(
            backups=[
                link_pb2.BackupInfo(backup_id=i.backup_id, machine_id=owner, manifest_size=i.size)
                for i in reversed(infos)
            ]
        )

    async def GetManifest(
        self, request: link_pb2.GetManifestRequest, context: Context
    ) -> link_pb2.GetManifestResponse:
        """See link.proto."""
        backups, account, machine = await self._caller(context)
        owner = await backups.source(account, machine, request.machine_id)
        blob = await backups.get_manifest(account, owner, request.backup_id)
        self._metrics.backup_served_bytes.inc(len(blob))
        return link_pb2.GetManifestResponse(sealed_manifest=blob)

    async def GetSegment(
        self, request: link_pb2.GetSegmentRequest, context: Context
    ) -> AsyncIterator[link_pb2.GetSegmentChunk]:
        """See link.proto: the store's stream, re-cut to bounded messages."""
        backups, account, machine = await self._caller(context)
        owner = await backups.source(account, machine, request.machine_id)
        async for chunk in backups.get_segment(account, owner, request.hash):
            for i in range(0, len(chunk), _SEGMENT_CHUNK):
                part = chunk[i : i + _SEGMENT_CHUNK]
                self._metrics.backup_served_bytes.inc(len(part))
                yield link_pb2.GetSegmentChunk(data=part)

    async def Prune(
        self, request: link_pb2.PruneRequest, context: Context
    ) -> link_pb2.PruneResponse:
        """See link.proto."""
        backups, account, machine = await self._caller(context)
        result = await backups.prune(account, machine, request.keep)
        return link_pb2.PruneResponse(
            deleted_manifests=len(result.manifests),
            deleted_segments=result.segments,
            deleted_backup_ids=list(result.manifests),
        )
