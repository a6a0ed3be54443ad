"""Renewal of the machine's client certificate while the Connect stream is up.

Once less than ``renew_fraction`` of the certificate's lifetime is left
(timed from when we received it), or when the control plane says
``renew_now`` (:meth:`CertificateRenewal.request`), the link sends a CSR for
the same TLS key to ``RenewCertificate`` and replaces ``keys/tls.crt``
atomically, and ``keys/ca.crt`` with the CA the reply names (a CA rollover)
or else the one already pinned. The reply is checked against our key and
identity before anything is written. The live stream keeps going; the next
connection uses the new certificate.

A failed renewal is tried again after a backoff (:func:`renewal_backoff`):
doubling from the link's first backoff up to :data:`RENEWAL_BACKOFF_CAP` (an
hour), and starting at :data:`NOT_DUE_BACKOFF` when the control plane answered
that the certificate is not due yet. That answer comes by the control plane's
clock, so a machine whose own clock runs days ahead thinks renewal is due and
is told no: without the backoff it asked again every reconnect backoff (2 s),
forever. The backoff outlives a stream (it is this object's state, not the
stream's), so a link that reconnects does not start asking again at once. A
``renew_now`` from the control plane wakes the wait at once (the control plane
says it is due by its clock); a failed ``renew_now`` is retried after the
backoff even while the certificate is far from due, since a CA rollover waits
on it. A refusal that is final (:class:`~machine.link.states.LinkStopped`)
ends the stream.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import grpc.aio
from prometheus_client import Counter

from machine.link import identity
from machine.link.client import LinkDialer, LinkSession, Renewed
from machine.link.states import LinkStopped, map_error
from shared import tls
from shared.errors import AgentsError, IntegrityError, InvalidArgument, InvalidState
from shared.timestamps import Clock
from shared.wakeups import wait_set

__all__ = ["NOT_DUE_BACKOFF", "RENEWAL_BACKOFF_CAP", "CertificateRenewal", "renewal_backoff"]

logger = logging.getLogger(__name__)

#: The longest wait between two failed renewal attempts (seconds): a control
#: plane that keeps refusing is asked about once an hour.
RENEWAL_BACKOFF_CAP: Final = 3600.0
#: The first wait after a "not due yet" (seconds). The control plane judges by
#: its clock, which moves a second a second: asking again within seconds cannot
#: change its answer, and it sends ``renew_now`` itself once it is due.
NOT_DUE_BACKOFF: Final = 60.0


def renewal_backoff(failures: int, *, not_due: bool, initial: float, cap: float) -> float:
    """Seconds to wait after the ``failures``-th failed renewal in a row (from 1).

    Doubles from ``initial`` (from :data:`NOT_DUE_BACKOFF` after a "not due"
    answer) and stops growing at ``cap``.
    """
    first = max(initial, NOT_DUE_BACKOFF) if not_due else initial
    # The exponent is bounded so a machine refused for months cannot overflow.
    return float(min(cap, first * 2 ** min(failures - 1, 64)))


def _not_due(err: BaseException) -> bool:
    # controlplane.machines.pairing refuses an early renewal with InvalidState.
    return isinstance(err, InvalidState) and "not due" in str(err)


class CertificateRenewal:
    """Renews the client certificate while a stream is up (see the module docstring).

    ``renewals`` counts renewals by outcome (``ok``, ``error``); ``on_renewed``
    is told each link record a renewal saved.
    """

    def __init__(
        self,
        *,
        data_dir: Path,
        renew_fraction: float,
        backoff_initial: float,
        timeout: float,
        clock: Clock,
        renewals: Counter,
        on_renewed: Callable[[identity.LinkRecord], None],
        backoff_cap: float = RENEWAL_BACKOFF_CAP,
        describe_skew: Callable[[], str] = lambda: "",
        dial: LinkDialer | None = None,
    ) -> None:
        self._data_dir = data_dir
        # Opens a channel presenting the certificate on disk, for a renewal after
        # one already made on this stream (see _renew).
        self._dial = dial
        self._renew_fraction = renew_fraction
        self._backoff_initial = backoff_initial
        self._timeout = timeout
        self._clock = clock
        self._renewals = renewals
        self._on_renewed = on_renewed
        self._backoff_cap = backoff_cap
        # What the link knows of this machine's clock against the control
        # plane's, for the log line of a "not due" refusal ("" when it agrees).
        self._describe_skew = describe_skew
        self._renew_now = asyncio.Event()
        # Failed attempts in a row and when (time.monotonic) the next may start:
        # kept across streams, so a reconnect does not reset the backoff.
        self._failures = 0
        self._retry_at = 0.0

    def request(self) -> None:
        """Renew at once (the control plane said ``renew_now``)."""
        self._renew_now.set()

    def renew_in(self, keys: identity.MachineKeys, link: identity.LinkRecord | None) -> float:
        """Seconds until renewal is due (<= 0: due now)."""
        cert = tls.load_cert(keys.tls_cert_pem)
        start = cert.not_valid_before_utc
        if link is not None and link.cert_received_at > start:
            # Certificates are back-dated for clock skew; the lifetime that
            # counts is the one we actually hold the certificate for.
            start = link.cert_received_at
        end = cert.not_valid_after_utc
        renew_at = end - (end - start) * self._renew_fraction
        return (renew_at - self._clock()).total_seconds()

    async def run(
        self,
        client: LinkSession,
        keys: identity.MachineKeys,
        link: identity.LinkRecord | None,
    ) -> None:
        """Renew whenever due or asked, for as long as the stream lasts (cancel to stop).

        ``keys`` and ``link`` are what the connection was opened with.
        """
        asked = False  # a RenewNow not honoured yet: retried after a backoff, not when due
        presented = keys.tls_cert_pem  # what this stream's channel shows the control plane
        while True:
            delay = self.renew_in(keys, link)
            if self._failures:
                backoff = max(0.0, self._retry_at - time.monotonic())
                delay = backoff if asked else max(delay, backoff)
            if delay > 0:
                await wait_set(self._renew_now, delay)
            asked = asked or self._renew_now.is_set()
            self._renew_now.clear()
            try:
                link, keys = await self._renew(client, keys, link, presented)
                self._failures = 0
                asked = False
            except grpc.aio.AioRpcError as e:
                err = map_error(e)
                if isinstance(err, LinkStopped):
                    raise err from None
                self._failed(err)
            except AgentsError as e:
                self._failed(e)

    async def _ask(
        self,
        client: LinkSession,
        keys: identity.MachineKeys,
        link: identity.LinkRecord | None,
        presented: bytes,
        csr: str,
    ) -> Renewed:
        """Send the CSR over a channel presenting our current certificate.

        The control plane lets only the current certificate renew (the one
        before it still connects). A stream outlives the renewals made on it,
        and its channel keeps presenting the certificate it opened with: a
        second renewal on it (the next one due, or a CA rollover's renew-now)
        goes over a channel of its own, or it would be refused until the
        stream ended.
        """
        if keys.tls_cert_pem == presented or self._dial is None or link is None:
            return await client.renew(csr, timeout=self._timeout)
        current = await asyncio.to_thread(identity.load_keys, self._data_dir)
        channel = self._dial(
            link.control_address,
            ca_pem=current.ca_cert_pem,
            key_pem=current.tls_key_pem,
            cert_pem=current.tls_cert_pem,
        )
        try:
            return await channel.renew(csr, timeout=self._timeout)
        finally:
            await channel.aclose()

    def _failed(self, err: Exception) -> None:
        self._failures += 1
        self._renewals.labels("error").inc()
        not_due = _not_due(err)
        wait = renewal_backoff(
            self._failures, not_due=not_due, initial=self._backoff_initial, cap=self._backoff_cap
        )
        self._retry_at = time.monotonic() + wait
        skew = self._describe_skew() if not_due else ""
        logger.warning(
            "certificate renewal failed (%d in a row), next try in %.0fs: %s%s",
            self._failures,
            wait,
            err,
            f" ({skew})" if skew else "",
        )

    async def _renew(
        self,
        client: LinkSession,
        keys: identity.MachineKeys,
        link: identity.LinkRecord | None,
        presented: bytes,
    ) -> tuple[identity.LinkRecord, identity.MachineKeys]:
        key = tls.load_private_key(keys.tls_key_pem)
        csr = tls.build_csr(key).decode("ascii")
        reply = await self._ask(client, keys, link, presented, csr)
        cert_pem = reply.certificate_pem.encode("ascii", "replace")
        ca_pem = (
            reply.ca_certificate_pem.encode("ascii", "replace")
            if reply.ca_certificate_pem
            else keys.ca_cert_pem
        )
        if link is None:
            raise IntegrityError("renewal", "no link record to renew the certificate of")
        try:
            tls.check_client_cert(
                cert_pem,
                ca_pem,
                public_key=key.public_key(),
                account_id=link.account_id,
                machine_id=link.machine_id,
            )
        except InvalidArgument as e:
            raise IntegrityError("renewal", f"bad certificate in the reply: {e}") from None
        renewed = await asyncio.to_thread(
            functools.partial(
                identity.save_certificate,
                self._data_dir,
                cert_pem,
                ca_pem,
                link,
                received_at=self._clock(),
            )
        )
        self._on_renewed(renewed)
        self._renewals.labels("ok").inc()
        logger.info("client certificate renewed; valid until %s", renewed.cert_not_after)
        new_keys = identity.MachineKeys(
            signing_key=keys.signing_key,
            box=keys.box,
            tls_key_pem=keys.tls_key_pem,
            tls_cert_pem=cert_pem,
            ca_cert_pem=ca_pem,
        )
        return renewed, new_keys
