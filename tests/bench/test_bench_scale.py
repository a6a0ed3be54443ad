"""The growth-curve bench runs in quick mode and writes its curves; its figures
are not asserted here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.results import load

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


# Quick mode takes about a minute on 2 busy cores (it fills 8 data folders and
# starts a daemon on each); the suite's 120 s default leaves no margin.
@pytest.mark.timeout(300)
def test_scale_quick_machine_curves(tmp_path: Path) -> None:
    out_json = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.scale", "--quick", "--part", "machine"]
        + ["--json", str(out_json)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "machine-agents: agents" in out, out
    assert "machine-events: events of one agent" in out, out
    for head in ("daemon start s", "agent list p50 (RPC) ms", "search p50 ms", "machine.db MB"):
        assert head in out, out
    assert "machine-agents: 10 -> 300 agents (30x): daemon start" in out, out

    result = load(out_json)
    assert result.bench == "scale"
    assert "--quick" in result.command
    curves = {c.name: c for c in result.curves}
    assert set(curves) == {"machine-agents", "machine-events"}
    for curve in curves.values():
        assert len(curve.x) >= 4
        assert curve.x == sorted(curve.x) and curve.x[0] > 0
        assert set(curve.units) == set(curve.series)
        for name, ys in curve.series.items():
            assert len(ys) == len(curve.x), name
            assert all(y > 0 for y in ys), (name, ys)
    assert any(n.startswith("machine-events: ") for n in result.notes), result.notes
