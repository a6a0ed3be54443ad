"""Every benchmark in one command: run each, write docs/benchmarks.md.

    .venv/bin/python -m bench.report [--quick] [--out docs/benchmarks.md] [--only NAME ...]

Each bench runs as its own process, one after the other (a bench measures the
machine, so two at once would measure each other), with ``--json`` naming a
temporary file for its figures (bench/results.py); the report never parses
what a bench prints. The page holds a header (date, machine, commit, the
command), then per bench a table of its figures against the baseline measured
in the same run, its notes, and for each growth curve a plot
(``<out without .md>/<curve>.png``) with the curve's numbers.

A bench whose module is not there, or that takes no ``--json`` yet, is listed
as not run. One that fails (an exit status, no figures, or no answer within
its deadline) is listed with the tail of its stderr; the page is still
written and the command exits 1. ``--quick`` runs every bench at tiny sizes:
it shows that the benches and the report work, not how fast anything is.

The page and each plot are written to a temporary file and renamed, so a
reader never sees half of one; plots in the folder that this run did not
draw are removed, so every PNG there is linked from the page.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.results import BenchResult, Curve, Row, load, machine_description

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Sizes:
    """A bench's arguments for the full report and for ``--quick``."""

    full: tuple[str, ...]
    quick: tuple[str, ...]


#: The benches in the order they run and appear. Full sizes are the figures the
#: docs quote; quick sizes are those of tests/bench/test_bench_smoke.py or
#: smaller, so that all of ``--quick`` takes a few minutes on a loaded 2-core box.
BENCHES: dict[str, Sizes] = {
    "appends": Sizes(
        ("--events", "8000", "--appenders", "64"), ("--events", "64", "--appenders", "4")
    ),
    "prompts": Sizes(("--prompts", "200", "--size", "1024"), ("--prompts", "10")),
    "delete": Sizes(("--objects", "10000", "--rounds", "2"), ("--objects", "300")),
    "backup": Sizes(("--agents", "1000", "--mb", "200"), ("--agents", "5", "--mb", "1")),
    "connect": Sizes(
        ("--streams", "1000", "--window", "10", "--joins", "3"),
        ("--streams", "5", "--window", "1", "--joins", "1"),
    ),
    # The quick run counts 5 s right after the joins: their writes are counted too.
    "idle": Sizes(
        ("--machines", "4", "--window", "60"),
        ("--machines", "2", "--window", "5", "--settle", "5"),
    ),
    "roundtrip": Sizes(("--prompts", "300"), ("--prompts", "10")),
    "scale": Sizes((), ("--quick",)),
    "start": Sizes((), ("--quick",)),
}

#: Seconds one bench may run before it is stopped and reported as failed: the
#: full backup of 200 MB and the idle fleet take minutes on a quiet machine.
DEADLINE = {"full": 3600.0, "quick": 300.0}
#: Seconds a stopped bench gets to end its own processes after SIGTERM.
STOP_GRACE = 10.0
#: Lines of a failed bench's stderr kept in the report.
TAIL_LINES = 25

OK, FAILED, NOT_RUN = "ok", "failed", "not run"


@dataclass
class Outcome:
    """What became of one bench in this run."""

    name: str
    #: The command a person would type to run the bench alone (no ``--json``).
    command: str
    status: str
    seconds: float = 0.0
    result: BenchResult | None = None
    #: Why it was not run, or how it failed (with its stderr's tail).
    detail: str = ""

    @property
    def summary(self) -> str:
        """One line: "ok", or the status and its reason."""
        if self.status == OK:
            return OK
        return f"{self.status}: {self.detail.splitlines()[0]}" if self.detail else self.status


@dataclass(frozen=True)
class Header:
    """What the page says of the run as a whole."""

    when: str
    machine: str
    commit: str
    dirty: bool
    command: str
    quick: bool


# -- running -------------------------------------------------------------------


