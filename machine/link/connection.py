"""The machine's live link to its control plane.

:class:`ControlLink` is an async context manager. While it is open, one
background task keeps a ``Connect`` stream to the control plane's mutual-TLS
listener: it sends ``hello``, waits for ``welcome``, then sends a heartbeat
every interval the welcome names, hands deliveries to ``on_delivery`` and
acknowledges each once that returns (the callback stores it durably); a
delivery the callback fails to store ends the stream (see ``_deliver``), so
no later prompt is stored before it. The ids
of the machine's agents (``roster``: ids and active/archived, never names) go
after the welcome, then with any heartbeat that finds them changed, and once
more before a clean goodbye: the control plane refuses prompts for unknown or
archived agents from it while the machine is offline (all that is
:mod:`machine.link.heartbeats`).

Reconnect policy: a failed attempt is retried forever with exponential backoff
and full jitter (``backoff_initial`` doubling up to ``backoff_max`` seconds),
so a thousand machines that lose the control plane at once come back spread
out. The cap is low (2 s, :data:`RECONNECT_CAP`): a restored control plane
must have every machine back within 5 s of listening again (docs/runbooks/
disaster-recovery.md), and a failed dial to a control plane that is down is a
refused TCP connection, cheap for both sides; with full jitter a fleet still
arrives spread over the cap, about one attempt per machine a second.
An outage is logged once, not once a second: its first failed attempt is a
WARNING, the others DEBUG (the same line) with a WARNING reminder every 5
minutes, and the first welcome after it one INFO line (shared.outage).
A stream that was up for a while and then dropped is retried at once
(a restarted control plane is usually back by then; if not, the jittered
backoff spreads the fleet). The link stops for good (and logs an ERROR) only
when the control plane says ``revoked`` or ``account_deleted``, or refuses the
stream as revoked (:class:`~shared.errors.MachineRevoked`) or with
PERMISSION_DENIED (account deleted). Any other refusal ("unknown machine",
"certificate superseded": a control plane whose store is being restored may
say so) keeps the machine's identity and retries every ``refused_retry``
seconds (jittered), so it comes back by itself once the control plane knows
it again. A machine that never connected since its join (the join's mark,
:data:`~machine.link.identity.UNCONFIRMED_FILE`, cleared at the first welcome)
and is refused as unknown had its join rolled back: the ERROR it logs says how
to join the folder again (``join --as-new``).

Replicas: the link record may list several link addresses, one per replica
of the control plane (``join --link-address``). The link tries the first (the
one that last worked); a failed attempt or a stream that ended moves it to the
next, round-robin, with the same backoff and one WARNING per outage (not one
per address). The address that answers with a welcome is saved first in the
record, so the renewals and the backups (:mod:`machine.link.following`, which
reads the record) follow it, and a restarted daemon starts there. Each
welcome (the first of each stream, and another whenever a replica joins the
control plane) lists the live replicas' link addresses; the ones the record
lacks are added after its own (identity.LinkRecord.learning: checked,
bounded, none of its own dropped), so a machine joined through one replica,
or before a replica was added, can still move.

Renewal: while a stream is up, :mod:`machine.link.renewal` renews the
client certificate when it is due or the control plane says ``renew_now``;
the live stream keeps going and the next connection uses the new
certificate. Clock: each welcome carries the control plane's time, from
which :mod:`machine.link.clock` measures this machine's skew (a gauge, one
log line when it is off); a connection that fails the TLS date check (this
machine's clock behind the control plane's certificate) is explained in one
log line naming both dates, while the reconnect backoff keeps trying.
:mod:`machine.link.states` holds the link's states and reads the control
plane's refusals (which are final, which are retried).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import grpc
import grpc.aio
from prometheus_client import CollectorRegistry, Counter, Gauge
from tenacity import RetryCallState

from machine.link import identity
from machine.link.client import (
    AccountDeleted,
    AgentRoster,
    ControlNotice,
    ControlStream,
    Delivery,
    DeliveryAck,
    LinkClient,
    LinkDialer,
    LinkSession,
    RenewNow,
    Revoked,
    Welcome,
)
from machine.link.clock import (
    ClockComplaint,
    ClockSkew,
    certificate_dates_problem,
    fetch_server_certificate,
    handshake_clock_problem,
)
from machine.link.heartbeats import Heartbeats
from machine.link.renewal import RENEWAL_BACKOFF_CAP, CertificateRenewal
from machine.link.states import (
    FINAL_STATES,
    LinkRefused,
    LinkState,
    LinkStopped,
    check_notice,
    is_transient,
    map_error,
)
from shared.errors import AgentsError, IntegrityError, InvalidArgument, InvalidState, TransientError
from shared.outage import OutageLog
from shared.retry import reconnecting
from shared.timestamps import Clock, utc_now
from shared.wakeups import wait_set

__all__ = ["RECONNECT_CAP", "ControlLink", "Delivery", "LinkState"]

logger = logging.getLogger(__name__)

#: Longest wait between two reconnect attempts (seconds; see the module doc).
RECONNECT_CAP: Final = 2.0
#: Seconds the read of the control plane's certificate may take after a
#: handshake failed its date check (a diagnosis only; the backoff goes on).
_PROBE_TIMEOUT: Final = 5.0
#: Seconds between two such reads while the handshakes keep failing: the
#: finding rarely changes, and a fleet with a bad clock must not double its
#: connection attempts.
_PROBE_EVERY: Final = 300.0
#: Seconds between two warnings while the link stays down: the first failed
#: attempt of an outage is a WARNING, the next ones DEBUG (about one a second at
#: the backoff's cap), with a WARNING reminder this often (shared.outage).
_REMIND_EVERY: Final = 300.0
#: Seconds a stopping link waits for a heartbeat or roster write in flight to end
#: before it cancels the beat anyway (a write stuck on a peer that reads nothing).
_WRITE_SETTLE: Final = 5.0


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.connected = Gauge(
            "agents_machine_link_connected",
            "1 while the Connect stream to the control plane is up.",
            registry=registry,
        )
        self.reconnects = Counter(
            "agents_machine_link_reconnects",
            "Connection attempts after the first one.",
            registry=registry,
        )
        self.moves = Counter(
            "agents_machine_link_address_moves",
            "Welcomes at another link address than the one first in link.json (a"
            " control-plane replica that went: the link moved to another).",
            registry=registry,
        )
        self.heartbeats = Counter(
            "agents_machine_link_heartbeats",
            "Heartbeats sent on the Connect stream.",
            registry=registry,
        )
        self.renewals = Counter(
            "agents_machine_link_renewals",
            "Client certificate renewals, by outcome (ok, error).",
            ["outcome"],
            registry=registry,
        )
        self.deliveries = Counter(
            "agents_machine_link_deliveries",
            "Deliveries received and acknowledged.",
            registry=registry,
        )
        self.clock_skew = Gauge(
            "agents_machine_clock_skew_seconds",
            "This machine's clock minus the control plane's, measured at the last welcome"
            " (0 until one was measured).",
            registry=registry,
        )


class ControlLink:
    """Keeps this machine connected to its control plane (see the module docstring)."""

    def __init__(
        self,
        *,
        data_dir: Path,
        agent_count: Callable[[], Awaitable[int]],
        version: str,
        on_delivery: Callable[[Delivery], Awaitable[DeliveryAck | None]] | None = None,
        next_fire: Callable[[], float | None] = lambda: None,
        roster: Callable[[], Awaitable[AgentRoster]] | None = None,
        registry: CollectorRegistry | None = None,
        renew_fraction: float = 1 / 3,
        backoff_initial: float = 0.5,
        backoff_max: float = RECONNECT_CAP,
        renewal_backoff_cap: float = RENEWAL_BACKOFF_CAP,
        handshake_timeout: float = 10.0,
        stable_after: float = 10.0,
        refused_retry: float = 300.0,
        clock: Clock = utc_now,
        dial: LinkDialer = LinkClient.mutual,
    ) -> None:
        if not 0 < renew_fraction < 1:
            raise InvalidArgument("renew_fraction", "must be between 0 and 1")
        if not 0 < backoff_initial <= backoff_max:
            raise InvalidArgument("backoff_initial", "must be > 0 and <= backoff_max")
        self._data_dir = data_dir
        self._version = version
        self._on_delivery = on_delivery
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._handshake_timeout = handshake_timeout
        self._stable_after = stable_after
        self._refused_retry = refused_retry
        self._clock = clock
        # Opens each connection: the real mutual-TLS client, or a test's fake.
        self._dial = dial
        self._metrics = _Metrics(registry if registry is not None else CollectorRegistry())
        # The soonest schedule fire (next_fire) goes with hello and heartbeats
        # so the control plane can wake this machine for it once it is stopped.
        self._heartbeats = Heartbeats(
            agent_count=agent_count,
            next_fire=next_fire,
            roster=roster,
            heartbeats=self._metrics.heartbeats,
        )
        self._skew = ClockSkew(self._metrics.clock_skew)
        self._complaint = ClockComplaint()
        self._renewal = CertificateRenewal(
            data_dir=data_dir,
            renew_fraction=renew_fraction,
            backoff_initial=backoff_initial,
            backoff_cap=renewal_backoff_cap,
            timeout=handshake_timeout,
            clock=clock,
            renewals=self._metrics.renewals,
            on_renewed=self._renewed,
            describe_skew=self._skew.describe,
            dial=self._dial,
        )
        self._state = LinkState.STARTING
        self._state_changed = asyncio.Condition()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._attempts = 0
        self._outage = OutageLog(logger, "control link", remind=_REMIND_EVERY)
        self._link: identity.LinkRecord | None = None
        # Which of the record's addresses the next attempt dials (see the module doc).
        self._address_at = 0
        self._address = ""
        self._ca_pem = b""
        self._next_probe = 0.0  # time.monotonic() before which no probe runs
        self._final_reason = ""
        # The join not confirmed yet, read at start: cleared at the first welcome.
        self._unconfirmed: identity.UnconfirmedJoin | None = None

    # ------------------------------------------------------------------ public

    @staticmethod
    def is_joined(data_dir: Path) -> bool:
        """True when ``data_dir`` holds a committed join."""
        return identity.is_joined(data_dir)

    @property
    def state(self) -> LinkState:
        """The link's current state."""
        return self._state

    @property
    def connected(self) -> bool:
        """True while the Connect stream is up (welcome received)."""
        return self._state is LinkState.CONNECTED

    @property
    def clock_skew(self) -> float | None:
        """This machine's clock minus the control plane's (seconds), from the last
        welcome; None until one was measured."""
        return self._skew.seconds

    @property
    def final_reason(self) -> str:
        """Why the link stopped for good (revoked / account deleted), else empty."""
        return self._final_reason

    async def wait_for_state(self, *states: LinkState, timeout: float) -> LinkState:
        """Wait until the state is one of ``states``; TimeoutError after ``timeout``."""
        async with asyncio.timeout(timeout), self._state_changed:
            await self._state_changed.wait_for(lambda: self._state in states)
        return self._state

    async def __aenter__(self) -> ControlLink:
        self._link = await asyncio.to_thread(identity.load_link, self._data_dir)
        self._unconfirmed = await asyncio.to_thread(identity.unconfirmed_join, self._data_dir)
        self._task = asyncio.create_task(self._run(), name="control-link")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self, timeout: float = 2.0) -> None:
        """Close the stream cleanly (half-close, then wait briefly) and stop the task."""
        self._stop.set()
        task, self._task = self._task, None
        if task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._state not in FINAL_STATES:
            await self._set_state(LinkState.STOPPED)

    # ---------------------------------------------------------------- the loop

    async def _set_state(self, state: LinkState) -> None:
        async with self._state_changed:
            self._state = state
            self._metrics.connected.set(1 if state is LinkState.CONNECTED else 0)
            self._state_changed.notify_all()

    async def _interruptible_sleep(self, seconds: float) -> None:
        # tenacity's sleep hook: a close() wakes the backoff at once.
        await wait_set(self._stop, seconds)

    async def _before_sleep(self, state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        if self._link is not None and self._cert_expired():
            # The control plane will refuse it at the handshake until the
            # machine is paired again; keep trying (the clock may be wrong).
            logger.error(
                "control link: the client certificate expired at %s; re-pair this machine:"
                " `agents-control machine repair %s`, then the join it prints, on this box"
                " and without --recovery-key (its data is here)",
                self._link.cert_not_after.isoformat(),
                self._link.machine_id,
            )
        if error is not None and handshake_clock_problem(error):
            await self._explain_handshake()
        failure = error if error is not None else TransientError("control link: no outcome")
        # One WARNING per outage (and a reminder), the other attempts at DEBUG in the
        # same format: bench/connect.py counts every one by its msg and args[3].
        self._outage.failed(
            failure,
            line=(
                "control link to %s failed (attempt %d), retrying in %.2fs: %s: %s",
                (
                    self._address or "?",
                    state.attempt_number,
                    wait,
                    type(failure).__name__,
                    failure,
                ),
            ),
            key=type(failure).__name__,
            extra=self._ids(),
        )
        await self._set_state(LinkState.BACKING_OFF)

    def _ids(self) -> dict[str, object] | None:
        """The ids a log line about the link names (shared.logs)."""
        return {"machine_id": self._link.machine_id} if self._link is not None else None

    async def _explain_handshake(self) -> None:
        """The TLS handshake failed its date check: say which clock and which dates,
        once per finding (the attempts go on at the backoff's pace)."""
        if self._link is None or time.monotonic() < self._next_probe:
            return
        self._next_probe = time.monotonic() + _PROBE_EVERY
        now = self._clock()
        server_pem = await asyncio.to_thread(
            fetch_server_certificate, self._address, _PROBE_TIMEOUT
        )
        certificates = [("the control plane's certificate", server_pem)] if server_pem else []
        certificates.append(("the control plane's CA certificate", self._ca_pem))
        finding = certificate_dates_problem(now, certificates) or (
            f"this machine's clock says {now.isoformat(timespec='seconds')}; the control"
            " plane's certificate failed the TLS date check by it: check this machine's"
            " clock / NTP (timedatectl)"
        )
        self._complaint.say(finding, "control link: the TLS handshake failed")

    def _cert_expired(self) -> bool:
        return self._link is not None and self._link.cert_not_after <= self._clock()

    async def _run(self) -> None:
        try:
            while not self._stop.is_set():
                retrying = reconnecting(
                    retry_on=is_transient,
                    initial=self._backoff_initial,
                    max_delay=self._backoff_max,
                    before_sleep=self._before_sleep,
                    sleep=self._interruptible_sleep,
                )
                try:
                    async for attempt in retrying:
                        with attempt:
                            await self._session()
                except LinkRefused as refused:
                    # Keep the identity: only an explicit revoke or account deletion is final.
                    wait = self._refused_retry * (0.5 + random.random() / 2)
                    self._explain_refusal(refused, wait)
                    await self._set_state(LinkState.BACKING_OFF)
                    await self._interruptible_sleep(wait)
                # A long-lived stream ended: try again at once (see the module doc).
        except LinkStopped as stop:
            self._final_reason = stop.reason
            logger.error(
                "control link stopped for good: %s; this machine will not reconnect (to join"
                " again as a new machine, keeping its agents: stop it, then `agents-machine"
                " join ADDRESS --token T --ca-hash H --as-new` with a token from"
                " `agents-control token create`)",
                stop.reason,
            )
            try:
                await asyncio.to_thread(
                    identity.mark_stopped, self._data_dir, stop.reason, self._clock().timestamp()
                )
            except OSError as e:
                logger.error("control link: cannot record the stop in the data folder: %s", e)
            await self._set_state(stop.state)
        except (InvalidState, IntegrityError) as e:
            logger.error("control link cannot start: %s", e)
            await self._set_state(LinkState.STOPPED)
        finally:
            if self._state is LinkState.CONNECTED:
                await self._set_state(LinkState.STOPPED)

    def _explain_refusal(self, refused: LinkRefused, wait: float) -> None:
        """Log a refusal that is retried; for a join the control plane rolled back
        (never confirmed, now unknown to it), how to join the folder again."""
        join = self._unconfirmed
        if join is None or "unknown machine" not in str(refused):
            logger.warning("%s; trying again in %.0fs", refused, wait)
            return
        logger.error(
            "%s: this machine's join (token %s) was never confirmed, as the machine never"
            " connected since, and the control plane rolls such a join back once its grace"
            " passed (5 minutes by default). To join this data folder again, keeping its"
            " agents: stop this daemon, then `agents-machine join ADDRESS --token T"
            " --ca-hash H --as-new` (the rolled-back join's token works again until it"
            " expires; else a new one from `agents-control token create`). Trying again"
            " in %.0fs",
            refused,
            join.token_id,
            wait,
        )

    async def _session(self) -> None:
        """One connection. Returns after a stable stream ended; raises otherwise."""
        if self._stop.is_set():
            return
        if self._attempts:
            self._metrics.reconnects.inc()
        self._attempts += 1
        await self._set_state(LinkState.CONNECTING)
        link = await asyncio.to_thread(identity.load_link, self._data_dir)
        keys = await asyncio.to_thread(identity.load_keys, self._data_dir)
        addresses = link.control_addresses
        self._address = addresses[self._address_at % len(addresses)]
        # Whatever ends this session, the next one dials the next replica: a
        # replica that went away is not tried again before the others.
        self._address_at += 1
        self._link = link
        self._ca_pem = keys.ca_cert_pem
        client = self._dial(
            self._address,
            ca_pem=keys.ca_cert_pem,
            key_pem=keys.tls_key_pem,
            cert_pem=keys.tls_cert_pem,
        )
        stream = client.connect()
        started = time.monotonic()
        try:
            await self._converse(stream, client, keys)
        except grpc.aio.AioRpcError as e:
            err = map_error(e)
            stable = time.monotonic() - started >= self._stable_after
            if not (stable and self._state is LinkState.CONNECTED and is_transient(err)):
                raise err from None
            # A stream that was up for a while broke (a control plane killed or
            # restarted): retry at once, like after a clean close.
            logger.warning("control link: the stream broke (%s); reconnecting", err)
            return
        finally:
            stream.cancel()
            await client.aclose()
            if self._state is LinkState.CONNECTED:
                await self._set_state(LinkState.CONNECTING)
        if self._stop.is_set():
            return
        if time.monotonic() - started < self._stable_after:
            # A stream that keeps dying young must back off like a failed dial.
            raise TransientError("control link: the stream closed soon after it opened")
        logger.warning("control link: the control plane closed the stream; reconnecting")

    async def _converse(
        self, stream: ControlStream, client: LinkSession, keys: identity.MachineKeys
    ) -> None:
        sent = self._clock()
        await self._heartbeats.hello(stream, self._version)
        first = await asyncio.wait_for(stream.read(), self._handshake_timeout)
        received = self._clock()
        if first is None:
            # A refusal arrives as an AioRpcError from read(); EOF is a clean close.
            raise TransientError("control link: stream closed before welcome")
        check_notice(first)
        if not isinstance(first, Welcome):
            raise TransientError(f"control link: expected welcome, got {_kind(first)}")
        self._complaint.say(None, "")  # connected: a next failure is news again
        if self._unconfirmed is not None:
            # Accepting the stream, the control plane confirmed the join.
            await asyncio.to_thread(identity.clear_unconfirmed, self._data_dir)
            self._unconfirmed = None
        self._next_probe = 0.0
        await self._remember_address()
        await self._learn_addresses(first.control_addresses)
        if first.server_time is not None:
            self._skew.observe(first.server_time, sent, received)
        interval = first.heartbeat_interval or self._link_interval()
        self._outage.recovered(extra=self._ids())
        logger.info(
            "control link up: %s as %s, heartbeat every %.3fs",
            self._address,
            first.machine_id,
            interval,
            extra={"machine_id": first.machine_id},
        )
        await self._set_state(LinkState.CONNECTED)
        await self._heartbeats.welcomed(stream)

        reader = asyncio.create_task(self._read_loop(stream), name="link-read")
        helpers = [
            asyncio.create_task(self._heartbeats.run(stream, interval), name="link-heartbeat"),
            asyncio.create_task(self._renewal.run(client, keys, self._link), name="link-renew"),
        ]
        stopper = asyncio.create_task(self._stop.wait(), name="link-stop")
        tasks: list[asyncio.Task[Any]] = [reader, *helpers, stopper]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if stopper in done and not reader.done():
                # Let a heartbeat or roster being written finish first: cancelling
                # a task inside a write can cancel the whole call.
                held = False
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_WRITE_SETTLE):
                        await self._heartbeats.writing.acquire()
                        held = True
                try:
                    for t in helpers:
                        t.cancel()
                    await asyncio.gather(*helpers, return_exceptions=True)
                    # Changes since the last heartbeat, so the control plane refuses
                    # prompts for agents deleted or archived just before we stopped.
                    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                        await self._heartbeats.send_roster(stream)
                finally:
                    if held:
                        self._heartbeats.writing.release()
                await self._half_close(stream, reader)
        finally:
            # Cancelling a task blocked in read() cancels the whole RPC,
            # so the reader goes last, after the goodbye above.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # The reader's failure first: it carries the control plane's answer
        # (a refusal, a revocation) when a write failed on the same ended stream.
        for t in sorted(done, key=lambda t: t is not reader):
            if not t.cancelled() and (exc := t.exception()) is not None:
                raise exc

    async def _half_close(self, stream: ControlStream, reader: asyncio.Task[None]) -> None:
        # A clean goodbye: end our side so the control plane sees the machine
        # leave at once rather than after missed heartbeats, then give it a
        # moment to end the stream.
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await stream.done_writing()
        await asyncio.wait({reader}, timeout=1.0)

    async def _learn_addresses(self, listed: tuple[str, ...]) -> None:
        """Add the replicas the welcome lists that link.json lacks (one started since
        the join, or one the operator did not name), so the link can move to them,
        and take out those learned earlier that it no longer lists
        (:meth:`~machine.link.identity.LinkRecord.learning`)."""
        link = self._link
        if link is None or not listed or link.learning(listed) is link:
            return
        # Reread, as _remember_address does: the record on disk is the one to extend.
        current = await asyncio.to_thread(identity.load_link, self._data_dir)
        learned = current.learning(listed)
        self._link = learned
        if learned is current:
            return
        try:
            await asyncio.to_thread(identity.save_link, self._data_dir, learned)
        except OSError as e:
            logger.warning("control link: cannot save the replicas' link addresses: %s", e)
            return
        new = [a for a in learned.control_addresses if a not in current.control_addresses]
        gone = [a for a in current.control_addresses if a not in learned.control_addresses]
        if new:
            logger.info(
                "control link: learned link address(es) %s from the control plane",
                ", ".join(new),
                extra=self._ids(),
            )
        if gone:
            logger.info(
                "control link: forgot link address(es) %s (learned from the control plane,"
                " no longer listed by it)",
                ", ".join(gone),
                extra=self._ids(),
            )

    async def _remember_address(self) -> None:
        """Save the address that welcomed us first in the record (when it is not),
        so the renewals, the backups and the next start use it."""
        link = self._link
        if link is None or link.control_address == self._address:
            return
        # Reread: a renewal may have saved a new certificate since the session began.
        current = await asyncio.to_thread(identity.load_link, self._data_dir)
        if self._address not in current.control_addresses:
            return
        self._link = current.starting_at(self._address)
        self._metrics.moves.inc()
        try:
            await asyncio.to_thread(identity.save_link, self._data_dir, self._link)
        except OSError as e:
            # The link works; only the order on disk is stale (renewals use the
            # record in memory, backups and the next start try the old one first).
            logger.warning("control link: cannot save the link address that works: %s", e)
        # The round-robin goes on from the address now first.
        self._address_at = 1
        logger.info(
            "control link: %s is now the first link address", self._address, extra=self._ids()
        )

    def _link_interval(self) -> float:
        return self._link.heartbeat_interval if self._link else 10.0

    async def _read_loop(self, stream: ControlStream) -> None:
        while True:
            notice = await stream.read()
            if notice is None:
                # read() raises AioRpcError for a failed stream: EOF means a clean close.
                return
            check_notice(notice)
            if isinstance(notice, RenewNow):
                logger.info("control plane asks for renewal: %s", notice.reason)
                self._renewal.request()
            elif isinstance(notice, Delivery):
                await self._deliver(notice, stream)
            elif isinstance(notice, Welcome):
                # Sent again when a replica joins: its list names the newcomer.
                await self._learn_addresses(notice.control_addresses)
            else:
                logger.debug("control link: ignoring %s", _kind(notice))

    async def _deliver(self, delivery: Delivery, stream: ControlStream) -> None:
        if self._on_delivery is None:
            logger.warning("delivery %s dropped: this daemon takes no deliveries", delivery.id)
            return
        try:
            answer = await self._on_delivery(delivery)
        except AgentsError as e:
            # Not stored, so not acknowledged. Reading on would store, acknowledge
            # and run the prompts sent after it before it: end the stream instead
            # (whatever the error, so a damaged database is retried too). The
            # control plane forgets what was in flight and, once this link is
            # back after its backoff, delivers again from this prompt, in order.
            raise TransientError(
                f"control link: delivery {delivery.id} not stored ({e}); reconnecting"
                " to have it delivered again before any later prompt"
            ) from e
        await stream.ack(delivery.id, answer)
        self._metrics.deliveries.inc()

    def _renewed(self, link: identity.LinkRecord) -> None:
        # The renewal saved a new certificate: the record in use from now on.
        self._link = link


def _kind(notice: ControlNotice) -> str:
    """The message kind as link.proto names it (for logs and errors)."""
    return getattr(notice, "kind", None) or {
        Welcome: "welcome",
        Revoked: "revoked",
        AccountDeleted: "account_deleted",
        RenewNow: "renew_now",
        Delivery: "delivery",
    }.get(type(notice), type(notice).__name__)
