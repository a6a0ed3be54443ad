"""Machine link sessions: the rules of one Connect stream, without gRPC.

:meth:`LinkSessions.run` takes the certificate the machine presented and an
async iterator of its messages (each decoded by the ``decode`` it is given, as
it is read: no generator in between, a link's one hot path being a heartbeat),
and yields the notices to send it:

1. No certificate (the public listener): refused at once, nothing held open.
2. Otherwise the hello is read FIRST (up to three heartbeat intervals), then the
   certificate is authorised: ending the call while the machine's first write
   is still in flight makes its side see INTERNAL instead of our status, and a
   refused machine would then retry forever instead of stopping.
3. The hello must come first and carry a short printable version (it reaches
   operators' terminals through ``machine list``).
4. The session is registered, then revocation is checked again: a revoke that
   landed between authorisation and registration found no session to close.
5. :class:`Welcome`, then a renew-now notice when the certificate is due, then
   whatever the presence registry queues for the machine (a
   :class:`~controlplane.machines.presence.ReplicasChangedNotice` is sent as
   a fresh welcome: it lists the replicas' link addresses). The link ends on a
   revoked / account-deleted notice (after a short linger so the machine can
   read it), on a :class:`~controlplane.machines.presence.CloseLink`, after three silent
   heartbeat intervals, or once the certificate it connected with has expired.

Outcomes are counted in ``agents_cp_connects_total{outcome}`` and
``agents_cp_disconnects_total{reason}``. A machine that half-closes its side
is ``closed``; a stream torn down without that goodbye (a machine killed with
SIGKILL, a reset connection) is ``broken``: its end reads like a half-close, so
the session waits ``linger`` seconds for the call to be torn down first.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from controlplane.machines.presence import (
    AccountDeletedNotice,
    CloseLink,
    CloseReason,
    DeliveryNotice,
    PresenceRegistry,
    RenewNowNotice,
    ReplicasChangedNotice,
    RevokedNotice,
    Session,
)
from controlplane.machines.registry import AuthorizedPeer, MachineRegistry
from controlplane.machines.rosters import AgentRosters
from controlplane.metrics import ControlMetrics
from shared import tls
from shared.errors import AgentsError, InvalidArgument, Unauthenticated
from shared.store.causes import store_cause
from shared.timestamps import Clock, utc_now

__all__ = [
    "CA_ROLLOVER_REASON",
    "Ack",
    "DeliveryHooks",
    "Heartbeat",
    "Hello",
    "LinkNotice",
    "LinkSessions",
    "MachineMessage",
    "RosterReport",
    "Welcome",
]

logger = logging.getLogger(__name__)

#: Seconds a closing link waits for the machine to half-close after a final notice.
LINGER = 0.5
#: Seconds a link ended by a revoked / account-deleted notice waits for the
#: machine's half-close. Longer than LINGER because a well-behaved machine ends
#: the wait at once, while a loaded one may still be finishing a heartbeat write:
#: ending the call under that write turns the notice into INTERNAL on its side.
NOTICE_GRACE = 3.0
#: Longest hello version accepted.
MAX_VERSION = 64
#: The renew-now reason a CA rollover gives.
CA_ROLLOVER_REASON = "ca rollover"


@dataclass(frozen=True)
class Hello:
    """The machine's first message."""

    version: str
    agent_count: int
    next_fire_at: dt.datetime | None = None
    """The soonest fire time of its schedules, or None."""


@dataclass(frozen=True)
class Heartbeat:
    """Proof of life with the machine's current agent count."""

    agent_count: int
    next_fire_at: dt.datetime | None = None
    """The soonest fire time of its schedules, or None (none comes)."""


@dataclass(frozen=True)
class Ack:
    """An acknowledgement, or (with no delivery id) a kind this release does not know."""

    delivery_id: str = ""
    run_id: str = ""
    refused: str = ""


@dataclass(frozen=True)
class RosterReport:
    """The ids of the machine's agents by state (controlplane.machines.rosters)."""

    active: tuple[str, ...] = ()
    archived: tuple[str, ...] = ()


MachineMessage = Hello | Heartbeat | Ack | RosterReport


@dataclass(frozen=True)
class Welcome:
    """The first notice of an accepted link."""

    heartbeat_interval: float
    """Seconds between the machine's heartbeats."""
    server_time: dt.datetime
    machine_id: str
    control_addresses: tuple[str, ...] = ()
    """The live replicas' link addresses (the machine adds those it lacks)."""


LinkNotice = Welcome | RenewNowNotice | RevokedNotice | AccountDeletedNotice | DeliveryNotice
#: Turns one message as read from the stream into a :data:`MachineMessage`.
Decode = Callable[[Any], MachineMessage]


def _as_is(message: Any) -> MachineMessage:
    """The decode of a stream that yields :data:`MachineMessage` already."""
    return cast(MachineMessage, message)


