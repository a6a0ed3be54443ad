"""gRPC MachineLink servicer: thin translation between messages and domain calls."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
from google.protobuf.timestamp_pb2 import Timestamp

from controlplane.machines import MachineInfo, MachineService
from controlplane.metrics import ControlMetrics
from controlplane.pairing import Pairing
from controlplane.presence import (
    AccountDeletedNotice,
    CloseLink,
    CloseReason,
    Outgoing,
    PresenceRegistry,
    RenewNowNotice,
    RevokedNotice,
    Session,
)
from controlplane.records import Machine
from shared import tls
from shared.errors import (
    AgentsError,
    InvalidArgument,
    InvalidState,
    Unauthenticated,
    Unimplemented,
)
from shared.pb.control.v1 import link_pb2, link_pb2_grpc
from shared.rpc import status_for

__all__ = ["LinkServicer"]

logger = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]

#: Seconds a closing link waits for the machine to half-close after a final notice.
_LINGER = 0.5
#: Renewal is refused while more than this fraction of the lifetime remains
#: (or the configured threshold, if larger): it bounds how often a machine, or a
#: thief of its current key, can mint certificates.
_RENEW_EARLIEST = 0.5
_LATER = "not implemented yet: backups through the control plane arrive in a later release"


def _ts(value: dt.datetime) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(value.astimezone(dt.UTC))
    return ts


class LinkServicer(link_pb2_grpc.MachineLinkServicer):
    """Join, certificate renewal and the Connect stream."""

    def __init__(
        self,
        *,
        pairing: Pairing,
        machines: MachineService,
        presence: PresenceRegistry,
        metrics: ControlMetrics,
        heartbeat_interval: float,
        renew_threshold: float,
        link_port: int,
        link_host: str = "",
    ) -> None:
        self._pairing = pairing
        self._machines = machines
        self._presence = presence
        self._metrics = metrics
        self._heartbeat = heartbeat_interval
        self._renew_threshold = renew_threshold
        self.link_port = link_port
        self.link_host = link_host

    async def _peer(self, context: Context) -> tuple[Machine, bytes]:
        """The verified machine behind the call's client certificate."""
        certs = list(context.auth_context().get("x509_pem_cert") or [])
        if not certs:
            raise Unauthenticated("link: no client certificate (use the link address)")
        pem = certs[0]
        # gRPC verified the chain at the handshake; checking again is cheap and
        # keeps us safe should the listener ever be configured differently.
        try:
            tls.verify_issued_by(pem, self._pairing.ca_cert_pem)
            peer = tls.identity_from_cert(pem)
        except InvalidArgument:
            raise Unauthenticated("link: certificate not issued by this control plane") from None
        return await self._machines.authorize_peer(peer), pem

    async def Join(self, request: link_pb2.JoinRequest, context: Context) -> link_pb2.JoinResponse:
        """See link.proto."""
        info = MachineInfo(
            name=request.machine.name,
            version=request.machine.version,
            hostname=request.machine.hostname,
            box_public_key=request.machine.box_public_key,
            signing_public_key=request.machine.signing_public_key,
        )
        try:
            result = await self._pairing.join(request.token, request.csr_pem, info)
        except AgentsError as e:
            self._metrics.joins.labels(status_for(e).name.lower()).inc()
            raise
        self._metrics.joins.labels("ok").inc()
        return link_pb2.JoinResponse(
            certificate_pem=result.cert.cert_pem.decode(),
            ca_certificate_pem=result.ca_cert_pem.decode(),
            machine_id=result.machine.machine_id,
            account_id=result.account.account_id,
            account_recovery_public_key=result.account.recovery_public_key,
            heartbeat_interval_ms=int(self._heartbeat * 1000),
            certificate_not_after=_ts(result.cert.not_after),
            link_port=self.link_port,
            link_host=self.link_host,
        )

    async def RenewCertificate(
        self, request: link_pb2.RenewCertificateRequest, context: Context
    ) -> link_pb2.RenewCertificateResponse:
        """See link.proto."""
        try:
            machine, pem = await self._peer(context)
            if tls.identity_from_cert(pem).serial != machine.cert_serial:
                # A superseded certificate may still connect until it expires, but
                # never mint a new one: a stolen old key must not outlive it.
                raise Unauthenticated("renew: only the current certificate may renew")
            if not tls.needs_renewal(pem, max(self._renew_threshold, _RENEW_EARLIEST)):
                raise InvalidState("renew", "certificate is not due for renewal yet")
            cert = await self._pairing.renew(machine, request.csr_pem)
        except AgentsError as e:
            self._metrics.renewals.labels(status_for(e).name.lower()).inc()
            raise
        self._metrics.renewals.labels("ok").inc()
        return link_pb2.RenewCertificateResponse(
            certificate_pem=cert.cert_pem.decode(),
            ca_certificate_pem=self._pairing.ca_cert_pem.decode(),
            certificate_not_after=_ts(cert.not_after),
        )

    async def Connect(
        self, request_iterator: AsyncIterator[link_pb2.MachineMessage], context: Context
    ) -> AsyncIterator[link_pb2.ControlMessage]:
        """See link.proto: hello -> welcome, then heartbeats/acks <-> notices."""
        timeout = 3 * self._heartbeat
        if not context.auth_context().get("x509_pem_cert"):
            # Anonymous (the public listener): refuse at once, hold nothing open.
            self._metrics.connects.labels("refused").inc()
            raise Unauthenticated("link: no client certificate (use the link address)")
        # Read the hello BEFORE refusing a machine: ending the call while the machine's
        # first write is still in flight makes its side see INTERNAL ("Internal
        # error from Core") instead of our status, and a refused machine would
        # then retry forever instead of stopping.
        first: link_pb2.MachineMessage | None
        try:
            async with asyncio.timeout(timeout):
                first = await anext(request_iterator)
        except (TimeoutError, StopAsyncIteration):
            first = None
        try:
            machine, pem = await self._peer(context)
        except AgentsError:
            self._metrics.connects.labels("refused").inc()
            raise
        if first is None or first.WhichOneof("kind") != "hello":
            self._metrics.connects.labels("bad_hello").inc()
            raise InvalidArgument("hello", "the first message must be hello")
        version = first.hello.version
        if len(version) > 64 or not version.isprintable():
            # It reaches operators' terminals through `machine list`.
            self._metrics.connects.labels("bad_hello").inc()
            raise InvalidArgument("hello.version", "must be at most 64 printable characters")
        session = await self._presence.open(machine, version, max(0, first.hello.agent_count))
        # A revoke that landed between the check above and registering the session
        # found no session to close: look again now that it is registered.
        if self._machines.is_revoked(machine.machine_id):
            session.outbox.put_nowait(RevokedNotice("machine revoked by an administrator"))
        self._metrics.connects.labels("ok").inc()
        expires = tls.load_cert(pem).not_valid_after_utc
        reader = asyncio.create_task(self._read(request_iterator, session, timeout, expires))
        reason = "closed"
        try:
            yield link_pb2.ControlMessage(
                welcome=link_pb2.Welcome(
                    heartbeat_interval_ms=int(self._heartbeat * 1000),
                    server_time=_ts(dt.datetime.now(dt.UTC)),
                    machine_id=machine.machine_id,
                )
            )
            if tls.needs_renewal(pem, self._renew_threshold):
                yield link_pb2.ControlMessage(
                    renew_now=link_pb2.RenewNow(reason="certificate nearing expiry")
                )
            while True:
                item = await session.next_outgoing()
                message = self._encode(item)
                if message is not None:
                    yield message
                if isinstance(item, CloseLink):
                    reason = item.reason.value
                    break
                if isinstance(item, RevokedNotice | AccountDeletedNotice):
                    reason = "revoked" if isinstance(item, RevokedNotice) else "account_deleted"
                    # Give the machine a moment to half-close after reading the notice:
                    # ending the call while it is still sending makes its side see
                    # an INTERNAL error instead of the notice.
                    await asyncio.wait([reader], timeout=_LINGER)
                    break
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            await self._presence.close(session)
            self._metrics.disconnects.labels(reason).inc()

    async def _read(
        self,
        requests: AsyncIterator[link_pb2.MachineMessage],
        session: Session,
        timeout: float,
        expires: dt.datetime,
    ) -> None:
        """Consume the machine's messages; end the link after 3 silent intervals,
        or once the certificate it connected with has expired."""
        reason = CloseReason.CLOSED
        try:
            while True:
                async with asyncio.timeout(timeout):
                    msg = await anext(requests)
                if dt.datetime.now(dt.UTC) >= expires:
                    reason = CloseReason.EXPIRED
                    break
                kind = msg.WhichOneof("kind")
                if kind == "heartbeat":
                    await self._presence.seen(session, msg.heartbeat.agent_count)
                elif kind == "ack":
                    await self._presence.seen(session)
                else:
                    await self._presence.seen(session)
        except TimeoutError:
            reason = CloseReason.TIMEOUT
            logger.info("machine %s: no heartbeat for %.1fs", session.machine_id, timeout)
        except StopAsyncIteration:
            reason = CloseReason.CLOSED
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the stream broke: the link is over either way
            reason = CloseReason.BROKEN
            logger.info("machine %s: link read ended: %s", session.machine_id, e)
        session.outbox.put_nowait(CloseLink(reason))

    @staticmethod
    def _encode(item: Outgoing) -> link_pb2.ControlMessage | None:
        if isinstance(item, RevokedNotice):
            return link_pb2.ControlMessage(revoked=link_pb2.Revoked(reason=item.reason))
        if isinstance(item, AccountDeletedNotice):
            return link_pb2.ControlMessage(
                account_deleted=link_pb2.AccountDeleted(account_id=item.account_id)
            )
        if isinstance(item, RenewNowNotice):
            return link_pb2.ControlMessage(renew_now=link_pb2.RenewNow(reason=item.reason))
        return None

    async def _later(self, context: Context, what: str) -> Any:
        await self._peer(context)
        raise Unimplemented(what, _LATER)

    async def HaveSegments(self, request: Any, context: Context) -> Any:
        """Later issue."""
        return await self._later(context, "HaveSegments")

    async def PutSegment(self, request_iterator: Any, context: Context) -> Any:
        """Later issue."""
        return await self._later(context, "PutSegment")

    async def PutManifest(self, request: Any, context: Context) -> Any:
        """Later issue."""
        return await self._later(context, "PutManifest")

    async def ListBackups(self, request: Any, context: Context) -> Any:
        """Later issue."""
        return await self._later(context, "ListBackups")

    async def GetManifest(self, request: Any, context: Context) -> Any:
        """Later issue."""
        return await self._later(context, "GetManifest")

    async def GetSegment(self, request: Any, context: Context) -> AsyncIterator[Any]:
        """Later issue."""
        await self._later(context, "GetSegment")
        yield None  # pragma: no cover - abort raised above

    async def Prune(self, request: Any, context: Context) -> Any:
        """Later issue."""
        return await self._later(context, "Prune")
