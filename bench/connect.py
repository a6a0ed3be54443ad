"""Benchmark the machine <-> control-plane link.

Run from the repository root::

    .venv/bin/python -m bench.connect [--streams 1000] [--window 10] [--heartbeat 1.0]

It starts one real ``agents-control`` process (folder store in a temp dir) and

(a) runs the real ``agents-machine join`` command ``--joins`` times and prints
    the time from starting the process to the machine being listed online
    (and from the join finishing to online);
(b) joins ``--streams`` machines in this process (the real join code: pin
    check, keys, CSR, Join; ``--join-concurrency`` at a time), then opens one
    ``ControlLink`` per machine all at once - each its own mutual-TLS
    connection with its own client certificate - and prints the control
    plane's RSS growth per stream, the CPU it spends per heartbeat over a fixed
    window, and how many connect attempts failed and were retried (timeouts
    counted apart);
(c) measures the same streams against a bare gRPC mutual-TLS stream server
    (``bench/bare_link.py``: the floor gRPC and TLS set) and prints ours over it.

With ``--json PATH`` the figures are also written as a ``bench.results.BenchResult``.
Everything is bounded: counts by flags, each phase by a deadline. The pieces
(start a control plane, join machines, open links, a CPU window) are what
``bench/scale_control.py`` measures its growth curve with.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from bench.bare_link import BareFigures, measure_bare
from bench.results import BenchResult, Row
from controlplane.cli.admin_types import NewJoinToken
from controlplane.cli.client import AdminClient
from machine.link.connection import ControlLink, LinkState
from machine.link.join import join_control_plane
from tests.helpers.control_proc import ControlProc, run_init, start_serve, stop_serve
from tests.helpers.poll import apoll_until

MACHINE_EXE = Path(sys.executable).parent / "agents-machine"
#: Joins in flight at once in (b), by default: a fleet being provisioned, not a
#: thundering herd (the join path has its own limits; see docs/controlplane.md).
JOIN_CONCURRENCY = 16
#: Error classes a failed connect attempt is counted as a timeout for: the welcome
#: did not come within the link's handshake timeout, or a call's deadline passed.
TIMEOUTS = frozenset({"TimeoutError", "DeadlineExceeded"})


async def _wait(pred: Any, timeout: float, what: str, step: float = 0.02) -> float:
    start = time.monotonic()
    fail = f"bench: {what} not within {timeout}s"
    await apoll_until(pred, deadline=timeout, what=what, step=step, fail=lambda: SystemExit(fail))
    return time.monotonic() - start


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit (each link is a socket
    here and one in the control plane, which inherits the limit); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def start_control(
    tmp: Path, heartbeat: float, settings: str = "", *, serve: bool = True
) -> ControlProc:
    """A fresh ``agents-control`` (init + serve, folder store under ``tmp``);
    ``settings``: TOML lines added to its config.toml before it serves
    (``serve=False``: init only)."""
    cp = run_init(
        tmp / "cp-home", f"file://{tmp / 'store'}", {}, ["--heartbeat-interval", str(heartbeat)]
    )
    if settings:
        with (cp.home / "config.toml").open("a") as config:
            config.write(settings + "\n")
    if serve:
        start_serve(cp)
    return cp


#: The most joins one token allows (controlplane.access.tokens.MAX_USES).
TOKEN_USES = 1000


async def create_tokens(client: AdminClient, account_id: str, joins: int) -> list[NewJoinToken]:
    """Tokens for ``joins`` joins into ``account_id`` (at most 1,000 each)."""
    return [
        await client.create_token(
            account_id, ttl_seconds=3600, max_uses=min(TOKEN_USES, joins - start)
        )
        for start in range(0, joins, TOKEN_USES)
    ]


async def new_account_tokens(cp: ControlProc, joins: int) -> tuple[str, list[NewJoinToken]]:
    """An account and tokens for ``joins`` joins into it."""
    async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=30) as client:
        account_id = (await client.create_account(1, "bench")).account.account_id
        return account_id, await create_tokens(client, account_id, joins)


async def join_machines(
    tokens: list[NewJoinToken],
    tmp: Path,
    count: int,
    *,
    concurrency: int = JOIN_CONCURRENCY,
    first: int = 0,
    address: Callable[[int], str] | None = None,
) -> float:
    """Join machines ``first`` .. ``count`` - 1 (data folders ``tmp/mNNNN``) with the
    real join code, ``concurrency`` at a time, 1,000 a token; the seconds it took.
    ``address(i)``: where machine ``i`` joins (default: the token's join address)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        token = tokens[i // TOKEN_USES]
        async with sem:
            await join_control_plane(
                data_dir=tmp / f"m{i:04d}",
                address=address(i) if address else token.join_address,
                token=token.token_value,
                ca_hash=token.ca_hash,
                name=f"bench-{i}",
            )

    started = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(first, count)))
    return time.monotonic() - started