def run_bench(name: str, args: Sequence[str], deadline: float, work: Path) -> Outcome:
    """Run ``bench.<name>`` with ``args`` and ``--json`` a file in ``work``."""
    command = shlex.join(["python", "-m", f"bench.{name}", *args])
    if not (ROOT / "bench" / f"{name}.py").is_file():
        return Outcome(name, command, NOT_RUN, detail=f"bench/{name}.py not present")
    figures, errors = work / f"{name}.json", work / f"{name}.stderr"
    started = time.monotonic()
    with errors.open("wb") as err:
        # Its own session: on a deadline or a Ctrl-C the whole group it started
        # (moto, control planes, machines) is stopped with it.
        proc = subprocess.Popen(
            [sys.executable, "-m", f"bench.{name}", *args, "--json", str(figures)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        try:
            code: int | None = proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _stop(proc)
    seconds = time.monotonic() - started
    stderr = errors.read_text(errors="replace")
    failed = Outcome(name, command, FAILED, seconds)
    if code is None:
        failed.detail = f"no result within {deadline:.0f} s\n{_tail(stderr)}"
        return failed
    if code == 2 and re.search(r"unrecognized arguments: .*--json", stderr):
        # A bench from before bench/results.py: nothing to report, nothing broken.
        return Outcome(name, command, NOT_RUN, seconds, detail=f"bench/{name}.py takes no --json")
    if code != 0:
        failed.detail = f"exit status {code}\n{_tail(stderr)}"
        return failed
    try:
        result = load(figures)
    except FileNotFoundError:
        failed.detail = f"exit status 0 but no figures written\n{_tail(stderr)}"
        return failed
    except (ValueError, KeyError, TypeError) as exc:
        failed.detail = f"figures unreadable: {exc!r}"
        return failed
    return Outcome(name, command, OK, seconds, result)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(text: str) -> str:
    return "\n".join(text.rstrip().splitlines()[-TAIL_LINES:])


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _header(out: Path, argv: Sequence[str], quick: bool) -> Header:
    # The page itself and its plots are left out of "dirty": a report not yet
    # committed says nothing about the code that was measured.
    mine = [
        f":(exclude){path.resolve().relative_to(ROOT)}"
        for path in (out, _figures_dir(out))
        if path.resolve().is_relative_to(ROOT)
    ]
    status = _git("status", "--porcelain", "--", ".", *mine)
    return Header(
        when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=machine_description(),
        commit=_git("rev-parse", "--short", "HEAD") or "unknown",
        dirty=bool(status),
        command=shlex.join(["python", "-m", "bench.report", *argv]),
        quick=quick,
    )


# -- writing -------------------------------------------------------------------


def _figures_dir(out: Path) -> Path:
    return out.with_suffix("")


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` through a temporary file beside it, renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_report(out: Path, header: Header, outcomes: Sequence[Outcome]) -> list[Path]:
    """Write the page at ``out`` and the plots of its curves; return the plots."""
    drawn: list[Path] = []
    lines = _head(header, outcomes)
    for outcome in outcomes:
        lines += _section(outcome, _figures_dir(out), drawn)
    _replace(out, lambda tmp: tmp.write_text("\n".join(lines).rstrip() + "\n"))
    folder = _figures_dir(out)
    if folder.is_dir():
        for png in folder.glob("*.png"):
            if png not in drawn:
                png.unlink()
        with contextlib.suppress(OSError):  # not empty: plots, or files not ours
            folder.rmdir()
    return drawn


def _head(header: Header, outcomes: Sequence[Outcome]) -> list[str]:
    tree = "uncommitted changes besides this page" if header.dirty else "clean tree"
    sizes = (
        "quick (tiny sizes: the figures show that each bench runs, not how fast anything is)"
        if header.quick
        else "full"
    )
    lines = [
        "# Benchmarks",
        "",
        "This page is generated by `python -m bench.report`; do not edit it, run the"
        " command again (bench/report.py says how).",
        "",
        f"- date: {header.when}",
        f"- machine: {header.machine}",
        f"- commit: `{header.commit}` ({tree})",
        f"- command: `{header.command}`",
        f"- sizes: {sizes}",
        "",
        "Each ratio is ours / the baseline, both measured in the same run on the same"
        " machine and data; each row says whether a lower or a higher ratio is better.",
        "",
        "| bench | result | seconds |",
        "|---|---|---:|",
    ]
    for o in outcomes:
        lines.append(f"| [{o.name}](#{o.name}) | {_cell(o.summary)} | {o.seconds:.1f} |")
    return [*lines, ""]


def _section(outcome: Outcome, folder: Path, drawn: list[Path]) -> list[str]:
    lines = [f"## {outcome.name}", "", f"`{outcome.command}`", ""]
    if outcome.status == NOT_RUN:
        return [*lines, f"not run: {outcome.detail}", ""]
    if outcome.status == FAILED or outcome.result is None:
        how, _, tail = outcome.detail.partition("\n")
        lines += [f"**failed** after {outcome.seconds:.1f} s: {how}", ""]
        return [*lines, "```text", tail, "```", ""] if tail else lines
    result = outcome.result
    lines += [f"Measured {result.when}, in {outcome.seconds:.1f} s.", ""]
    if result.rows:
        lines += [*_rows_table(result.rows), ""]
    if result.notes:
        lines += ["Notes:", "", *(f"- {note}" for note in result.notes), ""]
    for curve in result.curves:
        png = _png_path(folder, curve.name, drawn)
        plot_curve(curve, png)
        drawn.append(png)
        lines += [f"### {curve.name}", ""]
        if curve.note:
            lines += [curve.note, ""]
        lines += [f"![{curve.name}]({folder.name}/{png.name})", "", *_curve_table(curve), ""]
    return lines


def _rows_table(rows: Sequence[Row]) -> list[str]:
    targets = any(row.target for row in rows)
    head = "| figure | ours | baseline | ratio |" + (" target |" if targets else "")
    rule = "|---|---:|---|---:|" + ("---|" if targets else "")
    lines = [head, rule]
    for row in rows:
        ratio = f"{row.ratio:.2f}x" if math.isfinite(row.ratio) else "n/a"
        cells = [
            row.figure,
            f"{_num(row.ours)} {row.unit}",
            f"{_num(row.baseline)} {row.unit} ({row.baseline_name})",
            f"{ratio} ({row.better} is better)",
            *([row.target] if targets else []),
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def _curve_table(curve: Curve) -> list[str]:
    names = list(curve.series)
    heads = [curve.x_label, *(_label(curve, name) for name in names)]
    lines = ["| " + " | ".join(_cell(h) for h in heads) + " |", "|" + "---:|" * len(heads)]
    for i, x in enumerate(curve.x):
        # A series cut short (a step that failed at that size) leaves its cells empty.
        ys = [curve.series[name] for name in names]
        cells = [_num(x), *(_num(y[i]) if i < len(y) else "" for y in ys)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _label(curve: Curve, series: str) -> str:
    unit = curve.units.get(series, "")
    return f"{series} ({unit})" if unit else series


def _num(value: float) -> str:
    """A figure as a person reads it: a whole number from 100 up, else three
    significant digits (a 2 ms step stays 0.002 s, not 0.00)."""
    if not math.isfinite(value):
        return "n/a"
    if abs(value) >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _cell(text: str) -> str:
    # A "|" in a name ("tar | zstd -3") would end the cell.
    return text.replace("|", "\\|").replace("\n", " ")


def _png_path(folder: Path, name: str, taken: Sequence[Path]) -> Path:
    stem = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "curve"
    path, n = folder / f"{stem}.png", 1
    while path in taken:
        n += 1
        path = folder / f"{stem}-{n}.png"
    return path


def plot_curve(curve: Curve, png: Path) -> None:
    """Draw ``curve`` into ``png``: one panel per series (their units differ), in
    two columns past three series, the x axis shared.

    Log-log when x spans two decades or more, so that a slope reads as a growth
    exponent; a series that moves less than tenfold keeps a linear axis from 0
    (a log axis, or one fitted to the points, would draw noise of a few percent
    as a climb).
    """
    # Imported here: matplotlib takes a second to import, and a report without
    # curves needs none of it. The Agg canvas renders without a display or pyplot.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(curve.series) or [""]
    cols = 1 if len(names) <= 3 else 2
    rows = -(-len(names) // cols)
    log_x = bool(curve.x) and min(curve.x) > 0 and max(curve.x) / min(curve.x) >= 100
    fig = Figure(figsize=(5.2 * cols, 1.0 + 2.4 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.subplots(rows, cols, sharex=True, squeeze=False)
    fig.suptitle(curve.name)
    fig.supxlabel(curve.x_label)
    panels = list(grid.flat)
    for ax in panels[len(names) :]:
        # An empty last cell: the panel above it shows the x ticks instead.
        ax.remove()
        grid[rows - 2, cols - 1].xaxis.set_tick_params(labelbottom=True)
    for ax, name in zip(panels, names, strict=False):
        ys = curve.series.get(name, [])[: len(curve.x)]
        ax.plot(curve.x[: len(ys)], ys, marker="o")
        shown = [y for y in ys if math.isfinite(y)]
        if log_x:
            ax.set_xscale("log")
        if log_x and shown and min(shown) > 0 and max(shown) / min(shown) >= 10:
            ax.set_yscale("log")
        elif shown and min(shown) >= 0:
            ax.set_ylim(bottom=0, top=max(shown) * 1.1 or 1)
        ax.set_ylabel(_label(curve, name))
        ax.grid(True, which="both", alpha=0.3)
    png.parent.mkdir(parents=True, exist_ok=True)
    # No "Software" entry: the same figures make the same bytes.
    _replace(png, lambda tmp: fig.savefig(tmp, format="png", dpi=100, metadata={"Software": None}))


# -- the command ---------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module doc)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m bench.report", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a few minutes in all")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the page to write"
    )
    parser.add_argument(
        "--only", nargs="+", choices=list(BENCHES), metavar="NAME", help="just these benches"
    )
    args = parser.parse_args(argv)
    names = [name for name in BENCHES if args.only is None or name in args.only]
    header = _header(args.out, argv, args.quick)
    mode = "quick" if args.quick else "full"
    outcomes = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-report-") as work:
        for i, name in enumerate(names, 1):
            sizes = BENCHES[name]
            bench_args = sizes.quick if args.quick else sizes.full
            clock = time.strftime("%H:%M:%S", time.gmtime())
            print(f"[{i}/{len(names)}] {clock} {name}: started", flush=True)
            outcome = run_bench(name, bench_args, DEADLINE[mode], Path(work))
            print(
                f"[{i}/{len(names)}] {name}: {outcome.summary} ({outcome.seconds:.1f} s)",
                flush=True,
            )
            outcomes.append(outcome)
    drawn = write_report(args.out, header, outcomes)
    print(
        f"wrote {args.out} ({len(drawn)} plot(s)) in {time.monotonic() - started:.0f} s",
        flush=True,
    )
    return 1 if any(o.status == FAILED for o in outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
