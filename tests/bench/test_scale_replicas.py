"""The replicas bench: its on-paper line is computed from the measured figures,
and a tiny run draws one curve per replica count."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.results import load
from bench.scale_replicas import Budget, ReplicaPoint, extrapolate
from tests.helpers.nats_proc import nats_binary

ROOT = Path(__file__).resolve().parents[2]


def _point(replicas: int, us: float, kib: float = 100.0, machines: int = 5000) -> ReplicaPoint:
    return ReplicaPoint(
        machines=machines,
        replicas=replicas,
        links=machines / replicas,
        rss_per_link_kib=kib,
        us_per_heartbeat=us,
        cpu_percent=1.0,
    )


def test_replicas_needed_follow_the_measured_costs() -> None:
    # 200 us + 50 us per other replica; 100,000 machines at 15 s: 6,667 heartbeats/s.
    # n=2: 3,333/s x 250 us = 0.83 core, but 50,000 x 100 KiB = 4.8 GiB > 4;
    # n=3: 2,222/s x 300 us = 0.67 core and 3.2 GiB: three.
    points = [_point(1, 200), _point(2, 250), _point(3, 300)]
    line = extrapolate(points, Budget(cores=1, gib=4), heartbeat=15)
    assert line.startswith("on paper: 3 replicas of 33,333 links, each 0.67 core and 3.2 GiB"), line
    assert "200 us per heartbeat served + 50 us per other replica" in line, line
    # Twice the memory per link: 100,000 x 200 KiB / 4 GiB = 4.8, five replicas.
    heavier = [_point(r, us, kib=200) for r, us in ((1, 200), (2, 250), (3, 300))]
    assert extrapolate(heavier, Budget(), heartbeat=15).startswith("on paper: 5 replicas")


def test_a_watch_past_the_budget_fits_no_replica_count() -> None:
    # 6,667 refreshes/s x 200 us each = 1.33 cores of watch per replica, whatever n.
    points = [_point(1, 100), _point(2, 300), _point(3, 500)]
    line = extrapolate(points, Budget(cores=1, gib=4), heartbeat=15)
    assert line.startswith(
        "on paper: no replica count fits: the per-other-replica term alone costs each"
    ), line
    assert "1.33 core" in line, line


def test_only_the_largest_point_counts() -> None:
    small = [_point(1, 5000, machines=10), _point(2, 9000, machines=10)]
    large = [_point(1, 200, machines=5000), _point(2, 250, machines=5000)]
    line = extrapolate(small + large, Budget(), heartbeat=15)
    assert "measured at 5,000 machines: 200 us" in line, line


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.skipif(nats_binary() is None, reason="nats-server not installed")
def test_replicas_bench_draws_a_curve_per_replica_count(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.scale_control", "--quick", "--replicas", "2"]
        + ["--points", "4", "--json", str(tmp_path / "r.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.search(r"^\s+2\s+4\s+2 ", proc.stdout, re.M), proc.stdout  # 2 links each
    assert "on paper: " in proc.stdout, proc.stdout
    (curve,) = load(tmp_path / "r.json").curves
    assert curve.name == "control-replicas-2" and curve.x == [4.0], curve
    assert curve.series["links_per_replica"] == [2.0], curve
    assert set(curve.series) == set(curve.units)


def test_a_one_point_curve_states_no_growth() -> None:
    from bench.results import Curve
    from bench.scale import growth

    curve = Curve("control-replicas-2", "machines (2 replicas)", [20.0], {"rss_per_link": [90.0]})
    assert growth(curve) == ["control-replicas-2: 1 point(s) of machines: no growth to state"]
