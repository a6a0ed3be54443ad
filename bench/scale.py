"""Growth curves: how the machine daemon's costs grow with its work, and (from
``bench/scale_control.py``) the control plane's with its fleet, and (from
``bench/scale_replicas.py``) its replicas' at 1,000 to 5,000 links.

    python -m bench.scale                        # full: about 30 minutes on 2 busy cores
    python -m bench.scale --quick                # about a minute
    python -m bench.scale --part machine --json scale.json
    python -m bench.scale --part replicas        # 1, 2, 3 replicas (needs nats-server)

Machine curves. Each point is a fresh data folder, filled before the daemon
starts; then a real ``agents-machine serve`` (never joined: it serves its Unix
socket with no control plane) is started, measured and stopped:

- ``machine-agents``: 10 -> 10,000 agents (quick: 10 -> 300), each with one
  finished run of 20 events; against the daemon's start (process start until
  its gRPC health check answers SERVING), ``agent list`` (p50 of the ListAgents
  RPC through the CLI's own client, ``machine.cli.client.MachineClient``, which
  is what ``agents-machine agent list --json`` calls; and p50 of that whole CLI
  command, interpreter start included), machine.db's size and the daemon's RSS
  after its start and after those reads.
- ``machine-events``: one agent with 100 -> 1,000,000 events (quick: 100 ->
  20,000); against the daemon's start, search p50 (the Search RPC over that
  agent, a query of two words that about half of its replies hold), the
  replay of its last 100 events (the Replay RPC from ``after_seq`` = last seq -
  100), machine.db's size and RSS (after the start, after the reads).

The rows are written through ``machine.storage.tables`` as a live run writes
them (``insert_run``, ``set_run_state``, ``append_event``), so the tool log, the
turn summaries and the search index (prompt, reply, tool and summary rows) are
a live machine's; the one difference is that many runs share a transaction. A
run is a prompt, text deltas of 150 to 400 bytes, a file read and an edit
(tool calls and their results) and its end: 20 events.

Growth: each series' factor over the curve and per 10x of work, the slope of
log(cost) against log(work); a series whose slope over the whole curve or over
its last step is above 1.1 grows faster than the work and is flagged FINDING.
Timed reads are repeated (20 times) for a p50; timings on a busy machine are
noisy, sizes are not.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import psutil

from bench.results import BenchResult, Curve
from machine.cli.client import MachineClient
from machine.config import MachineConfig
from machine.link.machine_ids import machine_ids
from machine.models import AgentRecord, AgentState, EventKind, RunState
from machine.storage import tables
from machine.storage.db import Database
from shared.ids import new_id
from tests.helpers.machine_proc import MachineProc, run_cli

AGENT_POINTS: Final = (10, 100, 1_000, 10_000)
AGENT_POINTS_QUICK: Final = (10, 30, 100, 300)
EVENT_POINTS: Final = (100, 10_000, 100_000, 1_000_000)
EVENT_POINTS_QUICK: Final = (100, 1_000, 5_000, 20_000)
CONTROL_POINTS: Final = (10, 100, 1_000, 5_000)
CONTROL_POINTS_QUICK: Final = (5, 10, 20, 40)

#: Timed reads per point, for a p50.
READS: Final = 20
#: A slope of log(cost) on log(work) above this is growth faster than the work
#: (1.0 is proportional; the margin keeps a noisy timing from being a finding).
SUPERLINEAR: Final = 1.1
#: Events of one run (see _Texts.run): a prompt, 14 text deltas, 2 tool calls,
#: 2 results and the end.
RUN_EVENTS: Final = 20
#: Runs written per transaction while filling.
RUNS_PER_WRITE: Final = 500
REPLAYED: Final = 100


# -- realistic text ------------------------------------------------------------


class _Texts:
    """Event texts of a coding agent's conversation: prose over a Zipf-distributed
    vocabulary (as words are in English), file paths and code-like tool output.

    Paragraphs are drawn from pools made once, so that filling a million events
    costs the database's time, not the random generator's.
    """

    def __init__(self, seed: int = 7) -> None:
        rng = self._rng = random.Random(seed)
        letters = "abcdefghijklmnopqrstuvwxyz"
        self.words = [
            "".join(rng.choice(letters) for _ in range(rng.randint(2, 10))) for _ in range(5000)
        ]
        weights = [1.0 / (rank + 1) for rank in range(len(self.words))]
        self._cum = list(_accumulate(weights))
        self.deltas = [self._prose(150, 400) for _ in range(3000)]
        self.prompts = [self._prose(40, 200) for _ in range(500)]
        folders = ["src", "src/api", "src/core", "src/storage", "tests", "docs", "scripts"]
        self.paths = [
            f"{rng.choice(folders)}/{rng.choice(self.words)}_{rng.choice(self.words)}.py"
            for _ in range(300)
        ]
        self.code = [self._code() for _ in range(1000)]
        self.query = self._query()

    def _prose(self, low: int, high: int) -> str:
        size = self._rng.randint(low, high)
        out: list[str] = []
        length = 0
        while length < size:
            word = self._rng.choices(self.words, cum_weights=self._cum)[0]
            out.append(word)
            length += len(word) + 1
        return " ".join(out).capitalize() + "."

    def _code(self) -> str:
        rng = self._rng
        lines = []
        for _ in range(rng.randint(6, 14)):
            a, b, c = (rng.choices(self.words, cum_weights=self._cum)[0] for _ in range(3))
            lines.append(rng.choice(["    ", "        "]) + f"{a}_{b} = self.{c}({a}, {b})")
        return "\n".join(lines)

    def _query(self) -> str:
        """Two words of which each is in about 8.5 % of the text deltas, so in about
        70 % of the replies (14 deltas), and both in about half of them."""
        share = collections.Counter(w for d in self.deltas for w in set(d.rstrip(".").split()))
        target = 0.085 * len(self.deltas)
        first, second = sorted(share, key=lambda w: (abs(share[w] - target), w))[:2]
        return f"{first.lower()} {second.lower()}"

    def run(self, rng: random.Random, call: int) -> list[tuple[EventKind, dict[str, Any]]]:
        """One run's events after RUN_STARTED, its end included (RUN_EVENTS - 1)."""

        def deltas(n: int) -> list[tuple[EventKind, dict[str, Any]]]:
            return [(EventKind.TEXT_DELTA, {"text": rng.choice(self.deltas)}) for _ in range(n)]

        def tool(kind: str, title: str, args: dict[str, str], n: int) -> list[Any]:
            call_id = f"call_{call}_{n}"
            return [
                (
                    EventKind.TOOL_CALL,
                    {
                        "call_id": call_id,
                        "title": title,
                        "tool_kind": kind,
                        "input_json": json.dumps(args),
                    },
                ),
                (
                    EventKind.TOOL_RESULT,
                    {"call_id": call_id, "status": "completed", "output": rng.choice(self.code)},
                ),
            ]

        path = rng.choice(self.paths)
        old, new = rng.choice(self.code)[:120], rng.choice(self.code)[:120]
        edit = {"path": path, "old": old, "new": new}
        usage = {"input_tokens": rng.randint(2000, 40000), "output_tokens": rng.randint(200, 4000)}
        end = {"stop_reason": "end_turn", "usage": usage, "duration_ms": rng.randint(3000, 90000)}
        return [
            *deltas(5),
            *tool("read", f"Read {path}", {"path": path}, 1),
            *deltas(4),
            *tool("edit", f"Edit {path}", edit, 2),
            *deltas(5),
            (EventKind.RUN_FINISHED, end),
        ]


