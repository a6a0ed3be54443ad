"""gRPC MachineLink servicer: thin translation between messages and domain calls.

Connect decodes the machine's messages into :mod:`controlplane.links` dataclasses,
lets :class:`~controlplane.links.LinkSessions` run the link, and encodes its notices.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
import grpc.aio

from controlplane.links import (
    Ack,
    DeliveryHooks,
    Heartbeat,
    Hello,
    LinkNotice,
    LinkSessions,
    MachineMessage,
    Welcome,
)
from controlplane.machines import MachineInfo, MachineRegistry
from controlplane.metrics import ControlMetrics
from controlplane.pairing import Pairing
from controlplane.presence import (
    AccountDeletedNotice,
    DeliveryNotice,
    PresenceRegistry,
    RevokedNotice,
)
from shared.pb.control.v1 import link_pb2, link_pb2_grpc
from shared.rpc import unimplemented
from shared.timestamps import from_datetime

__all__ = ["LinkServicer"]

logger = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]

_LATER = "not implemented yet: backups through the control plane arrive in a later release"


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _peer_pem(context: Context) -> bytes | None:
    """The client certificate gRPC verified at the handshake, if any."""
    certs = list(context.auth_context().get("x509_pem_cert") or [])
    return certs[0] if certs else None


async def _decode(
    requests: AsyncIterator[link_pb2.MachineMessage],
) -> AsyncGenerator[MachineMessage, None]:
    async for msg in requests:
        kind = msg.WhichOneof("kind")
        if kind == "hello":
            yield Hello(msg.hello.version, msg.hello.agent_count)
        elif kind == "heartbeat":
            yield Heartbeat(msg.heartbeat.agent_count)
        elif kind == "ack":
            yield Ack(msg.ack.delivery_id, msg.ack.run_id, msg.ack.refused_reason)
        else:
            yield Ack()


def _encode(notice: LinkNotice) -> link_pb2.ControlMessage:
    if isinstance(notice, Welcome):
        return link_pb2.ControlMessage(
            welcome=link_pb2.Welcome(
                heartbeat_interval_ms=int(notice.heartbeat_interval * 1000),
                server_time=from_datetime(notice.server_time),
                machine_id=notice.machine_id,
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
        deliveries: DeliveryHooks | None = None,
    ) -> None:
        self._pairing = pairing
        self._metrics = metrics
        self._heartbeat = heartbeat_interval
        self._renew_threshold = renew_threshold
        self._sessions = LinkSessions(
            ca_cert_pem=pairing.ca_cert_pem,
            machines=machines,
            presence=presence,
            metrics=metrics,
            heartbeat_interval=heartbeat_interval,
            renew_threshold=renew_threshold,
            # Looked up here at each call, so tests can move only this module's clock.
            clock=_utcnow,
            deliveries=deliveries,
        )
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
        result = await self._pairing.join(request.token, request.csr_pem, info)
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
        # Close both generators here, not at garbage collection: the session's
        # cleanup (presence, disconnect reason) must run as the call ends.
        async with (
            contextlib.aclosing(_decode(request_iterator)) as messages,
            contextlib.aclosing(self._sessions.run(_peer_pem(context), messages)) as notices,
        ):
            async for notice in notices:
                yield _encode(notice)

    async def _authorize(self, context: Context) -> None:
        await self._sessions.authorize(_peer_pem(context))

    # RPCs that arrive with later issues.
    HaveSegments = unimplemented("HaveSegments", _LATER, check="_authorize")
    PutSegment = unimplemented("PutSegment", _LATER, check="_authorize")
    PutManifest = unimplemented("PutManifest", _LATER, check="_authorize")
    ListBackups = unimplemented("ListBackups", _LATER, check="_authorize")
    GetManifest = unimplemented("GetManifest", _LATER, check="_authorize")
    GetSegment = unimplemented("GetSegment", _LATER, check="_authorize")
    Prune = unimplemented("Prune", _LATER, check="_authorize")
