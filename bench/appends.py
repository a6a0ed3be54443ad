"""Durable run-event appends per second: the machine's store against raw fsync.

Both sides make the same events durable on the same disk in the same run:

- store: N concurrent appenders call ``tables.append_event`` through
  :class:`machine.storage.db.Database` (WAL, synchronous=FULL); group commit lets one
  fsync cover every append waiting at that moment;
- raw: the same JSON bytes written to a file one event at a time, each
  followed by ``os.fsync`` (what "one fsync per event" costs).

Usage: ``.venv/bin/python -m bench.appends [--events N] [--appenders K]``.
Prints the raw rate, then the store's with one appender and with K, each with
its ratio (store / raw).
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

from machine.models import EventKind
from machine.storage import tables
from machine.storage.db import Database


def payload(i: int) -> dict[str, str]:
    return {"text": f"delta {i:06d} " + "lorem ipsum " * 4}


async def bench_store(folder: Path, events: int, appenders: int) -> tuple[float, int]:
    commits: list[int] = []
    db = await Database.open(folder / "machine.db", on_commit=lambda n, s: commits.append(n))
    try:

        def make_agents(conn: sqlite3.Connection) -> None:
            for a in range(appenders):
                conn.execute(
                    "INSERT INTO agents (id, name, folder, runtime, state, origin_machine,"
                    " created_at, updated_at) VALUES (?, 'b', '/', 'echo', 'active', 'm', 0, 0)",
                    (f"ag_{a}",),
                )

        await db.write(make_agents)
        commits.clear()
        per = events // appenders

        async def appender(a: int) -> None:
            for i in range(per):
                data = payload(i)
                await db.write(
                    lambda c, d=data: tables.append_event(
                        c, f"ag_{a}", f"run_{a}", EventKind.TEXT_DELTA, d, time.time()
                    )
                )

        start = time.perf_counter()
        await asyncio.gather(*(appender(a) for a in range(appenders)))
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
    parser.add_argument("--events", type=int, default=2000, help="events per side")
    parser.add_argument("--appenders", type=int, default=32, help="concurrent appenders")
    parser.add_argument("--dir", type=Path, default=None, help="folder on the disk to test")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-appends-") as tmp:
        raw = bench_raw(Path(tmp), args.events)
        # One appender too: what a single run's stream costs, with nothing to batch.
        rows = []
        for appenders in sorted({1, args.appenders}):
            folder = Path(tmp) / f"store-{appenders}"
            folder.mkdir()
            rate, commits = asyncio.run(bench_store(folder, args.events, appenders))
            rows.append((appenders, rate, commits))
    print(f"raw write+fsync per event  : {raw:10.0f} events/s")
    for appenders, rate, commits in rows:
        print(
            f"machine store, {appenders:2d} appenders: {rate:10.0f} events/s "
            f"({args.events / max(commits, 1):.1f} events/commit), "
            f"ratio store/raw {rate / raw:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
