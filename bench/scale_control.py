"""How the control plane's costs grow with the machines it serves (a growth curve).

For each point N (machines): a fresh ``agents-control`` (folder store), N
machines joined with the real join code, their links opened 1,000 at a time
(one mutual-TLS connection and certificate each, as ``bench/connect.py`` opens
them, whose pieces are used here: 1,000 at once is the burst it measures; a
fleet joined one by one opens its links one by one, and 5,000 first connections
opened at once by this bench's one process did not all come up within their
deadline on two cores), then, with every link up and heartbeating:

- the control plane's RSS (MiB);
- its CPU per heartbeat (us) over a window, less what it spends over an equal
  window before the links opened (its own periodic work);
- the join rate (joins/s, 16 at a time);
- how long ``machine list`` takes (its Admin gRPC call, the median of three);
- its store requests per hour over the window (``agents_cp_store_requests_total``;
  the largest point's split by cause goes in the note). Each link's presence is
  written once within its first ``presence_write_interval``: the full curve sets
  that to 60 s and counts only once it has passed (an idle fleet's steady
  state); the quick one counts at once (its figure includes those writes).

``curves(points, quick=...)`` returns one ``bench.results.Curve``
("control-machines") for ``bench/scale.py``; run alone it prints the table::

    .venv/bin/python -m bench.scale_control [--quick] [--points 10,100,1000] [--json PATH]

Replicas (``--replicas 1,2,3``, docs/controlplane.md "Replicas"): instead, how
the work spreads over R ``serve --cluster`` replicas at each ``--points`` value
(default 1,000, 3,000 and 5,000; quick: 20), and the replicas 100,000 machines
would need: ``bench/scale_replicas.py``. Needs ``nats-server``.

Every link is a socket here and one in the control plane: the open-file limit
is raised to its hard limit, and points it cannot hold are left out (said in
the note), as are points beyond the time or memory this machine has (each is
bounded by deadlines).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench import scale_replicas
from bench.connect import (
    control_counts,
    cpu_window,
    join_machines,
    new_account_tokens,
    open_links,
    raise_fd_limit,
    start_control,
)
from bench.results import BenchResult, Curve
from controlplane.cli.client import AdminClient
from tests.helpers.control_proc import ControlProc, stop_serve
from tests.helpers.nats_proc import nats_binary
from tests.helpers.poll import apoll_until

__all__ = ["FULL", "QUICK", "curves"]

FULL = [10, 100, 1000, 5000]
QUICK = [5, 10, 20, 40]
#: File descriptors a link needs beyond the sockets (the bench's own, gRPC's).
_FD_SPARE = 256
#: Links opened at once (each wave up before the next).
_WAVE = 1000

SERIES_UNITS = {
    "rss": "MiB",
    "cpu_per_heartbeat": "us",
    "join_rate": "joins/s",
    "machine_list": "s",
    "store_requests_per_hour": "requests/h",
}


@dataclass(frozen=True)
class _Settings:
    heartbeat: float
    window: float
    presence_interval: float | None
    """presence_write_interval set, and waited out before counting (None: neither)."""


def _settings(quick: bool) -> _Settings:
    # One heartbeat interval for every point, so that the store requests the
    # self-check makes each tick (one per interval) compare across points; 2 s
    # keeps 5,000 links' heartbeats within what two cores can send and serve.
    if quick:
        return _Settings(heartbeat=1.0, window=3.0, presence_interval=None)
    return _Settings(heartbeat=2.0, window=20.0, presence_interval=60.0)


@dataclass(frozen=True)
class _Point:
    machines: int
    rss_mib: float
    us_per_heartbeat: float
    joins_per_s: float
    list_s: float
    requests_per_hour: float
    by_cause: dict[str, float]


def _requests(cp: ControlProc) -> dict[str, int]:
    return dict(control_counts(cp, "agents_cp_store_requests_total", "cause"))


async def _list_time(cp: ControlProc, account_id: str, expected: int) -> float:
    """The median of three ``machine list`` calls (its Admin RPC), each listing all."""
    took = []
    async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=120) as client:
        for _ in range(3):
            started = time.monotonic()
            listed = await client.list_machines(account_id)
            took.append(time.monotonic() - started)
            assert len(listed) == expected, f"listed {len(listed)} of {expected}"
    return statistics.median(took)


async def _point(machines: int, settings: _Settings) -> _Point:
    with tempfile.TemporaryDirectory(prefix="bench-scale-control-") as tmp_name:
        tmp = Path(tmp_name)
        presence = settings.presence_interval
        cp = start_control(
            tmp, settings.heartbeat, f"presence_write_interval = {presence}" if presence else ""
        )
        try:
            assert cp.process is not None
            proc = psutil.Process(cp.process.pid)
            account_id, tokens = await new_account_tokens(cp, machines)
            join_s = await join_machines(tokens, tmp, machines)
            # Its own periodic work, to take away from the links' window below.
            idle_cpu, _, idle_s = await cpu_window(proc.pid, lambda: 0.0, settings.window)
            async with open_links(tmp, machines, wave=_WAVE) as opened:
                await apoll_until(
                    lambda: opened.connected() == machines,
                    deadline=120 + machines / 20,
                    what=f"{machines} links connected",
                    step=0.1,
                )
                # Steady state: every link past its welcome and first heartbeats (and,
                # in the full curve, its presence's first write).
                await asyncio.sleep(2 * settings.heartbeat + (presence or 0.0))
                rss = proc.memory_info().rss
                before, started = _requests(cp), time.monotonic()
                cpu, beats, window_s = await cpu_window(
                    proc.pid, opened.heartbeats, settings.window
                )
                after, took = _requests(cp), time.monotonic() - started
                list_s = await _list_time(cp, account_id, machines)
        finally:
            stop_serve(cp)
    links_cpu = max(0.0, cpu - idle_cpu * window_s / idle_s)
    by_cause = {
        cause: (n - before.get(cause, 0)) * 3600 / took
        for cause, n in after.items()
        if n > before.get(cause, 0)
    }
    return _Point(
        machines=machines,
        rss_mib=rss / 2**20,
        us_per_heartbeat=links_cpu / beats * 1e6 if beats else float("nan"),
        joins_per_s=machines / join_s,
        list_s=list_s,
        requests_per_hour=sum(by_cause.values()),
        by_cause=by_cause,
    )


async def _measure(points: list[int], settings: _Settings) -> tuple[list[_Point], list[str]]:
    fds = raise_fd_limit()
    measured: list[_Point] = []
    left_out: list[str] = []
    for machines in points:
        # A socket each side of every link, both processes under this limit.
        if machines + _FD_SPARE > fds:
            left_out.append(f"{machines} machines: beyond the open-file limit ({fds})")
            continue
        try:
            measured.append(await _point(machines, settings))
        except SystemExit as e:  # open_links' deadline for a wave: here, one point
            left_out.append(f"{machines} machines: {e}")
        except (AssertionError, TimeoutError, OSError) as e:
            left_out.append(f"{machines} machines: {type(e).__name__}: {e}")
    return measured, left_out


def _note(measured: list[_Point], left_out: list[str], settings: _Settings) -> str:
    presence = (
        f"counted after the links' first presence writes (presence_write_interval "
        f"{settings.presence_interval:g} s)"
        if settings.presence_interval
        else "counted at once, with the links' first presence writes"
    )
    parts = [
        f"folder store, heartbeat every {settings.heartbeat:g} s, windows of "
        f"{settings.window:g} s, joins 16 at a time; CPU per heartbeat is the window's "
        "less an equal window before the links opened (at a few machines it is within "
        f"the 10 ms clock tick); store requests {presence}"
    ]
    if measured:
        top = measured[-1]
        causes = ", ".join(
            f"{c} {v:.0f}" for c, v in sorted(top.by_cause.items(), key=lambda x: -x[1])
        )
        parts.append(f"store requests per hour at {top.machines} machines by cause: {causes}")
    parts += [f"left out: {why}" for why in left_out]
    return "; ".join(parts)


def curves(points: list[int], *, quick: bool) -> list[Curve]:
    """The control plane's growth with the machines it serves (see the module doc)."""
    settings = _settings(quick)
    measured, left_out = asyncio.run(_measure(points, settings))
    series: dict[str, list[float]] = {
        "rss": [p.rss_mib for p in measured],
        "cpu_per_heartbeat": [p.us_per_heartbeat for p in measured],
        "join_rate": [p.joins_per_s for p in measured],
        "machine_list": [p.list_s for p in measured],
        "store_requests_per_hour": [p.requests_per_hour for p in measured],
    }
    return [
        Curve(
            name="control-machines",
            x_label="machines",
            x=[float(p.machines) for p in measured],
            series=series,
            units=dict(SERIES_UNITS),
            note=_note(measured, left_out, settings),
        )
    ]


