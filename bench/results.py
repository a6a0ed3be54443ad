"""What a benchmark hands to ``bench/report.py``: its figures as one JSON file.

Every bench prints its table for a person; given ``--json PATH`` it also
writes the same figures here, so the report never parses printed text.

A file holds one :class:`BenchResult`:

- ``rows``: one per figure that has a baseline measured in the same run
  (ours, the baseline, their unit and the ratio ours/baseline, with which
  side of 1.0 is better);
- ``curves``: growth curves (``bench/scale.py``): an x axis (the work) and
  one or more series measured at each x.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BenchResult", "Curve", "Row", "load", "machine_description"]


@dataclass
class Row:
    """One figure against its baseline."""

    figure: str
    ours: float
    baseline: float
    unit: str
    baseline_name: str
    #: "lower" when a smaller value is better (seconds, bytes), "higher" for rates.
    better: str = "lower"
    target: str = ""

    @property
    def ratio(self) -> float:
        return self.ours / self.baseline if self.baseline else float("inf")


@dataclass
class Curve:
    """How one cost grows with one kind of work: ``series[name][i]`` at ``x[i]``."""

    name: str
    x_label: str
    x: list[float]
    series: dict[str, list[float]]
    units: dict[str, str] = field(default_factory=dict)
    note: str = ""


@dataclass
class BenchResult:
    bench: str
    command: str
    rows: list[Row] = field(default_factory=list)
    curves: list[Curve] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    when: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))

    def write(self, path: Path | None) -> None:
        """Write the JSON file (nothing when ``path`` is None); atomically, so a
        report never reads half a result."""
        if path is None:
            return
        data: dict[str, Any] = asdict(self)
        for row, raw in zip(self.rows, data["rows"], strict=True):
            raw["ratio"] = row.ratio
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)


def load(path: Path) -> BenchResult:
    """A result written by :meth:`BenchResult.write`."""
    data = json.loads(path.read_text())
    rows = [Row(**{k: v for k, v in r.items() if k != "ratio"}) for r in data.get("rows", [])]
    curves = [Curve(**c) for c in data.get("curves", [])]
    return BenchResult(
        bench=data["bench"],
        command=data["command"],
        rows=rows,
        curves=curves,
        notes=list(data.get("notes", [])),
        when=data.get("when", ""),
    )


def machine_description() -> str:
    """The machine a run was measured on, for the report's header."""
    cpus = os.cpu_count() or 0
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f", {int(line.split()[1]) / 1024 / 1024:.0f} GiB RAM"
                break
    except (OSError, ValueError):
        pass
    return f"{cpus} cores{f' ({model})' if model else ''}{mem}, {platform.system()} " + (
        f"{platform.release()}, Python {platform.python_version()}"
    )