class ConnectFailures(logging.Handler):
    """Counts the links' failed connect attempts by error class (from the line
    ``machine.link.connection`` logs for each: a WARNING for an outage's first,
    DEBUG for the others), and keeps them off the terminal."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.by_error: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        if "failed (attempt" in record.msg and isinstance(record.args, tuple):
            self.by_error[str(record.args[3])] += 1

    @property
    def timeouts(self) -> int:
        """Attempts that ended in a timeout."""
        return sum(n for error, n in self.by_error.items() if error in TIMEOUTS)

    @contextlib.contextmanager
    def counting(self) -> Iterator[ConnectFailures]:
        """Count while inside."""
        log = logging.getLogger("machine.link.connection")
        log.addHandler(self)
        propagate, log.propagate = log.propagate, False
        # The repeats are DEBUG lines: the logger must let them through to count them.
        level = log.level
        log.setLevel(logging.DEBUG)
        try:
            yield self
        finally:
            log.removeHandler(self)
            log.propagate = propagate
            log.setLevel(level)


@dataclass
class Links:
    """Open links and their machines' metrics."""

    links: list[ControlLink]
    registries: list[CollectorRegistry]
    failures: ConnectFailures = field(default_factory=ConnectFailures)

    def _sum(self, name: str) -> float:
        return sum(r.get_sample_value(name) or 0.0 for r in self.registries)

    def heartbeats(self) -> float:
        """Heartbeats sent so far, over every link."""
        return self._sum("agents_machine_link_heartbeats_total")

    def retries(self) -> int:
        """Connect attempts after each link's first."""
        return int(self._sum("agents_machine_link_reconnects_total"))

    def connected(self) -> int:
        """Links up now."""
        return sum(1 for link in self.links if link.state is LinkState.CONNECTED)


@contextlib.asynccontextmanager
async def open_links(
    tmp: Path, count: int, *, wave: int = 0, first: int = 0
) -> AsyncIterator[Links]:
    """Open the links of the machines :func:`join_machines` made (``first`` ..
    ``count`` - 1), all at once (or ``wave`` at a time, each wave up before the next
    opens); closed together on the way out (a clean goodbye each)."""

    async def no_agents() -> int:
        return 0

    registries = [CollectorRegistry() for _ in range(first, count)]
    links = [
        ControlLink(
            data_dir=tmp / f"m{i:04d}",
            agent_count=no_agents,
            version="bench",
            registry=registries[i - first],
        )
        for i in range(first, count)
    ]
    count = len(links)
    opened = Links(links, registries)
    with opened.failures.counting():
        try:
            step = wave or count
            for start in range(0, count, step):
                for link in links[start : start + step]:
                    await link.__aenter__()
                if start + step < count:
                    await _wait(
                        lambda end=start + step: all(
                            link.state is LinkState.CONNECTED for link in links[:end]
                        ),
                        120 + step / 10,
                        f"links up to {start + step}",
                        step=0.1,
                    )
            yield opened
        finally:
            await asyncio.gather(*(link.close() for link in links), return_exceptions=True)


