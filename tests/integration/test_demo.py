"""The README's start command works: control plane, joined machine, echo prompt."""

from __future__ import annotations

import re
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
