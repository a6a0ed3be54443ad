"""This machine's clock against the control plane's: measured, exported, explained.

Two things go wrong when the machine's clock is off, and both used to show
only as their symptoms:

- **Ahead** (days): the machine thinks its certificate is due for renewal and
  the control plane, judging by its own clock, says no
  (:mod:`machine.link.renewal` backs off). :class:`ClockSkew` measures the
  skew at each welcome (the control plane's ``server_time`` against the
  midpoint of our hello and its welcome, so the round trip's error is at most
  half of it), exports it as ``agents_machine_clock_skew_seconds`` (this
  machine's clock minus the control plane's) and logs one WARNING when it is
  beyond :data:`SKEW_WARN`, then again only when it moved by more than that,
  and one INFO once it is back within.
- **Behind** (or far ahead): the TLS handshake fails, since the control plane's
  certificate is not valid yet (or no longer) by this machine's clock, and gRPC
  says so only deep in its error text. :func:`handshake_clock_problem`
  recognises that text, and :func:`certificate_dates_problem` names the cause
  with the dates ("this machine's clock says X; the control plane's
  certificate is valid from Y"), reading the control plane's certificate with
  :func:`fetch_server_certificate` (a TLS handshake that verifies nothing: the
  certificate is only read for its dates, never trusted).
  :class:`ClockComplaint` logs that line once per distinct finding, not per
  attempt.
"""

from __future__ import annotations

import datetime as dt
import logging
import socket
import ssl
from collections.abc import Iterable
from typing import Final

from prometheus_client import Gauge

from shared import tls
from shared.config import split_hostport
from shared.errors import AgentsError

__all__ = [
    "SKEW_WARN",
    "ClockComplaint",
    "ClockSkew",
    "certificate_dates_problem",
    "describe_seconds",
    "fetch_server_certificate",
    "handshake_clock_problem",
]

logger = logging.getLogger(__name__)

#: Seconds of skew beyond which the machine warns (and deploy/prometheus alerts):
#: well inside the 5 minutes certificates are back-dated by (shared.tls), well
#: outside what NTP leaves (milliseconds) and a welcome's round trip adds.
SKEW_WARN: Final = 60.0

#: The words BoringSSL/OpenSSL use when a certificate's dates fail verification.
_DATE_FAILURES: Final = ("certificate is not yet valid", "certificate has expired")


def describe_seconds(seconds: float) -> str:
    """A duration for a person: ``2 days, 0:00:03`` (whole seconds, no sign)."""
    return str(dt.timedelta(seconds=round(abs(seconds))))


def _utc(value: dt.datetime) -> str:
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class ClockSkew:
    """The last measured skew of this machine's clock (see the module docstring)."""

    def __init__(self, gauge: Gauge, *, warn_at: float = SKEW_WARN) -> None:
        self._gauge = gauge
        self._warn_at = warn_at
        self.seconds: float | None = None
        """This machine's clock minus the control plane's; None until measured."""
        self._warned: float | None = None
        """The skew the last WARNING named; None while none stands."""

    def observe(self, server_time: dt.datetime, sent: dt.datetime, received: dt.datetime) -> float:
        """Measure from a welcome: our clock at the hello (``sent``) and at the
        welcome (``received``), the control plane's as it answered."""
        ours = sent + (received - sent) / 2
        skew = (ours - server_time).total_seconds()
        self.seconds = skew
        self._gauge.set(skew)
        if abs(skew) > self._warn_at:
            if self._warned is None or abs(skew - self._warned) > self._warn_at:
                self._warned = skew
                logger.warning(
                    "this machine's clock looks off: it is %s %s the control plane's"
                    " (this machine says %s, the control plane %s); certificate renewals,"
                    " TLS and schedules follow this clock: check it / NTP (timedatectl)",
                    describe_seconds(skew),
                    "ahead of" if skew > 0 else "behind",
                    _utc(ours),
                    _utc(server_time),
                )
        elif self._warned is not None:
            self._warned = None
            logger.info(
                "this machine's clock agrees with the control plane's again (off by %.1fs)", skew
            )
        return skew

    def describe(self) -> str:
        """One phrase on the skew when it is beyond the bound, else ``""``."""
        if self.seconds is None or abs(self.seconds) <= self._warn_at:
            return ""
        return (
            f"this machine's clock is {describe_seconds(self.seconds)}"
            f" {'ahead of' if self.seconds > 0 else 'behind'} the control plane's"
        )


def handshake_clock_problem(error: BaseException) -> bool:
    """Whether a failed call's error reads as a TLS date check that failed."""
    text = str(error)
    return any(words in text for words in _DATE_FAILURES)


def certificate_dates_problem(
    now: dt.datetime, certificates: Iterable[tuple[str, bytes]]
) -> str | None:
    """The first of ``(what, pem)`` not valid at ``now``, as one sentence for the log
    (which clock, which certificate, valid from or until when); None when all are."""
    for what, pem in certificates:
        try:
            cert = tls.load_cert(pem)
        except AgentsError:
            continue
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
        if now < start:
            return (
                f"this machine's clock says {_utc(now)}; {what} is valid from {_utc(start)}:"
                " this machine's clock is probably behind: check it / NTP (timedatectl)"
            )
        if now > end:
            return (
                f"this machine's clock says {_utc(now)}; {what} expired at {_utc(end)}:"
                " if that is not so, this machine's clock is ahead: check it / NTP (timedatectl)"
            )
    return None


def fetch_server_certificate(address: str, timeout: float) -> bytes | None:
    """The PEM certificate the TLS server at ``host:port`` presents, or None.

    Blocking (run it in a thread). Verifies nothing on purpose: it runs after a
    handshake failed its date check, to read the dates of the certificate that
    failed; nothing read here is trusted or used to connect.
    """
    try:
        host, port = split_hostport(address, "control_address")
    except AgentsError:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            context.wrap_socket(raw, server_hostname=host) as conn,
        ):
            der = conn.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError):
        return None
    return ssl.DER_cert_to_PEM_cert(der).encode("ascii") if der else None


class ClockComplaint:
    """Logs a clock finding once, and again only when it changes."""

    def __init__(self) -> None:
        self._last: str | None = None

    def say(self, finding: str | None, context: str) -> None:
        """Log ``finding`` (as ``context: finding``) unless it was the last one said."""
        if finding is None:
            self._last = None
            return
        # Compare without the clock reading, which moves at every attempt.
        key = finding.split(";", 1)[-1]
        if key != self._last:
            self._last = key
            logger.error("%s: %s", context, finding)