class DeliveryHooks(Protocol):
    """What the link tells the prompt delivery (controlplane.queue.delivery) about a session."""

    def connected(self, session: Session) -> None:
        """The machine's link is up: deliver its queue."""

    async def acked(self, session: Session, ack: Ack) -> None:
        """The machine stored a delivery durably."""

    def disconnected(self, session: Session) -> None:
        """The link ended: whatever is unacknowledged is delivered again next time."""


class _Silence:
    """Cancels the task that made it once nothing was heard for ``timeout`` seconds.

    One timer per link, moved only when it fires (a message just notes the
    time): a timeout armed and cancelled around every read cost a timer per
    heartbeat, a good part of the control plane's work for one.
    """

    def __init__(self, timeout: float) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._timeout = timeout
        self._heard_at = self._loop.time()
        self._fired = False
        self._handle = self._loop.call_at(self._heard_at + timeout, self._check)

    def heard(self) -> None:
        """A message came."""
        self._heard_at = self._loop.time()

    def _check(self) -> None:
        due = self._heard_at + self._timeout
        if self._loop.time() < due:
            self._handle = self._loop.call_at(due, self._check)
            return
        self._fired = True
        self._task.cancel()

    def timed_out(self) -> bool:
        """Whether the task's cancellation was this silence's, and only that (which
        it then takes back, as asyncio.timeout does)."""
        return self._fired and self._task.uncancel() == 0

    def stop(self) -> None:
        """No more waiting (idempotent)."""
        self._handle.cancel()


