"""Benchmark the machine <-> control-plane link.

Run from the repository root::

    .venv/bin/python -m bench.connect [--streams 1000] [--window 10] [--heartbeat 1.0]

It starts one real ``agents-control`` process (folder store in a temp dir) and

(a) runs the real ``agents-machine join`` command ``--joins`` times and prints
    the time from starting the process to the machine being listed online
    (and from the join finishing to online);
(b) joins ``--streams`` machines in this process (the real join code: pin
    check, keys, CSR, Join), then opens one ``ControlLink`` per machine - each
    its own mutual-TLS connection with its own client certificate - and
    prints the control plane's RSS growth per stream and the CPU seconds it
    spends on heartbeats over a fixed window.

Everything is bounded: counts by flags, each phase by a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from prometheus_client import CollectorRegistry

from controlplane.cli.client import AdminClient
from machine.link.connection import ControlLink, LinkState
from machine.link.join import join_control_plane
from tests.helpers.control_proc import run_init, start_serve, stop_serve
from tests.helpers.poll import apoll_until

MACHINE_EXE = Path(sys.executable).parent / "agents-machine"


async def _wait(pred: Any, timeout: float, what: str, step: float = 0.02) -> float:
    start = time.monotonic()
    fail = f"bench: {what} not within {timeout}s"
    await apoll_until(pred, deadline=timeout, what=what, step=step, fail=lambda: SystemExit(fail))
    return time.monotonic() - start


async def _online_count(client: AdminClient, account_id: str) -> int:
    return sum(1 for m in await client.list_machines(account_id) if m.online)


async def bench_join(
    client: AdminClient, account_id: str, tmp: Path, joins: int
) -> list[tuple[float, float]]:
    """(a): real ``agents-machine join`` processes; (start->online, joined->online)."""
    out: list[tuple[float, float]] = []
    for i in range(joins):
        reply = await client.create_token(account_id)
        before = await _online_count(client, account_id)
        log = tmp / f"join-{i}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
        with log.open("wb") as f:
            started = time.monotonic()
            proc = subprocess.Popen(
                [
                    str(MACHINE_EXE),
                    "--data-dir",
                    str(tmp / f"join-{i}"),
                    "join",
                    reply.join_address,
                    "--token",
                    reply.token_value,
                    "--ca-hash",
                    reply.ca_hash,
                ],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
            )
        try:
            await _wait(lambda log=log: b"joined as machine" in log.read_bytes(), 30, "join")
            joined = time.monotonic()
            await _wait(_until_more(client, account_id, before), 30, "listed online")
            now = time.monotonic()
            out.append((now - started, now - joined))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
    return out


def _until_more(client: AdminClient, account_id: str, before: int) -> Any:
    async def check() -> bool:
        return await _online_count(client, account_id) > before

    return check


async def bench_streams(
    cp_pid: int,
    address: str,
    ca_hash: str,
    token: str,
    tmp: Path,
    streams: int,
    window: float,
) -> dict[str, float]:
    """(b): many in-process ControlLinks against the control plane process."""
    cp = psutil.Process(cp_pid)
    sem = asyncio.Semaphore(8)

    async def one(i: int) -> None:
        async with sem:
            await join_control_plane(
                data_dir=tmp / f"m{i:04d}",
                address=address,
                token=token,
                ca_hash=ca_hash,
                name=f"bench-{i}",
            )

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(streams)))
    join_s = time.monotonic() - t0
    await asyncio.sleep(1.0)  # let the control plane settle before the baseline
    rss_before = cp.memory_info().rss

    async def count() -> int:
        return 0

    registries = [CollectorRegistry() for _ in range(streams)]
    links = [
        ControlLink(
            data_dir=tmp / f"m{i:04d}",
            agent_count=count,
            version="bench",
            registry=registries[i],
            backoff_initial=0.5,
            backoff_max=5.0,
        )
        for i in range(streams)
    ]
    async with contextlib.AsyncExitStack() as stack:
        t0 = time.monotonic()
        for link in links:
            await stack.enter_async_context(link)
        await _wait(
            lambda: all(link.state is LinkState.CONNECTED for link in links),
            180,
            "all streams connected",
            step=0.1,
        )
        connect_s = time.monotonic() - t0
        await asyncio.sleep(2.0)  # steady state: welcome, first heartbeats
        rss_after = cp.memory_info().rss

        def beats() -> float:
            return sum(
                r.get_sample_value("agents_machine_link_heartbeats_total") or 0.0
                for r in registries
            )

        cpu0, beats0, w0 = sum(cp.cpu_times()[:2]), beats(), time.monotonic()
        await asyncio.sleep(window)  # the measurement window itself
        cpu1, beats1, w1 = sum(cp.cpu_times()[:2]), beats(), time.monotonic()
        still = sum(1 for link in links if link.state is LinkState.CONNECTED)
    return {
        "join_s": join_s,
        "connect_s": connect_s,
        "rss_before_mib": rss_before / 2**20,
        "rss_after_mib": rss_after / 2**20,
        "rss_per_stream_kib": (rss_after - rss_before) / streams / 1024,
        "window_s": w1 - w0,
        "cpu_s": cpu1 - cpu0,
        "heartbeats": beats1 - beats0,
        "connected_at_end": float(still),
    }


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-connect-") as tmp_name:
        tmp = Path(tmp_name)
        cp = run_init(
            tmp / "cp-home",
            f"file://{tmp / 'store'}",
            {},
            ["--heartbeat-interval", str(args.heartbeat)],
        )
        try:
            start_serve(cp)
            async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=30) as client:
                account_id = (await client.create_account(1, "bench")).account.account_id
                timings = await bench_join(client, account_id, tmp, args.joins)
                print(f"(a) join -> listed online, {len(timings)} real agents-machine processes:")
                for start_to_online, joined_to_online in timings:
                    print(
                        f"    process start -> online {start_to_online:.2f}s, "
                        f"join done -> online {joined_to_online:.2f}s"
                    )
                reply = await client.create_token(
                    account_id, ttl_seconds=3600, max_uses=args.streams
                )
            assert cp.process is not None
            figures = await bench_streams(
                cp.process.pid,
                reply.join_address,
                reply.ca_hash,
                reply.token_value,
                tmp,
                args.streams,
                args.window,
            )
        finally:
            stop_serve(cp)
    n = args.streams
    f = figures
    per_beat_us = f["cpu_s"] / f["heartbeats"] * 1e6 if f["heartbeats"] else float("nan")
    print(f"(b) {n} concurrent Connect streams (mutual TLS, one client cert each):")
    print(f"    {n} joins in {f['join_s']:.1f}s ({n / f['join_s']:.0f}/s)")
    print(
        f"    all connected in {f['connect_s']:.1f}s; {f['connected_at_end']:.0f} still up at end"
    )
    print(
        f"    control plane RSS {f['rss_before_mib']:.1f} -> {f['rss_after_mib']:.1f} MiB: "
        f"{f['rss_per_stream_kib']:.1f} KiB per stream"
    )
    print(
        f"    heartbeats: {f['heartbeats']:.0f} in {f['window_s']:.1f}s "
        f"(interval {args.heartbeat}s); control plane CPU {f['cpu_s']:.2f}s = "
        f"{100 * f['cpu_s'] / f['window_s']:.1f}% of a core, {per_beat_us:.0f} us per heartbeat"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000, help="concurrent Connect streams")
    parser.add_argument("--window", type=float, default=10.0, help="CPU window in seconds")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat interval (s)")
    parser.add_argument("--joins", type=int, default=3, help="real join processes for (a)")
    args = parser.parse_args(argv)
    if not 1 <= args.streams <= 5000 or not 1 <= args.window <= 120 or args.joins > 20:
        parser.error("--streams 1..5000, --window 1..120, --joins <= 20")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
