"""What an idle fleet costs the object store: the control plane's own count of its
store requests (``agents_cp_store_operations_total``) over a quiet window,
with 1 machine and with ``--machines`` machines joined and online.

    python -m bench.idle                      # 1 vs 4 machines, 60 s each
    python -m bench.idle --machines 8 --window 120

Each run is a control plane on moto's S3 server with ``--heartbeat`` seconds
between heartbeats (1 s by default: a tick of the self-check per second, so a
minute shows what an hour of the 15 s default would), machines joined by their
printed join commands and left alone. After the joins settle, the requests of
``--window`` seconds are counted by operation and scaled to an hour. The ratio
is the large fleet's requests over the single machine's: 1.00x when nothing
grows with the fleet, the machines' count otherwise. ``--json PATH`` also
writes it for ``bench/report.py`` (bench/results.py); ``--settle`` shortens the
wait after the joins for a quick run, whose counts then include the joins' tail.
A table then splits each run's requests by cause
(``agents_cp_store_requests_total``: which work made them, docs/metrics.md).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import boto3  # type: ignore[import-untyped]

from bench.results import BenchResult, Row
from tests.helpers.control_proc import (
    ControlProc,
    join_new_account,
    run_init,
    s3_env,
    start_serve,
    stop_serve,
)
from tests.helpers.moto_server import moto_server

#: Seconds after the last join before counting (``--settle``): the waker's first
#: listing of the new fleet and the joins' own writes are over by then.
SETTLE = 35.0


def _summed(cp: ControlProc, pattern: str) -> dict[str, float]:
    """The samples ``pattern`` matches on /metrics, summed by its first group."""
    with urllib.request.urlopen(f"http://{cp.serve_info['metrics']}/metrics", timeout=15) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(pattern, text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _operations(cp: ControlProc) -> dict[str, float]:
    return _summed(
        cp, r'^agents_cp_store_operations_total\{operation="(\w+)",outcome="\w+"\} (\S+)$'
    )


def _causes(cp: ControlProc) -> dict[str, float]:
    return _summed(cp, r'^agents_cp_store_requests_total\{cause="(\w+)",operation="\w+"\} (\S+)$')


def measure(
    machines: int,
    window: float,
    heartbeat: float,
    root: Path,
    settle: float = SETTLE,
    by_cause: dict[str, float] | None = None,
) -> dict[str, float]:
    """Store requests per hour of ``machines`` idle machines, by operation (and into
    ``by_cause``, when given, by cause)."""
    with moto_server() as endpoint:
        bucket = f"idle-{machines}"
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing-secret",
        ).create_bucket(Bucket=bucket)
        cp = run_init(
            root / f"home-{machines}",
            f"s3://{bucket}/cp",
            s3_env(endpoint),
            ["--heartbeat-interval", str(heartbeat)],
        )
        start_serve(cp)
        procs = []
        try:
            for i in range(machines):
                data, log = root / f"m{machines}-{i}", root / f"m{machines}-{i}.log"
                procs.append(join_new_account(cp, data, log, github_id=7000 + i, login=f"i{i}"))
            time.sleep(settle)  # the bench's own pace, not a wait on a state
            before, started = _operations(cp), time.monotonic()
            causes_before = _causes(cp)
            time.sleep(window)
            after, took = _operations(cp), time.monotonic() - started
            causes_after = _causes(cp)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(timeout=30)
            stop_serve(cp)
    if by_cause is not None:
        for k, v in causes_after.items():
            by_cause[k] = (v - causes_before.get(k, 0.0)) * 3600 / took
    return {k: (after[k] - before.get(k, 0.0)) * 3600 / took for k in after}


def _ops(hourly: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(hourly.items()) if v >= 0.5) or "none"


def _line(label: str, hourly: dict[str, float]) -> str:
    return f"{label:<28}: {sum(hourly.values()):7.0f} requests/hour ({_ops(hourly)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", type=int, default=4, help="the larger fleet (default 4)")
    parser.add_argument("--window", type=float, default=60.0, help="seconds counted (60)")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat seconds (1)")
    parser.add_argument(
        "--settle", type=float, default=SETTLE, help=f"seconds after the joins ({SETTLE:g})"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here (bench/results.py)")
    args = parser.parse_args(argv)
    if args.machines < 2 or args.window <= 0 or args.heartbeat <= 0 or args.settle < 0:
        parser.error(
            "--machines must be at least 2, --window and --heartbeat positive, --settle >= 0"
        )
    with tempfile.TemporaryDirectory(prefix="idle-", dir="/tmp") as tmp:
        one_causes: dict[str, float] = {}
        many_causes: dict[str, float] = {}
        one = measure(1, args.window, args.heartbeat, Path(tmp), args.settle, one_causes)
        many = measure(
            args.machines, args.window, args.heartbeat, Path(tmp), args.settle, many_causes
        )
    print(f"idle fleet, heartbeat {args.heartbeat:g} s, {args.window:g} s counted, moto")
    print(_line("1 machine", one))
    print(_line(f"{args.machines} machines", many))
    base = sum(one.values())
    ratio = sum(many.values()) / base if base else float("inf")
    lists = many.get("list", 0.0) / max(one.get("list", 0.0), 1.0)
    print(f"ratio {args.machines} machines / 1 machine {ratio:.2f}x (lists {lists:.2f}x)")
    BenchResult(
        bench="idle",
        command=(
            f"python -m bench.idle --machines {args.machines} --window {args.window:g}"
            f" --heartbeat {args.heartbeat:g} --settle {args.settle:g}"
        ),
        rows=[
            Row(
                f"{args.machines} machines idle",
                sum(many.values()),
                base,
                "requests/hour",
                "1 machine idle",
                "lower",
                "1.00x",
            )
        ],
        notes=[
            f"heartbeat {args.heartbeat:g} s, {args.window:g} s counted, moto",
            f"requests/hour by operation: 1 machine {_ops(one)}; {args.machines} machines"
            f" {_ops(many)}",
        ],
    ).write(args.json)
    print(_cause_table(args.machines, one_causes, many_causes))
    return 0


def _cause_table(machines: int, one: dict[str, float], many: dict[str, float]) -> str:
    """Requests per hour by cause, for both runs (causes with none in either left out)."""
    many_label = f"{machines} machines"
    rows = [f"{'requests/hour by cause':<24}{'1 machine':>12}{many_label:>14}"]
    for cause in sorted(set(one) | set(many)):
        if max(one.get(cause, 0.0), many.get(cause, 0.0)) >= 0.5:
            rows.append(f"  {cause:<22}{one.get(cause, 0.0):>12.0f}{many.get(cause, 0.0):>14.0f}")
    if len(rows) == 1:
        rows.append("  none")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