def control_samples(cp: ControlProc, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples called ``name`` on the control plane's /metrics page now."""
    address = cp.serve_info["metrics"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=15) as reply:
        text = reply.read().decode()
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def control_counts(cp: ControlProc, name: str, label: str) -> Counter[str]:
    """A counter of the control plane's, summed by one label."""
    out: Counter[str] = Counter()
    for labels, value in control_samples(cp, name):
        out[labels[label]] += int(value)
    return out


async def cpu_window(
    pid: int, heartbeats: Callable[[], float], window: float
) -> tuple[float, float, float]:
    """(CPU seconds of process ``pid``, heartbeats sent, seconds) over ``window``."""
    proc = psutil.Process(pid)
    cpu0, beats0, w0 = sum(proc.cpu_times()[:2]), heartbeats(), time.monotonic()
    await asyncio.sleep(window)  # the measurement window itself
    cpu1, beats1, w1 = sum(proc.cpu_times()[:2]), heartbeats(), time.monotonic()
    return cpu1 - cpu0, beats1 - beats0, w1 - w0


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


async def _online_count(client: AdminClient, account_id: str) -> int:
    return sum(1 for m in await client.list_machines(account_id) if m.online)


def _until_more(client: AdminClient, account_id: str, before: int) -> Any:
    async def check() -> bool:
        return await _online_count(client, account_id) > before

    return check


@dataclass(frozen=True)
class StreamFigures:
    """What (b) measured."""

    streams: int
    join_s: float
    join_cpu_s: float
    """The control plane's CPU over the joins (every thread of it)."""
    connect_s: float
    rss_before: int
    rss_after: int
    window_s: float
    cpu_s: float
    heartbeats: float
    connected_at_end: int
    retries: int
    failures: dict[str, int]
    ended: dict[str, int]
    """Links the control plane ended while they were up, by reason."""

    @property
    def rss_per_stream_kib(self) -> float:
        return (self.rss_after - self.rss_before) / self.streams / 1024

    @property
    def ms_per_join(self) -> float:
        """The control plane's CPU per join: what bounds its join rate (one core,
        as its threads share one interpreter lock), whoever runs the joining side."""
        return self.join_cpu_s / self.streams * 1e3

    @property
    def us_per_heartbeat(self) -> float:
        return self.cpu_s / self.heartbeats * 1e6 if self.heartbeats else float("nan")

    @property
    def timeouts(self) -> int:
        return sum(n for error, n in self.failures.items() if error in TIMEOUTS)


async def bench_streams(
    cp: ControlProc,
    tokens: list[NewJoinToken],
    tmp: Path,
    streams: int,
    window: float,
    concurrency: int,
) -> StreamFigures:
    """(b): many in-process ControlLinks against the control plane process."""
    assert cp.process is not None
    proc = psutil.Process(cp.process.pid)
    cpu_before = sum(proc.cpu_times()[:2])
    join_s = await join_machines(tokens, tmp, streams, concurrency=concurrency)
    join_cpu_s = sum(proc.cpu_times()[:2]) - cpu_before
    await asyncio.sleep(1.0)  # let the control plane settle before the baseline
    rss_before = proc.memory_info().rss
    ended_before = control_counts(cp, "agents_cp_disconnects_total", "reason")
    async with open_links(tmp, streams) as opened:
        connect_s = await _wait(
            lambda: opened.connected() == streams, 180, "all streams connected", step=0.1
        )
        await asyncio.sleep(2.0)  # steady state: welcome, first heartbeats
        rss_after = proc.memory_info().rss
        cpu_s, beats, window_s = await cpu_window(proc.pid, opened.heartbeats, window)
        still = opened.connected()
        retries, failures = opened.retries(), dict(opened.failures.by_error)
        ended = control_counts(cp, "agents_cp_disconnects_total", "reason") - ended_before
    return StreamFigures(
        streams=streams,
        join_s=join_s,
        join_cpu_s=join_cpu_s,
        connect_s=connect_s,
        rss_before=rss_before,
        rss_after=rss_after,
        window_s=window_s,
        cpu_s=cpu_s,
        heartbeats=beats,
        connected_at_end=still,
        retries=retries,
        failures=failures,
        ended={reason: n for reason, n in ended.items() if n},
    )


async def main_async(args: argparse.Namespace) -> int:
    raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="bench-connect-") as tmp_name:
        tmp = Path(tmp_name)
        cp = start_control(tmp, args.heartbeat)
        try:
            async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=30) as client:
                account_id = (await client.create_account(1, "bench")).account.account_id
                timings = await bench_join(client, account_id, tmp, args.joins)
                print(f"(a) join -> listed online, {len(timings)} real agents-machine processes:")
                for start_to_online, joined_to_online in timings:
                    print(
                        f"    process start -> online {start_to_online:.2f}s, "
                        f"join done -> online {joined_to_online:.2f}s"
                    )
                tokens = await create_tokens(client, account_id, args.streams)
            f = await bench_streams(
                cp, tokens, tmp, args.streams, args.window, args.join_concurrency
            )
        finally:
            stop_serve(cp)
    bare = await measure_bare(args.streams, args.heartbeat, args.window) if args.bare else None
    _print(args, f, bare)
    _result(args, timings, f, bare).write(args.json)
    return 0


