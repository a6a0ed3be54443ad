"""The benchmarks still run (tiny sizes); their figures are not asserted here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.results import load

ROOT = Path(__file__).resolve().parents[2]

# A bench's smoke run takes seconds to a minute on a quiet machine and several
# times that on a loaded one (the suite must pass under stress-ng --cpu 2).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _run(*argv: str) -> str:
    proc = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_appends_bench_prints_ratios() -> None:
    out = _run("-m", "bench.appends", "--events", "64", "--appenders", "4")
    assert re.search(r"raw write\+fsync per event\s*:\s*\d+ events/s", out), out
    assert len(re.findall(r"ratio store/raw \d+\.\d+x", out)) == 2, out


def test_connect_bench_prints_figures() -> None:
    out = _run("-m", "bench.connect", "--streams", "5", "--window", "1", "--joins", "1")
    assert "process start -> online" in out, out
    assert re.search(r"KiB per stream", out), out
    assert re.search(r"us per heartbeat", out), out


def test_connect_bench_writes_its_figures_and_counts_no_timeouts(tmp_path: Path) -> None:
    out = _run(
        "-m", "bench.connect", "--streams", "5", "--window", "1", "--joins", "1",
        "--json", str(tmp_path / "connect.json"),
    )  # fmt: skip
    assert re.search(r"connect retries \d+: timeouts 0 ", out), out
    result = load(tmp_path / "connect.json")
    assert [r.unit for r in result.rows] == ["KiB", "us"]
    assert all(r.baseline_name.startswith("bare gRPC") for r in result.rows)
    assert any("joins/s" in note for note in result.notes)


def test_scale_control_draws_a_quick_curve(tmp_path: Path) -> None:
    out = _run(
        "-m", "bench.scale_control", "--quick", "--points", "3,6",
        "--json", str(tmp_path / "scale.json"),
    )  # fmt: skip
    assert "control plane, growth with machines (quick):" in out, out
    (curve,) = load(tmp_path / "scale.json").curves
    assert curve.name == "control-machines" and curve.x == [3.0, 6.0], curve
    assert (
        set(curve.series)
        == set(curve.units)
        == {
            "rss",
            "cpu_per_heartbeat",
            "join_rate",
            "machine_list",
            "store_requests_per_hour",
        }
    )
    assert all(len(values) == 2 for values in curve.series.values()), curve
    assert all(v > 0 for v in curve.series["join_rate"] + curve.series["rss"]), curve


def test_start_bench_draws_both_curves(tmp_path: Path) -> None:
    out = _run(
        "-m", "bench.start", "--quick", "--mb", "1", "--machines", "2",
        "--json", str(tmp_path / "start.json"),
    )  # fmt: skip
    assert "empty data folder (baseline)" in out and "machine open in" in out, out
    machine, control = load(tmp_path / "start.json").curves
    assert machine.name == "machine-start" and len(machine.x) == 1 and machine.x[0] > 0
    assert set(machine.series) == {
        f"start, {way}" for way in ("clean warm", "clean cold", "unclean warm", "unclean cold")
    }
    assert control.name == "control-start" and control.x == [2.0], control
    values = [v for s in (machine.series, control.series) for vs in s.values() for v in vs]
    assert all(v > 0 for v in values), (machine, control)


def test_delete_bench_prints_ratios() -> None:
    out = _run("-m", "bench.delete", "--objects", "300")
    assert re.search(r"account deletion, backups layout .*: \d+ objects/s", out), out
    assert re.search(r"ratio deletion/raw \d+\.\d+x", out), out
    assert re.search(r"account deletion, objects nothing names .*: \d+ objects/s", out), out
    assert re.search(r"ratio unindexed deletion/list\+delete \d+\.\d+x", out), out
    # The control plane's own account of each deletion's steps.
    assert re.search(r"deleted \(\d+ objects; index .* named segments .* s", out), out


def test_queue_bench_prints_ratios() -> None:
    out = _run("-m", "bench.prompts", "--prompts", "10")
    assert re.search(r"raw S3 PUT\s*:\s*\d+\.\d objects/s", out), out
    assert re.search(r"ratio enqueue/raw PUT \d+\.\d\dx", out), out
    assert re.search(r"ratio drain/raw GET \d+\.\d\dx", out), out


def test_backup_bench_prints_its_table() -> None:
    out = _run("-m", "bench.backup", "--agents", "5", "--mb", "1")
    assert re.search(r"full backup\s+\d+\.\d\d", out), out
    assert re.search(r"restore\s+\d+\.\d\d", out), out
    assert "tar|zstd -3" in out, out


def test_backup_bench_continuous_quick(tmp_path: Path) -> None:
    out = _run("-m", "bench.backup", "--quick", "--json", str(tmp_path / "continuous.json"))
    ratio = re.search(r"per prompt: .* ratio (\d+\.\d\d)x \(target <= 2x\)", out)
    assert ratio, out
    assert "idle interval: increment none, 0 store requests" in out, out
    result = load(tmp_path / "continuous.json")
    assert [r.baseline_name for r in result.rows] == [
        "the prompt's own events compressed and sealed",
        "daily full backup",
    ]


def test_soak_smoke_keeps_every_promise() -> None:
    """Six days of the soak (a CA rollover on day 3): the promises that a short run
    can show are checked by the soak itself, which exits 1 naming a broken one."""
    out = _run("-m", "bench.soak", "--days", "6")
    assert "soak: every promise held" in out, out
    assert re.search(r"prompts sent / ran exactly once : (\d+) / \1$", out, re.M), out
    assert re.search(r"backups made / verified\s+: (\d+) / \1$", out, re.M), out
    assert "CA rollover                     : started True" in out, out
    assert "fsck after the soak             : 0 finding(s)" in out, out


def test_roundtrip_bench_prints_its_ratio(tmp_path: Path) -> None:
    out = _run("-m", "bench.roundtrip", "--prompts", "5", "--json", str(tmp_path / "rt.json"))
    assert re.search(r"Status ping\s*: p50\s+\d+\.\d\d ms", out), out
    assert re.search(r"prompt to RUN_FINISHED\s*: p50\s+\d+\.\d\d ms", out), out
    assert re.search(r"\(\d+\.\d commits per prompt\)", out), out
    assert re.search(r"ratio prompt/ping p50 \d+\.\d\dx", out), out
    assert re.search(r"Replay of its \d+ events: p50\s+\d+\.\d\d ms", out), out
    where = re.search(
        r"of which its commits \(fsync included\) (\d+\.\d\d) ms; the daemon's CPU"
        r" (\d+\.\d\d) ms per prompt",
        out,
    )
    assert where is not None and float(where.group(1)) > 0 and float(where.group(2)) > 0, out
    assert '"bench": "roundtrip"' in (tmp_path / "rt.json").read_text()