def _accumulate(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for v in values:
        total += v
        out.append(total)
    return out


# -- filling a data folder -------------------------------------------------------


@dataclass(frozen=True)
class _Filled:
    agents: list[str]
    last_seq: int  # of the first agent
    events: int


async def _fill(data: Path, agents: int, runs_each: int, texts: _Texts) -> _Filled:
    """A data folder with ``agents`` agents of this machine, each with ``runs_each``
    finished runs written as a live run writes them (see the module docstring)."""
    data.mkdir(mode=0o700, parents=True)
    db = await Database.open(data / "machine.db")
    rng = random.Random(agents * 1_000_003 + runs_each)
    # Runs at most five minutes apart, ending now, the agents made before the
    # first run; all within 6 days, so that the machine log the daemon prunes at
    # 7 days (event_retention_days) has nothing for its first start to delete.
    spacing = min(300.0, 6 * 86400 / (agents * (runs_each + 1)))
    start = time.time() - agents * runs_each * spacing
    try:
        # What the daemon records at its first start: this machine's id, so that
        # the agents are its own (shown and run, not a restored machine's).
        ids = await db.write(lambda c: machine_ids(c, False, None))
        ids_of = [new_id("agent") for _ in range(agents)]

        def add_agents(conn: Any, part: list[str], first: int) -> None:
            for i, agent_id in enumerate(part, first):
                created = start - (agents - i) * spacing
                record = AgentRecord(
                    id=agent_id,
                    name=f"agent-{i}",
                    folder=f"/home/bench/projects/{texts.words[i % 5000]}-{i}",
                    runtime="echo",
                    settings={},
                    state=AgentState.ACTIVE,
                    origin_machine=ids.canonical,
                    local=True,
                    session_id=None,
                    created_at=created,
                    updated_at=created,
                    last_seq=0,
                )
                tables.insert_agent(conn, record)
                tables.log(conn, created, "agent.created", agent_id)

        for first in range(0, agents, 1000):
            part = ids_of[first : first + 1000]
            await db.write(lambda c, p=part, f=first: add_agents(c, p, f), bulk=True)

        # (agent, run number) in the order the runs happened: agent by agent,
        # as each agent's conversation is its own sequence.
        work = [(a, r) for a in ids_of for r in range(runs_each)]
        events = 0

        def add_runs(conn: Any, part: list[tuple[str, int]], first: int) -> int:
            written = 0
            for n, (agent_id, _) in enumerate(part, first):
                at = start + n * spacing
                run_id, prompt = new_id("run"), rng.choice(texts.prompts)
                tables.insert_run(conn, run_id, agent_id, prompt, (), at)
                tables.set_run_state(conn, run_id, RunState.RUNNING, started_at=at)
                started = {"prompt": prompt, "attachments": [], "runtime": "echo"}
                tables.append_event(conn, agent_id, run_id, EventKind.RUN_STARTED, started, at)
                for i, (kind, payload) in enumerate(texts.run(rng, n)):
                    tables.append_event(conn, agent_id, run_id, kind, payload, at + i * 0.5)
                finished = at + RUN_EVENTS * 0.5
                tables.set_run_state(
                    conn,
                    run_id,
                    RunState.FINISHED,
                    finished_at=finished,
                    duration_ms=int((finished - at) * 1000),
                    input_tokens=1000,
                    output_tokens=300,
                    stop_reason="end_turn",
                )
                written += RUN_EVENTS
            return written

        for first in range(0, len(work), RUNS_PER_WRITE):
            part = work[first : first + RUNS_PER_WRITE]
            events += await db.write(lambda c, p=part, f=first: add_runs(c, p, f), bulk=True)
        last = await db.read(
            lambda c: c.execute("SELECT last_seq FROM agents WHERE id = ?", (ids_of[0],)).fetchone()
        )
    finally:
        await db.close()
    return _Filled(ids_of, int(last[0]), events)


def _db_bytes(data: Path) -> int:
    """machine.db with its WAL, as it lies on disk."""
    return sum(
        p.stat().st_size for p in (data / "machine.db", data / "machine.db-wal") if p.exists()
    )


# -- measuring one point ---------------------------------------------------------


def _p50(samples: list[float]) -> float:
    return statistics.median(samples)


async def _timed(repeats: int, call: Callable[[], Awaitable[object]]) -> float:
    """p50 seconds of ``call``, after one untimed call (the first pays for the
    connection and the daemon's cold caches, which a start figure already shows)."""
    await call()
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - began)
    return _p50(samples)


