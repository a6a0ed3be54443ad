"""The README's start command works: control plane, joined machine, echo prompt."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_demo_starts_the_system_and_shows_it_working(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--once", "--workdir", str(work)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    out = proc.stdout
    assert "online" in out  # the machine list shows the joined machine online
    # ...on one line with its whole id (a table in a pipe once folded it over three).
    assert re.search(r"^mc_[0-9a-z]{26}  demo  acct_[0-9a-z]{26}  online ", out, re.M), out
    assert "echo: hello from the demo" in out  # the prompt went through the echo runtime
    assert out.rstrip().endswith("demo: OK")
    # Both daemons were stopped: nothing is left serving from the work folder.
    assert not (work / "control" / "serve.json").exists()
    assert not (work / "machine" / "machine.sock").exists()


def _pids_of(argv_part: str) -> list[int]:
    """Processes whose command line names ``argv_part`` (read from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # gone meanwhile
            if argv_part.encode() in argv:
                pids.append(int(entry.name))
    return pids


def test_demo_says_which_daemon_died_and_stops_the_other(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    with subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--workdir", str(work)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # bounded: the demo ends or prints "Running."
                if line.startswith("Running."):
                    break
            else:
                raise AssertionError(f"the demo ended first: {proc.wait(10)}")
            machines = _pids_of(str(work / "machine"))
            assert len(machines) == 1, machines
            os.kill(machines[0], signal.SIGKILL)
            assert proc.wait(timeout=60) == 1
            assert proc.stderr is not None
            err = proc.stderr.read()
        finally:
            if proc.poll() is None:  # Ctrl-C: the demo stops both daemons
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=60)
    assert "the machine exited (code -9)" in err and str(work / "machine.log") in err, err
    assert "control plane exited" not in err
    assert not (work / "control" / "serve.json").exists()  # the other was stopped
