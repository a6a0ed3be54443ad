"""Durable run-event appends per second: the machine's store against raw fsync.

Both sides make the same events durable on the same disk in the same run:

- store: N concurrent runs, each recording its events as the engine does
  (:meth:`EventRecorder.record <machine.core.recorder.EventRecorder.record>`
  through the run's :class:`~machine.core.recorder.RunStream`: queued without
  waiting for each commit, published once committed) into
  :class:`machine.storage.db.Database` (WAL, synchronous=FULL); group commit lets
  one fsync cover every event queued at that moment, within a run and across runs.
  Each run ends by waiting for all its events to be durable (its drain);
- awaited: the same with every append awaited before the next (what a run cost
  before run streams: one commit per event for a lone run);
- raw: the same JSON bytes written to a file one event at a time, each
  followed by ``os.fsync`` (what "one fsync per event" costs).

Usage: ``.venv/bin/python -m bench.appends [--events N] [--appenders K] [--json PATH]``.
Prints the raw rate, then the store's with one run and with K, each with its
ratio (store / raw), and the awaited baseline for one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from bench.results import BenchResult, Row
from machine.core.recorder import EventRecorder
from machine.models import EventKind, RunRecord
from machine.storage import tables
from machine.storage.db import Database


def payload(i: int) -> dict[str, str]:
    return {"text": f"delta {i:06d} " + "lorem ipsum " * 4}


async def bench_store(
    folder: Path, events: int, appenders: int, *, streams: bool = True
) -> tuple[float, int]:
    """Events per second and commits, ``appenders`` runs recording ``events`` in all."""
    commits: list[int] = []
    db = await Database.open(folder / "machine.db", on_commit=lambda n, s: commits.append(n))
    try:

        def make_runs(conn: sqlite3.Connection) -> list[RunRecord]:
            runs = []
            for a in range(appenders):
                conn.execute(
                    "INSERT INTO agents (id, name, folder, runtime, state, origin_machine,"
                    " created_at, updated_at) VALUES (?, 'b', '/', 'echo', 'active', 'm', 0, 0)",
                    (f"ag_{a}",),
                )
                tables.insert_run(conn, f"run_{a}", f"ag_{a}", "bench", (), 0.0)
                runs.append(tables.get_run(conn, f"run_{a}"))
            return runs

        runs = await db.write(make_runs)
        recorder = EventRecorder(db)
        commits.clear()
        per = events // appenders

        async def appender(run: RunRecord) -> None:
            if not streams:
                for i in range(per):
                    await recorder.record(run, EventKind.TEXT_DELTA, payload(i))
                return
            stream = recorder.open_stream(run)
            for i in range(per):
                await recorder.record(run, EventKind.TEXT_DELTA, payload(i))
            await stream.drain()  # the run's events are all durable
            recorder.close_stream(run.id)

        start = time.perf_counter()
        await asyncio.gather(*(appender(run) for run in runs))
        elapsed = time.perf_counter() - start
        return per * appenders / elapsed, len(commits)
    finally:
        await db.close()


def bench_raw(folder: Path, events: int) -> float:
    path = folder / "raw.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        start = time.perf_counter()
        for i in range(events):
            os.write(fd, json.dumps(payload(i)).encode() + b"\n")
            os.fsync(fd)
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
    return events / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=4000, help="events per side")
    parser.add_argument("--appenders", type=int, default=64, help="concurrent runs")
    parser.add_argument("--dir", type=Path, default=None, help="folder on the disk to test")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.events < 1 or args.appenders < 1 or args.events < args.appenders:
        parser.error("--events and --appenders must be positive, events >= appenders")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-appends-") as tmp:
        raw = bench_raw(Path(tmp), args.events)
        # One run too: what a single run's stream costs, with no other run to share with.
        rows = []
        for appenders in sorted({1, args.appenders}):
            folder = Path(tmp) / f"store-{appenders}"
            folder.mkdir()
            rate, commits = asyncio.run(bench_store(folder, args.events, appenders))
            rows.append((appenders, rate, commits))
        folder = Path(tmp) / "awaited"
        folder.mkdir()
        awaited, awaited_commits = asyncio.run(bench_store(folder, args.events, 1, streams=False))
    result = BenchResult("appends", "python -m bench.appends " + " ".join(argv or sys.argv[1:]))
    print(f"raw write+fsync per event  : {raw:10.0f} events/s")
    for appenders, rate, commits in rows:
        print(
            f"machine store, {appenders:2d} appenders: {rate:10.0f} events/s "
            f"({args.events / max(commits, 1):.1f} events/commit), "
            f"ratio store/raw {rate / raw:.2f}x"
        )
        result.rows.append(
            Row(
                f"durable appends, {appenders} run(s)",
                rate,
                raw,
                "events/s",
                "write+fsync per event",
                better="higher",
                target=">= 1.0x" if appenders == 1 else ">= 10x at 64",
            )
        )
    print(
        f"  each append awaited, 1 run: {awaited:10.0f} events/s "
        f"({args.events / max(awaited_commits, 1):.1f} events/commit; "
        f"run stream / awaited {rows[0][1] / awaited:.2f}x)"
    )
    result.rows.append(
        Row(
            "durable appends, 1 run, each awaited",
            awaited,
            raw,
            "events/s",
            "write+fsync per event",
            better="higher",
        )
    )
    result.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