@dataclass
class _Started:
    proc: MachineProc
    seconds: float
    rss: int


def _start(data: Path) -> _Started:
    """Start the daemon; the seconds from process start until gRPC answers SERVING
    (polled every 50 ms, as tests.helpers.machine_proc does) and its RSS then."""
    proc = MachineProc(data)
    began = time.monotonic()
    proc.start()
    seconds = time.monotonic() - began
    return _Started(proc, seconds, _rss(proc))


def _rss(proc: MachineProc) -> int:
    assert proc.proc is not None
    return int(psutil.Process(proc.proc.pid).memory_info().rss)


def _starts(data: Path, times: int) -> tuple[float, int, MachineProc]:
    """Start the daemon ``times`` times (stopping all but the last); p50 start
    seconds, p50 RSS, and the running daemon."""
    runs: list[_Started] = []
    for _ in range(times):
        if runs:
            runs[-1].proc.stop()
        runs.append(_start(data))
    seconds = _p50([r.seconds for r in runs])
    rss = int(_p50([float(r.rss) for r in runs]))
    return seconds, rss, runs[-1].proc


def _agents_point(data: Path, agents: int, quick: bool, texts: _Texts) -> dict[str, float]:
    asyncio.run(_fill(data, agents, 1, texts))
    size = _db_bytes(data)
    seconds, rss, proc = _starts(data, 1 if quick else 3)
    try:

        async def reads() -> float:
            async with MachineClient(MachineConfig(data_dir=data)) as client:

                async def listed() -> None:
                    got = await client.list_agents()
                    assert len(got) == agents, (len(got), agents)

                return await _timed(READS, listed)

        rpc = asyncio.run(reads())
        cli: list[float] = []
        for _ in range(3 if quick else 5):
            began = time.monotonic()
            done = run_cli(data, "agent", "list", "--json", timeout=120)
            cli.append(time.monotonic() - began)
            assert done.returncode == 0, done.stderr[-2000:]
            assert len(json.loads(done.stdout)["agents"]) == agents
        after_reads = _rss(proc)
    finally:
        proc.stop()
    return {
        "daemon start": seconds,
        "agent list p50 (RPC)": rpc * 1000,
        "agent list --json p50 (CLI)": _p50(cli),
        "machine.db": size / 1e6,
        "RSS after start": rss / 2**20,
        "RSS after reads": after_reads / 2**20,
    }


