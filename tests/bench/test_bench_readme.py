"""Each benchmark runs the way the README says to run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "name",
    [
        "appends",
        "connect",
        "delete",
        "prompts",
        "soak",
        "idle",
        "roundtrip",
        "report",
        "scale",
        "scale_control",
        "start",
    ],
)
def test_readme_command_runs_each_bench(name: str) -> None:
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"`\.venv/bin/python ([^`]*<name>[^`]*)`", readme)
    assert found, "the README names no command for the benchmarks"
    argv = found.group(1).replace("<name>", name).split()
    # As a person would type it: no PYTHONPATH to hide a missing import path.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, *argv, "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
