"""A machine daemon whose clock is off, for real: libfaketime under agents-machine.

A real control plane (folder store) and a machine that joined it with its clock
right; the daemon is then started again with libfaketime preloaded
(``FAKETIME``: an offset of its wall clock only, ``FAKETIME_DONT_FAKE_MONOTONIC``
keeps the monotonic clock, as on a machine whose clock was set wrong). The
control plane and the test keep the real time.

- **25 days ahead**: by its own clock the machine's 30-day certificate is due
  for renewal (a third left), by the control plane's it is not. The machine must
  connect, measure the skew (the gauge), say so in one log line, and ask for
  renewal once, not every reconnect backoff (2 s) as it did.
- **2 days behind**: the control plane's certificate is not valid yet by the
  machine's clock, so every TLS handshake fails; the daemon must say that in one
  clear line naming both dates and keep trying.

libfaketime comes from the Debian package ``faketime`` (scripts/test installs it);
these tests fail, never skip, without it.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.control_proc import ControlProc, control_plane
from tests.helpers.faketime import faketime_env
from tests.helpers.machine_proc import MachineProc, machine_env
from tests.helpers.moto_server import free_port
from tests.helpers.poll import poll_until

pytestmark = pytest.mark.integration

MACHINE_EXE = Path(sys.executable).parent / "agents-machine"
PROCESS_DEADLINE = 40.0
#: The control plane's heartbeat interval (seconds): heartbeats are the test's
#: measure of time passing on the link.
HEARTBEAT = 0.5
DAY = 86400.0


def _samples(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=15) as reply:
            page = reply.read().decode()
    except (TimeoutError, urllib.error.URLError):
        # A loaded machine: no answer yet is no sample yet (the polls have deadlines).
        return {}
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[ControlProc]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    with control_plane(
        tmp_path / "cp-home",
        str(tmp_path / "store"),
        env=env,
        init_args=["--heartbeat-interval", str(HEARTBEAT)],
    ) as running:
        yield running


def _join(cp: ControlProc, data_dir: Path, log: Path) -> None:
    """Join with the printed command (the clock right) until the link is up, then stop."""
    res = cp.cli("account", "create", "--github-id", "77", "--github-login", "clocks")
    assert res.code == 0, res.err
    account = re.search(r"account (acct_[0-9a-z]{26})", res.out)
    assert account, res.out
    res = cp.cli("token", "create", "--account", account.group(1))
    assert res.code == 0, res.err
    argv = shlex.split(res.out.strip().splitlines()[-1])
    assert argv[:2] == ["agents-machine", "join"], res.out
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [str(MACHINE_EXE), *argv[1:], "--data-dir", str(data_dir)],
            env=machine_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def failed() -> AssertionError:
        return AssertionError(f"join failed:\n{log.read_text(errors='replace')}")

    def link_up() -> bool:
        if proc.poll() is not None:
            raise failed()
        return "control link up" in log.read_text(errors="replace")

    try:
        poll_until(link_up, deadline=PROCESS_DEADLINE, what="control link up", fail=failed)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=PROCESS_DEADLINE) == 0, log.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=PROCESS_DEADLINE)


def test_a_machine_25_days_ahead_connects_says_so_and_asks_for_renewal_once(
    cp: ControlProc, tmp_path: Path
) -> None:
    data_dir = tmp_path / "machine"
    _join(cp, data_dir, tmp_path / "join.log")
    metrics = f"127.0.0.1:{free_port()}"
    machine = MachineProc(data_dir, "--metrics", metrics, env=faketime_env("+25d"))
    with machine:

        def value(name: str, **labels: str) -> float:
            return _samples(metrics).get((name, tuple(sorted(labels.items()))), 0.0)

        def fail() -> AssertionError:
            return AssertionError(machine.log())

        # Connected, and the skew measured against the control plane's time.
        poll_until(
            lambda: value("agents_machine_clock_skew_seconds") > 24 * DAY,
            deadline=PROCESS_DEADLINE,
            what="the skew gauge",
            fail=fail,
        )
        assert value("agents_machine_link_connected") == 1
        skew = value("agents_machine_clock_skew_seconds")
        assert 25 * DAY - 60 < skew < 25 * DAY + 60
        # Renewal is due by the machine's clock at once; the control plane says no.
        poll_until(
            lambda: value("agents_machine_link_renewals_total", outcome="error") >= 1,
            deadline=PROCESS_DEADLINE,
            what="the first renewal attempt",
            fail=fail,
        )
        # Time passes on the link (16 heartbeats: 8 s, four reconnect-backoff caps):
        # the old loop asked again every 2 s; now the next try is a minute away.
        start = value("agents_machine_link_heartbeats_total")
        poll_until(
            lambda: value("agents_machine_link_heartbeats_total") >= start + 16,
            deadline=PROCESS_DEADLINE,
            what="16 heartbeats",
            fail=fail,
        )
        assert value("agents_machine_link_renewals_total", outcome="error") == 1
        assert value("agents_machine_link_renewals_total", outcome="ok") == 0
        assert value("agents_machine_link_connected") == 1
        log = machine.log()
    off = [line for line in log.splitlines() if "clock looks off" in line]
    assert len(off) == 1, log
    assert "25 days, " in off[0] and "ahead of the control plane's" in off[0]
    assert "not due for renewal" in log and "next try in 60s" in log


def test_a_machine_2_days_behind_says_its_clock_is_the_cause(
    cp: ControlProc, tmp_path: Path
) -> None:
    data_dir = tmp_path / "machine"
    _join(cp, data_dir, tmp_path / "join.log")
    # At debug: an outage's repeated attempts are DEBUG lines (the first a WARNING).
    machine = MachineProc(data_dir, "--log-level", "debug", env=faketime_env("-2d"))
    with machine:

        def fail() -> AssertionError:
            return AssertionError(machine.log())

        def said() -> list[str]:
            return [s for s in machine.log().splitlines() if "TLS handshake failed" in s]

        poll_until(said, deadline=PROCESS_DEADLINE, what="the clock line", fail=fail)
        # It keeps trying: wait for more attempts, and the line is still said once.
        poll_until(
            lambda: "failed (attempt 5)" in machine.log(),
            deadline=PROCESS_DEADLINE,
            what="five attempts",
            fail=fail,
        )
        assert machine.proc is not None and machine.proc.poll() is None
        lines = said()
    assert len(lines) == 1, machine.log()
    line = lines[0]
    assert re.search(r"this machine's clock says \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", line), line
    assert "the control plane's certificate is valid from" in line, line
    assert "check it / NTP" in line, line