def _events_point(data: Path, events: int, quick: bool, texts: _Texts) -> dict[str, float]:
    filled = asyncio.run(_fill(data, 1, max(1, events // RUN_EVENTS), texts))
    agent = filled.agents[0]
    size = _db_bytes(data)
    seconds, rss, proc = _starts(data, 1 if quick else 3)
    try:

        async def reads() -> tuple[float, float]:
            async with MachineClient(MachineConfig(data_dir=data)) as client:

                async def searched() -> None:
                    found = await client.search(texts.query, agent_id=agent, limit=20)
                    assert found.hits, f"no hit for {texts.query!r} in {events} events"

                async def replayed() -> None:
                    after = max(0, filled.last_seq - REPLAYED)
                    got = [ev async for ev in client.replay(agent, after_seq=after)]
                    assert len(got) == min(REPLAYED, filled.last_seq), len(got)

                return await _timed(READS, searched), await _timed(READS, replayed)

        search, replay = asyncio.run(reads())
        after_reads = _rss(proc)
    finally:
        proc.stop()
    return {
        "daemon start": seconds,
        "search p50": search * 1000,
        "replay last 100 p50": replay * 1000,
        "machine.db": size / 1e6,
        "RSS after start": rss / 2**20,
        "RSS after reads": after_reads / 2**20,
    }


_AGENT_UNITS: Final = {
    "daemon start": "s",
    "agent list p50 (RPC)": "ms",
    "agent list --json p50 (CLI)": "s",
    "machine.db": "MB",
    "RSS after start": "MiB",
    "RSS after reads": "MiB",
}
_EVENT_UNITS: Final = {
    "daemon start": "s",
    "search p50": "ms",
    "replay last 100 p50": "ms",
    "machine.db": "MB",
    "RSS after start": "MiB",
    "RSS after reads": "MiB",
}


def _curve(
    name: str,
    x_label: str,
    points: tuple[int, ...],
    units: dict[str, str],
    note: str,
    measure: Callable[[Path, int], dict[str, float]],
    root: Path,
) -> Curve:
    """Measure each point in a data folder of its own, removed after it (a
    million events take over a gigabyte)."""
    series: dict[str, list[float]] = {k: [] for k in units}
    xs: list[float] = []
    for x in points:
        began = time.monotonic()
        data = root / f"{name}-{x}"
        try:
            got = measure(data, x)
        finally:
            shutil.rmtree(data, ignore_errors=True)
        print(f"  {name}: {x:,} measured in {time.monotonic() - began:.1f} s", flush=True)
        xs.append(float(x))
        for key in units:
            series[key].append(got[key])
    return Curve(name=name, x_label=x_label, x=xs, series=series, units=dict(units), note=note)


def machine_curves(*, quick: bool) -> list[Curve]:
    """The machine daemon's two curves (agents, events of one agent)."""
    texts = _Texts()
    with tempfile.TemporaryDirectory(prefix="scale-", dir="/tmp") as tmp:
        root = Path(tmp)
        agents = _curve(
            "machine-agents",
            "agents (one run of 20 events each)",
            AGENT_POINTS_QUICK if quick else AGENT_POINTS,
            _AGENT_UNITS,
            "agent list (RPC): ListAgents through the CLI's client; (CLI): the whole"
            " `agents-machine agent list --json` process",
            lambda data, n: _agents_point(data, n, quick, texts),
            root,
        )
        events = _curve(
            "machine-events",
            "events of one agent",
            EVENT_POINTS_QUICK if quick else EVENT_POINTS,
            _EVENT_UNITS,
            f"search: the Search RPC over the agent for {texts.query!r} (20 hits at most);"
            " replay: the Replay RPC after last seq - 100",
            lambda data, n: _events_point(data, n, quick, texts),
            root,
        )
    return [agents, events]


# -- growth ------------------------------------------------------------------------


def _slope(x0: float, y0: float, x1: float, y1: float) -> float:
    """The slope of log(cost) against log(work) between two points."""
    return math.log(y1 / y0) / math.log(x1 / x0)


def growth(curve: Curve) -> list[str]:
    """One line stating how each series grows over the curve, then one FINDING
    line per series growing faster than the work."""
    work = curve.x_label.split(" (")[0]
    if len(curve.x) < 2:
        return [f"{curve.name}: {len(curve.x)} point(s) of {work}: no growth to state"]
    x0, x1 = curve.x[0], curve.x[-1]
    parts: list[str] = []
    findings: list[str] = []
    for name, ys in curve.series.items():
        if min(ys[0], ys[-1], ys[-2]) <= 0:
            parts.append(f"{name} n/a")
            continue
        whole = _slope(x0, ys[0], x1, ys[-1])
        last = _slope(curve.x[-2], ys[-2], x1, ys[-1])
        parts.append(f"{name} {ys[-1] / ys[0]:.2f}x ({10**whole:.2f}x per 10x)")
        if max(whole, last) > SUPERLINEAR:
            findings.append(
                f"FINDING {curve.name}: {name} grows faster than the {work}:"
                f" {ys[-1] / ys[0]:.1f}x for {x1 / x0:,.0f}x (slope {whole:.2f}),"
                f" last step {ys[-1] / ys[-2]:.1f}x for {x1 / curve.x[-2]:,.0f}x"
                f" (slope {last:.2f})"
            )
    head = f"{curve.name}: {x0:,.0f} -> {x1:,.0f} {work} ({x1 / x0:,.0f}x): "
    return [head + "; ".join(parts), *findings]


def _number(v: float) -> str:
    if v == 0 or abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def table(curve: Curve) -> str:
    """The curve as a printed table: x, then each series with its unit."""
    heads = [curve.x_label.split(" (")[0]] + [
        f"{name} {curve.units.get(name, '')}".strip() for name in curve.series
    ]
    rows = [
        [f"{x:,.0f}"] + [_number(ys[i]) for ys in curve.series.values()]
        for i, x in enumerate(curve.x)
    ]
    widths = [max(len(r[c]) for r in [heads, *rows]) for c in range(len(heads))]
    lines = [f"{curve.name}: {curve.x_label}"]
    if curve.note:
        lines.append(f"  {curve.note}")
    for r in [heads, *rows]:
        lines.append("  " + "  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)))
    return "\n".join(lines)


def control_curves(*, quick: bool) -> list[Curve]:
    """The control plane's curves (bench/scale_control.py)."""
    from bench import scale_control

    points = CONTROL_POINTS_QUICK if quick else CONTROL_POINTS
    return scale_control.curves(list(points), quick=quick)


def replica_curves(*, quick: bool) -> list[Curve]:
    """The control plane's replicas (bench/scale_replicas.py); none, said in one
    line, without nats-server."""
    from bench import scale_replicas
    from tests.helpers.nats_proc import nats_binary

    if nats_binary() is None:
        print("scale: replicas left out: nats-server is not installed")
        return []
    if quick:
        points, counts = scale_replicas.QUICK_POINTS, scale_replicas.QUICK_COUNTS
    else:
        points, counts = scale_replicas.FULL_POINTS, scale_replicas.FULL_COUNTS
    return scale_replicas.replica_curves(points, counts, quick=quick)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small points (about a minute)")
    parser.add_argument(
        "--part",
        choices=("machine", "control", "replicas", "all"),
        default="all",
        help="default all",
    )
    parser.add_argument("--json", type=Path, help="write the figures here (bench/results.py)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    curves: list[Curve] = []
    if args.part in ("machine", "all"):
        curves += machine_curves(quick=args.quick)
    if args.part in ("control", "all"):
        curves += control_curves(quick=args.quick)
    if args.part in ("replicas", "all"):
        curves += replica_curves(quick=args.quick)
    notes: list[str] = []
    for curve in curves:
        print()
        print(table(curve))
        lines = growth(curve)
        for line in lines:
            print(line)
        notes += lines
    print(f"\nscale: {len(curves)} curve(s) in {time.monotonic() - began:.0f} s")
    command = shlex.join(["python", "-m", "bench.scale", *(sys.argv[1:] if argv is None else argv)])
    BenchResult(bench="scale", command=command, curves=curves, notes=notes).write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
