"""Renewal of the machine's client certificate while the Connect stream is up.

Once less than ``renew_fraction`` of the certificate's lifetime is left
(timed from when we received it), or when the control plane says
``renew_now`` (:meth:`CertificateRenewal.request`), the link sends a CSR for
the same TLS key to ``RenewCertificate`` and replaces ``keys/tls.crt``
atomically, and ``keys/ca.crt`` with the CA the reply names (a CA rollover)
or else the one already pinned. The reply is checked against our key and
identity before anything is written. The live stream keeps going; the next
connection uses the new certificate.

A failed renewal is tried again after the link's backoff (doubling up to its
cap); a failed ``renew_now`` is retried after that backoff even while the
certificate is far from due, since a CA rollover waits on it. A refusal that
is final (:class:`~machine.link.states.LinkStopped`) ends the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import grpc.aio
from prometheus_client import Counter

from machine.link import identity
from machine.link.client import LinkSession
from machine.link.states import LinkStopped, map_error
from shared import tls
from shared.errors import AgentsError, IntegrityError, InvalidArgument
from shared.timestamps import Clock

__all__ = ["CertificateRenewal"]

logger = logging.getLogger(__name__)


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
        backoff_max: float,
        timeout: float,
        clock: Clock,
        renewals: Counter,
        on_renewed: Callable[[identity.LinkRecord], None],
    ) -> None:
        self._data_dir = data_dir
        self._renew_fraction = renew_fraction
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._timeout = timeout
        self._clock = clock
        self._renewals = renewals
        self._on_renewed = on_renewed
        self._renew_now = asyncio.Event()

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
        failures = 0
        asked = False  # a RenewNow not honoured yet: retried after a backoff, not when due
        while True:
            delay = self.renew_in(keys, link)
            if failures:
                backoff = min(self._backoff_max, self._backoff_initial * 2**failures)
                delay = backoff if asked else max(delay, backoff)
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._renew_now.wait(), delay)
            asked = asked or self._renew_now.is_set()
            self._renew_now.clear()
            try:
                link, keys = await self._renew(client, keys, link)
                failures = 0
                asked = False
            except grpc.aio.AioRpcError as e:
                err = map_error(e)
                if isinstance(err, LinkStopped):
                    raise err from None
                failures += 1
                self._renewals.labels("error").inc()
                logger.warning("certificate renewal failed: %s", err)
            except AgentsError as e:
                failures += 1
                self._renewals.labels("error").inc()
                logger.warning("certificate renewal failed: %s", e)

    async def _renew(
        self,
        client: LinkSession,
        keys: identity.MachineKeys,
        link: identity.LinkRecord | None,
    ) -> tuple[identity.LinkRecord, identity.MachineKeys]:
        key = tls.load_private_key(keys.tls_key_pem)
        csr = tls.build_csr(key).decode("ascii")
        reply = await client.renew(csr, timeout=self._timeout)
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
