"""The link and a machine clock that is off: renewal backoff, the measured skew,
the one log line, and a TLS handshake that fails its date check."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge

from machine.link import identity
from machine.link.clock import (
    ClockComplaint,
    ClockSkew,
    certificate_dates_problem,
    fetch_server_certificate,
    handshake_clock_problem,
)
from machine.link.connection import ControlLink, LinkState
from machine.link.join import join_control_plane
from machine.link.renewal import NOT_DUE_BACKOFF, RENEWAL_BACKOFF_CAP, renewal_backoff
from shared import tls
from shared.errors import InvalidState
from tests.helpers.clock import FixedClock
from tests.helpers.fake_link_client import FakeControlPlane, serve_pin_check
from tests.helpers.poll import apoll_until

#: What gRPC (BoringSSL) says when the server's certificate starts after our clock.
NOT_YET_VALID = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:7444: Tls"
    " handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL"
    " routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: certificate is not yet valid"
)


@pytest.fixture(scope="module")
def ca() -> tls.CertKey:
    return tls.make_ca()


@pytest.fixture
async def control(ca: tls.CertKey) -> AsyncIterator[FakeControlPlane]:
    fake = FakeControlPlane(ca)
    async with serve_pin_check(ca) as address:
        fake.public_address = address
        yield fake


async def _until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    fail = AssertionError("condition not met before the deadline")
    await apoll_until(pred, deadline=timeout, what="condition", fail=lambda: fail)


async def _joined(control: FakeControlPlane, data_dir: Path) -> None:
    await join_control_plane(
        data_dir=data_dir,
        address=control.public_address,
        token=control.new_token(),
        ca_hash=tls.ca_hash(control.ca.cert_pem),
        name="test-machine",
        dial=control.for_join,
    )


def _link(
    control: FakeControlPlane, data_dir: Path, registry: CollectorRegistry, **kw: Any
) -> ControlLink:
    async def count() -> int:
        return 0

    args: dict[str, Any] = {
        "backoff_initial": 0.05,
        "backoff_max": 0.2,
        "stable_after": 0.5,
        "dial": control.mutual,
    }
    args.update(kw)
    return ControlLink(
        data_dir=data_dir, agent_count=count, version="9.9.9", registry=registry, **args
    )


def _value(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float:
    value = registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


# ------------------------------------------------------------------ renewal backoff


def test_renewal_backoff_doubles_to_an_hour_and_a_not_due_starts_at_a_minute() -> None:
    errors = [renewal_backoff(n, not_due=False, initial=0.5, cap=3600) for n in range(1, 16)]
    assert errors[:4] == [0.5, 1.0, 2.0, 4.0]
    assert errors[-1] == 3600 and max(errors) == 3600
    assert all(a <= b for a, b in zip(errors, errors[1:], strict=False))
    not_due = [renewal_backoff(n, not_due=True, initial=0.5, cap=3600) for n in range(1, 9)]
    assert not_due[:3] == [NOT_DUE_BACKOFF, 2 * NOT_DUE_BACKOFF, 4 * NOT_DUE_BACKOFF]
    assert not_due[-1] == 3600
    # Months of refusals neither overflow nor pass the cap.
    assert renewal_backoff(10_000, not_due=True, initial=0.5, cap=RENEWAL_BACKOFF_CAP) == 3600


async def test_a_clock_ahead_asks_for_renewal_once_not_every_backoff(
    control: FakeControlPlane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The machine's clock is 50 minutes ahead: by it, the one-hour certificate is
    # due (a third left); by the control plane's, it is not, and it says so.
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    clock = FixedClock(identity.load_link(data_dir).cert_received_at + dt.timedelta(minutes=50))
    control.refuse_renewals = InvalidState("renew", "certificate is not due for renewal yet")
    registry = CollectorRegistry()
    errors = {"outcome": "error"}
    with caplog.at_level(logging.INFO, logger="machine.link"):
        async with _link(control, data_dir, registry, clock=clock) as link:
            await link.wait_for_state(LinkState.CONNECTED, timeout=5)
            await _until(
                lambda: _value(registry, "agents_machine_link_renewals_total", errors) == 1
            )
            # 40 heartbeats (a second) is five of the reconnect backoff's cap: the
            # old loop asked again at each of them.
            await _until(lambda: control.streams[0].heartbeats >= 40)
            assert control.renew_calls == 1
            # A new stream does not start the backoff again.
            control.drop(control.streams[0])
            await _until(lambda: len(control.streams) == 2 and control.streams[1].heartbeats >= 20)
            assert control.renew_calls == 1
            assert _value(registry, "agents_machine_link_renewals_total", errors) == 1
            skew = _value(registry, "agents_machine_clock_skew_seconds")
            assert link.clock_skew == skew
    assert 49 * 60 < skew < 51 * 60  # the machine minus the control plane
    off = [r for r in caplog.records if "clock looks off" in r.getMessage()]
    assert len(off) == 1, "one line for the skew, not one per connection"
    assert "0:50:" in off[0].getMessage() and "ahead of the control plane" in off[0].getMessage()
    refused = [r for r in caplog.records if "certificate renewal failed" in r.getMessage()]
    assert len(refused) == 1
    assert "next try in 60s" in refused[0].getMessage()
    assert "clock is 0:50" in refused[0].getMessage()


async def test_a_clock_in_step_exports_its_skew_and_logs_nothing(
    control: FakeControlPlane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    registry = CollectorRegistry()
    with caplog.at_level(logging.INFO, logger="machine.link"):
        async with _link(control, data_dir, registry) as link:
            await link.wait_for_state(LinkState.CONNECTED, timeout=5)
            assert link.clock_skew is not None and abs(link.clock_skew) < 5
    assert "clock" not in caplog.text


# ------------------------------------------------------------------ the skew line


def test_skew_is_logged_once_again_when_it_moves_and_when_it_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    gauge = Gauge("skew", "test", registry=registry)
    skew = ClockSkew(gauge)
    server = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    ahead = server + dt.timedelta(days=25)

    def observe(ours: dt.datetime) -> float:
        # A 200 ms round trip: the midpoint counts.
        return skew.observe(
            server, ours - dt.timedelta(seconds=0.1), ours + dt.timedelta(seconds=0.1)
        )

    with caplog.at_level(logging.INFO, logger="machine.link.clock"):
        assert observe(ahead) == pytest.approx(25 * 86400)
        assert registry.get_sample_value("skew") == pytest.approx(25 * 86400)
        observe(ahead + dt.timedelta(seconds=30))  # about the same: no new line
        assert len(caplog.records) == 1
        assert "25 days, 0:00:00 ahead of the control plane's" in caplog.records[0].getMessage()
        assert skew.describe().startswith("this machine's clock is 25 days")
        observe(server - dt.timedelta(days=2))  # moved: said again
        assert len(caplog.records) == 2
        assert "2 days, 0:00:00 behind the control plane's" in caplog.records[1].getMessage()
        observe(server + dt.timedelta(seconds=2))  # back in step
        assert len(caplog.records) == 3 and "agrees" in caplog.records[2].getMessage()
        assert skew.describe() == ""
        observe(server)
        assert len(caplog.records) == 3
    assert registry.get_sample_value("skew") == 0


# ------------------------------------------------------------------ TLS dates


def test_the_grpc_words_of_a_failed_date_check_are_recognised() -> None:
    assert handshake_clock_problem(Exception(NOT_YET_VALID))
    assert handshake_clock_problem(
        Exception(NOT_YET_VALID.replace("is not yet valid", "has expired"))
    )
    assert not handshake_clock_problem(Exception("failed to connect: connection refused"))


def test_certificate_dates_problem_names_the_clock_and_the_dates(ca: tls.CertKey) -> None:
    start = tls.load_cert(ca.cert_pem).not_valid_before_utc
    behind = start - dt.timedelta(days=2)
    said = certificate_dates_problem(behind, [("the control plane's certificate", ca.cert_pem)])
    assert said is not None
    assert behind.strftime("%Y-%m-%d %H:%M:%S UTC") in said
    assert f"is valid from {start.strftime('%Y-%m-%d %H:%M:%S UTC')}" in said
    assert "clock is probably behind" in said
    end = tls.load_cert(ca.cert_pem).not_valid_after_utc
    late = certificate_dates_problem(end + dt.timedelta(days=1), [("the CA", ca.cert_pem)])
    assert late is not None and "the CA expired at" in late
    assert (
        certificate_dates_problem(start + dt.timedelta(days=1), [("the CA", ca.cert_pem)]) is None
    )


async def test_fetch_server_certificate_reads_what_the_server_presents(ca: tls.CertKey) -> None:
    async with serve_pin_check(ca) as address:
        pem = await asyncio.to_thread(fetch_server_certificate, address, 5.0)
    assert pem is not None
    tls.verify_issued_by(pem, ca.cert_pem)  # the server's leaf, signed by the CA
    assert await asyncio.to_thread(fetch_server_certificate, "127.0.0.1:1", 1.0) is None


def test_a_complaint_is_said_once_per_finding(caplog: pytest.LogCaptureFixture) -> None:
    complaint = ClockComplaint()
    with caplog.at_level(logging.ERROR, logger="machine.link.clock"):
        complaint.say("clock says 1; cert valid from 2", "link")
        complaint.say("clock says 3; cert valid from 2", "link")  # the clock moved only
        assert len(caplog.records) == 1
        complaint.say("clock says 3; cert valid from 9", "link")
        assert len(caplog.records) == 2
        complaint.say(None, "")  # connected in between: the next one is news
        complaint.say("clock says 3; cert valid from 9", "link")
        assert len(caplog.records) == 3


async def test_a_clock_behind_is_named_once_while_the_link_keeps_trying(
    control: FakeControlPlane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The link listener is the TLS listener above: the diagnosis reads its certificate.
    control.link_address = control.public_address
    data_dir = tmp_path / "data"
    await _joined(control, data_dir)
    control.handshake_failure = "certificate is not yet valid"
    behind = FixedClock(dt.datetime.now(dt.UTC) - dt.timedelta(days=2))
    registry = CollectorRegistry()
    with caplog.at_level(logging.WARNING, logger="machine.link"):
        async with _link(control, data_dir, registry, clock=behind) as link:
            await _until(lambda: _value(registry, "agents_machine_link_reconnects_total") >= 4)
            assert link.state is not LinkState.STOPPED
            control.handshake_failure = ""  # the clock was fixed: it connects
            await link.wait_for_state(LinkState.CONNECTED, timeout=5)
    lines = [r.getMessage() for r in caplog.records if "TLS handshake failed" in r.getMessage()]
    assert len(lines) == 1, lines
    assert behind.now.strftime("this machine's clock says %Y-%m-%d %H:%M") in lines[0]
    assert "the control plane's certificate is valid from" in lines[0]
    assert "check it / NTP" in lines[0]