def _print(args: argparse.Namespace, f: StreamFigures, bare: BareFigures | None) -> None:
    n = f.streams
    print(f"(b) {n} concurrent Connect streams (mutual TLS, one client cert each):")
    print(
        f"    {n} joins in {f.join_s:.1f}s ({n / f.join_s:.0f}/s, "
        f"{args.join_concurrency} at a time); control plane CPU {f.ms_per_join:.1f} ms per join "
        f"(at most {_per(1e3, f.ms_per_join)} per second on one core)"
    )
    print(f"    all connected in {f.connect_s:.1f}s; {f.connected_at_end} still up at end")
    others = ", ".join(f"{e} {k}" for e, k in sorted(f.failures.items())) or "none"
    ended = ", ".join(f"{e} {k}" for e, k in sorted(f.ended.items())) or "none"
    print(
        f"    connect retries {f.retries}: timeouts {f.timeouts} (failed attempts: {others}; "
        f"links the control plane ended: {ended})"
    )
    print(
        f"    control plane RSS {f.rss_before / 2**20:.1f} -> {f.rss_after / 2**20:.1f} MiB: "
        f"{f.rss_per_stream_kib:.1f} KiB per stream"
    )
    print(
        f"    heartbeats: {f.heartbeats:.0f} in {f.window_s:.1f}s "
        f"(interval {args.heartbeat}s); control plane CPU {f.cpu_s:.2f}s = "
        f"{100 * f.cpu_s / f.window_s:.1f}% of a core, {f.us_per_heartbeat:.0f} us per heartbeat"
    )
    if bare is not None:
        print(f"(c) the same {n} streams to a bare gRPC mutual-TLS stream server:")
        print(
            f"    {bare.rss_per_stream_kib:.1f} KiB per stream, "
            f"{bare.us_per_heartbeat:.0f} us per heartbeat"
        )
        memory = _ratio(f.rss_per_stream_kib, bare.rss_per_stream_kib)
        cpu = _ratio(f.us_per_heartbeat, bare.us_per_heartbeat)
        print(f"    ratio control plane/bare: memory {memory}, CPU per heartbeat {cpu}")


def _ratio(ours: float, base: float) -> str:
    # A tiny run can measure no CPU at all (the clock ticks every 10 ms).
    return f"{ours / base:.2f}x" if base > 0 else "n/a"


def _per(amount: float, cost: float) -> str:
    """How many ``cost`` fit in ``amount`` (n/a when nothing was measured)."""
    return f"{amount / cost:.0f}" if cost > 0 else "n/a"


def _result(
    args: argparse.Namespace,
    timings: list[tuple[float, float]],
    f: StreamFigures,
    bare: BareFigures | None,
) -> BenchResult:
    result = BenchResult(bench="connect", command="python -m bench.connect " + " ".join(args.argv))
    if bare is not None:
        floor = "bare gRPC mutual-TLS stream server"
        result.rows += [
            Row(
                "memory per machine link (control plane RSS)",
                f.rss_per_stream_kib,
                bare.rss_per_stream_kib,
                "KiB",
                floor,
                target="<= 64 KiB",
            ),
            Row(
                "control-plane CPU per heartbeat",
                f.us_per_heartbeat,
                bare.us_per_heartbeat,
                "us",
                floor,
                target="<= 100 us",
            ),
        ]
    n = f.streams
    result.notes += [
        f"{n} joins in {f.join_s:.1f} s: {n / f.join_s:.0f} joins/s "
        f"({args.join_concurrency} at a time; target >= 100/s); control plane CPU "
        f"{f.ms_per_join:.1f} ms per join",
        f"{n} links opened at once: all connected in {f.connect_s:.1f} s, "
        f"{f.retries} connect retries, {f.timeouts} timeouts (target: none)",
        f"heartbeat every {args.heartbeat:g} s, CPU over {f.window_s:.1f} s",
        *(f"real join process: start -> online {a:.2f} s" for a, _ in timings),
    ]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000, help="concurrent Connect streams")
    parser.add_argument("--window", type=float, default=10.0, help="CPU window in seconds")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat interval (s)")
    parser.add_argument("--joins", type=int, default=3, help="real join processes for (a)")
    parser.add_argument(
        "--join-concurrency", type=int, default=JOIN_CONCURRENCY, help="joins in flight in (b)"
    )
    parser.add_argument(
        "--no-bare", dest="bare", action="store_false", help="skip (c), the bare gRPC baseline"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here (bench.results)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= args.streams <= 5000 or not 1 <= args.window <= 120 or args.joins > 20:
        parser.error("--streams 1..5000, --window 1..120, --joins <= 20")
    if not 1 <= args.join_concurrency <= 256:
        parser.error("--join-concurrency 1..256")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