def _table(curve: Curve) -> str:
    heads = [f"{name} ({curve.units[name]})" for name in curve.series]
    rows = [f"{curve.x_label:>9}  " + "  ".join(f"{h:>26}" for h in heads)]
    for i, x in enumerate(curve.x):
        cells = "  ".join(f"{curve.series[name][i]:>26.3g}" for name in curve.series)
        rows.append(f"{x:>9.0f}  {cells}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"points {QUICK}, short windows")
    parser.add_argument("--points", help=f"machines at each point, e.g. 10,100 (default {FULL})")
    parser.add_argument("--json", type=Path, help="also write the curve here (bench.results)")
    parser.add_argument(
        "--replicas",
        help="instead: replica counts, e.g. 1,2,3, each serving every --points value of "
        f"machines (default {list(scale_replicas.FULL_POINTS)}; needs nats-server)",
    )
    parser.add_argument(
        "--heartbeat",
        type=float,
        help="with --replicas: the heartbeat interval in seconds (default 2; quick 1)",
    )
    args = parser.parse_args(argv)
    if args.heartbeat is not None and not 0.5 <= args.heartbeat <= 60:
        parser.error("--heartbeat: 0.5..60 seconds")
    try:
        points = [int(p) for p in args.points.split(",")] if args.points else None
    except ValueError:
        parser.error("--points: whole numbers separated by commas")
    if points is None:
        points = QUICK if args.quick else FULL
    if not points or not all(1 <= p <= 20000 for p in points):
        parser.error("--points: 1..20000 machines each")
    if args.replicas:
        try:
            counts = [int(r) for r in args.replicas.split(",")]
        except ValueError:
            parser.error("--replicas: whole numbers separated by commas")
        if not counts or not all(1 <= r <= 8 for r in counts):
            parser.error("--replicas: 1..8 replicas each")
        if not args.points:
            points = list(scale_replicas.QUICK_POINTS if args.quick else scale_replicas.FULL_POINTS)
        if nats_binary() is None:
            print("bench.scale_control: --replicas needs nats-server (apt-get install nats-server)")
            return 1
        found = scale_replicas.replica_curves(
            points, counts, quick=args.quick, heartbeat=args.heartbeat
        )
        print(f"control plane, spread over replicas ({'quick' if args.quick else 'full'}):")
        print(scale_replicas.points_table(found))
        print(f"note: {found[0].note}")
    else:
        found = curves(points, quick=args.quick)
        print(f"control plane, growth with machines ({'quick' if args.quick else 'full'}):")
        print(_table(found[0]))
        print(f"note: {found[0].note}")
    command = "python -m bench.scale_control " + " ".join(sys.argv[1:] if argv is None else argv)
    BenchResult(bench="scale_control", command=command, curves=found).write(args.json)
    return 0 if all(curve.x for curve in found) else 1


if __name__ == "__main__":
    sys.exit(main())