class LinkSessions:
    """Runs machines' Connect streams; one instance per daemon."""

    def __init__(
        self,
        *,
        ca_cert_pem: bytes | Callable[[], bytes],
        machines: MachineRegistry,
        presence: PresenceRegistry,
        metrics: ControlMetrics,
        heartbeat_interval: float,
        renew_threshold: float,
        clock: Clock = utc_now,
        linger: float = LINGER,
        deliveries: DeliveryHooks | None = None,
        rosters: AgentRosters | None = None,
        current_ca: Callable[[bytes], bool] | None = None,
        control_addresses: Callable[[], tuple[str, ...]] = tuple,
    ) -> None:
        # A callable follows CA rotations (the daemon passes Pairing's view).
        self._ca_cert_pem = ca_cert_pem if callable(ca_cert_pem) else lambda: ca_cert_pem
        # Whether a certificate is signed by the CA that signs them now: one of the
        # old CA (a rollover) is asked to renew at connect (controlplane.recovery.rotation).
        self._current_ca = current_ca
        self._machines = machines
        self._presence = presence
        self._metrics = metrics
        self._heartbeat = heartbeat_interval
        self._renew_threshold = renew_threshold
        self._clock = clock
        self._linger = linger
        self._deliveries = deliveries
        self._rosters = rosters
        # Read at each welcome: replicas come and go while links stay up.
        self._control_addresses = control_addresses

    async def authorize(self, cert_pem: bytes | None) -> AuthorizedPeer:
        """The machine a client certificate names, if it may still act, and its identity.

        Unauthenticated without a certificate, for one not issued by our CA,
        and for an unknown or revoked machine (see MachineRegistry.authorize_peer).
        """
        if cert_pem is None:
            raise Unauthenticated("link: no client certificate (use the link address)")
        # gRPC verified the chain at the handshake; checking again is cheap and
        # keeps us safe should the listener ever be configured differently.
        try:
            tls.verify_issued_by(cert_pem, self._ca_cert_pem())
            peer = tls.identity_from_cert(cert_pem)
        except InvalidArgument:
            raise Unauthenticated("link: certificate not issued by this control plane") from None
        machine = await self._machines.authorize_peer(peer)
        return AuthorizedPeer(machine, peer, cert_pem)

    def _welcome(self, machine_id: str) -> Welcome:
        return Welcome(self._heartbeat, self._clock(), machine_id, self._control_addresses())

    async def run(
        self, cert_pem: bytes | None, messages: AsyncIterator[Any], decode: Decode = _as_is
    ) -> AsyncGenerator[LinkNotice, None]:
        """Run one link (see the module doc); close the generator to end it early.
        ``decode`` turns each of ``messages`` into a :data:`MachineMessage`."""
        timeout = 3 * self._heartbeat
        if cert_pem is None:
            self._metrics.connects.labels("refused").inc()
            raise Unauthenticated("link: no client certificate (use the link address)")
        first: MachineMessage | None
        try:
            async with asyncio.timeout(timeout):
                first = decode(await anext(messages))
        except (TimeoutError, StopAsyncIteration):
            first = None
        try:
            machine = (await self.authorize(cert_pem)).machine
        except AgentsError:
            self._metrics.connects.labels("refused").inc()
            raise
        if not isinstance(first, Hello):
            self._metrics.connects.labels("bad_hello").inc()
            raise InvalidArgument("hello", "the first message must be hello")
        if len(first.version) > MAX_VERSION or not first.version.isprintable():
            self._metrics.connects.labels("bad_hello").inc()
            raise InvalidArgument(
                "hello.version", f"must be at most {MAX_VERSION} printable characters"
            )
        session = await self._presence.open(machine, first.version, max(0, first.agent_count))
        self._presence.fire_reported(session, first.next_fire_at)
        if self._machines.is_revoked(machine.machine_id):
            session.outbox.put_nowait(RevokedNotice("machine revoked by an administrator"))
        self._metrics.connects.labels("ok").inc()
        expires = tls.load_cert(cert_pem).not_valid_after_utc
        # The machine's side ended (it half-closed, or died). A future, not an
        # Event: an Event's waiter deque is most of a KiB per link, for one wait.
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        reader = asyncio.create_task(self._read(messages, decode, session, timeout, expires, ended))
        # Torn down from outside without a goodbye (the machine was killed, its
        # connection reset, the call cancelled): broken, unless a reason is set below.
        reason = CloseReason.BROKEN.value
        try:
            yield self._welcome(machine.machine_id)
            if tls.needs_renewal(cert_pem, self._renew_threshold):
                yield RenewNowNotice("certificate nearing expiry")
            elif self._current_ca is not None and not self._current_ca(cert_pem):
                yield RenewNowNotice(CA_ROLLOVER_REASON)
            del cert_pem  # not needed again: a link should hold only what it uses
            if self._deliveries is not None:
                self._deliveries.connected(session)
            while True:
                item = await session.next_outgoing()
                if isinstance(item, CloseLink):
                    reason = item.reason.value
                    break
                if isinstance(item, ReplicasChangedNotice):
                    # Welcome is the message that lists the replicas' link addresses.
                    yield self._welcome(machine.machine_id)
                    continue
                yield item
                if isinstance(item, RevokedNotice | AccountDeletedNotice):
                    reason = "revoked" if isinstance(item, RevokedNotice) else "account_deleted"
                    # Give the machine a moment to half-close after reading the notice:
                    # ending the call while it is still sending makes its side see
                    # an INTERNAL error instead of the notice.
                    await asyncio.wait(
                        [reader, ended],
                        timeout=max(self._linger, NOTICE_GRACE),
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    break
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            if self._deliveries is not None:
                self._deliveries.disconnected(session)
            await self._presence.close(session)
            self._metrics.disconnects.labels(reason).inc()

    async def _read(
        self,
        messages: AsyncIterator[Any],
        decode: Decode,
        session: Session,
        timeout: float,
        expires: dt.datetime,
        ended: asyncio.Future[None],
    ) -> None:
        """Consume the machine's messages; end the link after 3 silent intervals,
        or once the certificate it connected with has expired."""
        silence = _Silence(timeout)
        try:
            reason = await self._consume(messages, decode, session, silence, expires, ended)
        except asyncio.CancelledError:
            if not silence.timed_out():
                raise
            reason = CloseReason.TIMEOUT
            logger.info("machine %s: no heartbeat for %.1fs", session.machine_id, timeout)
        except Exception as e:  # the stream broke: the link is over either way
            reason = CloseReason.BROKEN
            logger.info("machine %s: link read ended: %s", session.machine_id, e)
        finally:
            silence.stop()
        session.outbox.put_nowait(CloseLink(reason))
        # Offline now, whatever happens to the sending side: if the call was torn
        # down while its response generator sat at a yield, nothing else would
        # consume the CloseLink until that generator is finalised.
        await self._presence.close(session)

    async def _consume(
        self,
        messages: AsyncIterator[Any],
        decode: Decode,
        session: Session,
        silence: _Silence,
        expires: dt.datetime,
        ended: asyncio.Future[None],
    ) -> CloseReason:
        """Handle the machine's messages until its stream ends (why it ended)."""
        async for raw in messages:
            silence.heard()
            msg = decode(raw)
            if self._clock() >= expires:
                return CloseReason.EXPIRED
            if isinstance(msg, Heartbeat):
                # Heard, and a write only when one is due (presence.py): most
                # heartbeats touch nothing but the session.
                self._presence.fire_reported(session, msg.next_fire_at)
                if self._presence.heard(session, msg.agent_count):
                    with store_cause("heartbeat"):
                        await self._presence.write(session)
                continue
            await self._presence.seen(session)
            if isinstance(msg, Ack) and msg.delivery_id and self._deliveries is not None:
                with store_cause("queue"):
                    await self._deliveries.acked(session, msg)
            if isinstance(msg, RosterReport) and self._rosters is not None:
                with store_cause("roster"):
                    await self._rosters.report(
                        session.account_id, session.machine_id, msg.active, msg.archived
                    )
        silence.stop()
        if not ended.done():
            ended.set_result(None)
        # The end of a killed machine's stream also reads as a clean end, and
        # the call is torn down a moment later: wait for that before calling
        # it a goodbye (a closing machine waits longer than this for us).
        await asyncio.sleep(self._linger)
        return CloseReason.CLOSED
