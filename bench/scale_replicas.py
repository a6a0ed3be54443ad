"""How the control plane's work spreads over replicas, and what 100,000 machines need.

For each machine count N (full: 1,000, 3,000, 5,000; quick: 20) and replica
count R (full: 1, 2, 3; quick: 1, 2): R ``serve --cluster`` replicas of one
home (copies of it) on one folder store, with one nats-server, and N simulated
machines (``bench/connect.py``'s: the real join code, then one real
``ControlLink`` each, its own mutual-TLS connection and certificate), machine
``i`` linked to replica ``i mod R``. With every link up and heartbeating, per
replica (the means over the replicas):

- the links it holds (``agents_cp_machines_online``);
- its RSS per link held (KiB): its RSS with the links up less its RSS before
  they opened, over the links it holds;
- its CPU per heartbeat it serves (us) and its share of a core (%), over a
  window, less what it spends over an equal window before the links opened
  (its own periodic work: the lease, the self-check).

A point is held only if no link ended during the window: links that dropped
(no heartbeat heard for 3 intervals: a replica too busy to read them) and
came back are counted by ``agents_cp_disconnects_total``, and such a point is
left out, saying so in the note, as is one whose links did not all come up
within their deadline.

The machines are joined once, through the replicas in turn, as the points
grow (the join rate through the replicas is in the note), and kept: before
each R, a machine's ``link.json`` is pointed at the replica it belongs to
(as a DNS change would), because each start of a replica listens on a new
port. Links open 250 at a time, each wave up before the next: a machine's
first link commits its join (store writes), and 1,000 first links at once
on two cores kept store calls queued past their 5 s deadline.

**On paper** (:func:`extrapolate`): the CPU a replica spends per heartbeat it
serves is its own link's work plus, for each other replica, what grows with
it (the fit's second term: once the watch applying every link's presence
refresh; since machine entries are written only on link changes, docs/
controlplane.md, the replicas' own refreshes and noise); fitted over R at the
largest N as ``a + (R - 1) * b`` us, a fleet of F machines on n replicas at
the default heartbeat interval h costs each replica ``F / n / h * (a + (n -
1) * b)`` us per second, and ``F / n`` links' RSS. The smallest n within a
per-replica budget (1 core and 4 GiB) is the answer; none when the
per-other-replica term alone (``F / h * b``) is past the budget.

    .venv/bin/python -m bench.scale_control --replicas 1,2,3 --points 1000,3000,5000

(``bench/scale.py --part replicas`` runs the same.) Needs ``nats-server``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import statistics
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.connect import (
    TOKEN_USES,
    control_counts,
    control_samples,
    cpu_window,
    join_machines,
    open_links,
    raise_fd_limit,
    start_control,
)
from bench.results import Curve
from controlplane.cli.admin_types import NewJoinToken
from controlplane.cli.client import AdminClient
from controlplane.config import ControlConfig
from machine.link.identity import load_link, save_link
from tests.helpers.control_proc import ControlProc, start_serve, stop_serve, wait_serve
from tests.helpers.nats_proc import nats_binary, nats_server
from tests.helpers.poll import apoll_until

__all__ = [
    "FULL_COUNTS",
    "FULL_POINTS",
    "QUICK_COUNTS",
    "QUICK_POINTS",
    "Budget",
    "ReplicaPoint",
    "extrapolate",
    "replica_curves",
]

FULL_POINTS = (1000, 3000, 5000)
FULL_COUNTS = (1, 2, 3)
QUICK_POINTS = (20,)
QUICK_COUNTS = (1, 2)
#: Links opened at once (each wave up before the next; see the module doc).
WAVE = 250
#: Seconds a join token lives: past the longest full run's last join.
_TOKEN_TTL = 4 * 3600
#: The fleet the note extrapolates to.
FLEET = 100_000

UNITS = {
    "links_per_replica": "links",
    "rss_per_link": "KiB",
    "cpu_per_heartbeat": "us",
    "replica_cpu": "%",
}


@dataclass(frozen=True)
class Budget:
    """What one replica may use."""

    cores: float = 1.0
    gib: float = 4.0


@dataclass(frozen=True)
class ReplicaPoint:
    """One (machines, replicas) measurement; per-replica figures are means."""

    machines: int
    replicas: int
    links: float
    rss_per_link_kib: float
    us_per_heartbeat: float
    cpu_percent: float


@dataclass(frozen=True)
class _Settings:
    heartbeat: float
    window: float


def _settings(quick: bool) -> _Settings:
    # 2 s: 5,000 links' heartbeats (2,500/s) stay within what this bench's one
    # process can send and two cores can serve, with room for the replicas.
    return _Settings(heartbeat=1.0, window=3.0) if quick else _Settings(heartbeat=2.0, window=20.0)


def _default_heartbeat() -> float:
    """The control plane's default heartbeat interval (what a fleet runs at)."""
    (field,) = (f for f in dataclasses.fields(ControlConfig) if f.name == "heartbeat_interval")
    return float(field.default)  # type: ignore[arg-type]


class _Deployment:
    """One home (and its copies), one store, one nats-server; R replicas at a time."""

    def __init__(self, tmp: Path, first: ControlProc, nats_url: str, settings: _Settings) -> None:
        self.tmp = tmp
        self.first = first
        self.nats_url = nats_url
        self.settings = settings
        self.procs: list[ControlProc] = []
        self.joined = 0
        self.joins_per_s: dict[int, float] = {}
        self._tokens: list[NewJoinToken] = []
        self._account = ""

    def _home(self, i: int) -> ControlProc:
        if i == 0:
            return self.first
        home = self.tmp / f"cp-home{i}"
        if not home.exists():
            # A replica's home: a copy of the first's, made before it ever served.
            shutil.copytree(self.tmp / "cp-home-pristine", home)
        first = self.first
        return ControlProc(home, first.env, first.operator, first.ca_hash)

    def start(self, replicas: int) -> None:
        self.procs = [self._home(i) for i in range(replicas)]
        for cp in self.procs:
            start_serve(cp, ["--cluster", self.nats_url], wait=False)
        for cp in self.procs:
            wait_serve(cp)

    def stop(self) -> None:
        for cp in self.procs:
            stop_serve(cp)
        self.procs = []

    async def join_up_to(self, machines: int) -> None:
        """Join machines ``joined`` .. ``machines`` - 1 through the running replicas in turn."""
        if machines <= self.joined:
            return
        procs = self.procs
        first = procs[0]
        async with AdminClient(first.public, first.ca_pem, first.operator, timeout=30) as client:
            if not self._account:
                reply = await client.create_account(1, "bench")
                self._account = reply.account.account_id
            # Machine i joins with token i // TOKEN_USES: each one full, whatever the points.
            while len(self._tokens) * TOKEN_USES < machines:
                self._tokens.append(
                    await client.create_token(
                        self._account, ttl_seconds=_TOKEN_TTL, max_uses=TOKEN_USES
                    )
                )
        took = await join_machines(
            self._tokens,
            self.tmp,
            machines,
            first=self.joined,
            address=lambda i: procs[i % len(procs)].public,
        )
        self.joins_per_s[machines] = (machines - self.joined) / took
        self.joined = machines

    def point_links(self, machines: int) -> None:
        """Machine ``i`` links to replica ``i mod R`` (its ``link.json`` rewritten)."""
        for i in range(machines):
            folder = self.tmp / f"m{i:04d}"
            link = load_link(folder)
            address = self.procs[i % len(self.procs)].link
            if link.control_address != address or link.other_addresses:
                save_link(
                    folder,
                    dataclasses.replace(
                        link,
                        control_address=address,
                        other_addresses=(),
                        learned_addresses=frozenset(),
                    ),
                )


class NotHeld(Exception):
    """The replicas did not keep every link up through the window."""


def _ended(procs: list[ControlProc]) -> Counter[str]:
    """Links ended so far, by reason, over the replicas."""
    out: Counter[str] = Counter()
    for cp in procs:
        out += control_counts(cp, "agents_cp_disconnects_total", "reason")
    return out


async def _measure(deployment: _Deployment, machines: int) -> ReplicaPoint:
    settings, procs = deployment.settings, deployment.procs
    replicas = len(procs)
    pids = [cp.process.pid for cp in procs if cp.process is not None]
    await deployment.join_up_to(machines)
    deployment.point_links(machines)
    idle = await asyncio.gather(*(cpu_window(p, lambda: 0.0, settings.window) for p in pids))
    rss_before = [psutil.Process(p).memory_info().rss for p in pids]
    async with open_links(deployment.tmp, machines, wave=WAVE) as opened:
        await apoll_until(
            lambda: opened.connected() == machines,
            deadline=120 + machines / 20,
            what=f"{machines} links connected",
            step=0.1,
        )
        await asyncio.sleep(2 * settings.heartbeat)  # past the welcomes' first heartbeats
        links = [
            sum(v for _, v in control_samples(cp, "agents_cp_machines_online")) for cp in procs
        ]
        rss_after = [psutil.Process(p).memory_info().rss for p in pids]
        ended_before = _ended(procs)
        busy = await asyncio.gather(
            *(cpu_window(p, opened.heartbeats, settings.window) for p in pids)
        )
        ended = _ended(procs) - ended_before
    if ended.total():
        # Links that dropped (no heartbeat heard for 3 intervals) and came back:
        # the replicas did not hold this point, and the window measured that.
        reasons = ", ".join(f"{why} {n}" for why, n in sorted(ended.items()) if n)
        raise NotHeld(f"{ended.total()} links ended during the window ({reasons})")
    cpus = [
        max(0.0, cpu - idle_cpu * window / idle_s)
        for (cpu, _, window), (idle_cpu, _, idle_s) in zip(busy, idle, strict=True)
    ]
    beats = statistics.mean(b for _, b, _ in busy)  # every link's, in each window
    us = [
        cpu / (beats * n / machines) * 1e6 if beats and n else 0.0
        for cpu, n in zip(cpus, links, strict=True)
    ]
    kib = [
        (after - before) / n / 1024 if n else 0.0
        for before, after, n in zip(rss_before, rss_after, links, strict=True)
    ]
    return ReplicaPoint(
        machines=machines,
        replicas=replicas,
        links=statistics.mean(links),
        rss_per_link_kib=statistics.mean(kib),
        us_per_heartbeat=statistics.mean(us),
        cpu_percent=statistics.mean(c / w * 100 for c, (_, _, w) in zip(cpus, busy, strict=True)),
    )


async def _run(
    points: Sequence[int], counts: Sequence[int], settings: _Settings
) -> tuple[list[ReplicaPoint], list[str], dict[int, float]]:
    measured: list[ReplicaPoint] = []
    left_out: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-scale-replicas-") as tmp_name,
        nats_server(Path(tmp_name) / "nats") as nats,
    ):
        tmp = Path(tmp_name)
        first = start_control(tmp, settings.heartbeat, serve=False)
        shutil.copytree(first.home, tmp / "cp-home-pristine")
        deployment = _Deployment(tmp, first, nats.url, settings)
        for machines in sorted(points):
            for replicas in counts:
                try:
                    deployment.start(replicas)
                    try:
                        point = await _measure(deployment, machines)
                    finally:
                        deployment.stop()
                    measured.append(point)
                    print(_row(point), flush=True)  # a long run shows each point as it comes
                except SystemExit as e:
                    # open_links' deadline for a wave (it ends a lone bench): here, one point.
                    left_out.append(f"{machines} machines on {replicas} replica(s): {e}")
                except NotHeld as e:
                    left_out.append(f"{machines} machines on {replicas} replica(s): not held: {e}")
                except (AssertionError, TimeoutError, OSError, RuntimeError) as e:
                    left_out.append(f"{machines} machines on {replicas}: {type(e).__name__}: {e}")
    return measured, left_out, deployment.joins_per_s


def _fit(points: list[ReplicaPoint]) -> tuple[float, float]:
    """(a, b): us per heartbeat served = a + (R - 1) * b, least squares over R
    (b = 0 from a single R)."""
    if len({p.replicas for p in points}) < 2:
        return statistics.mean(p.us_per_heartbeat for p in points), 0.0
    slope, intercept = statistics.linear_regression(
        [p.replicas - 1 for p in points], [p.us_per_heartbeat for p in points]
    )
    return intercept, max(0.0, slope)


def extrapolate(
    points: list[ReplicaPoint], budget: Budget, fleet: int = FLEET, heartbeat: float = 0.0
) -> str:
    """The replicas ``fleet`` machines need within ``budget`` each, from the largest
    measured machine count (see the module doc); one line."""
    heartbeat = heartbeat or _default_heartbeat()
    top = max(p.machines for p in points)
    at_top = [p for p in points if p.machines == top]
    a, b = _fit(at_top)
    kib = max(p.rss_per_link_kib for p in at_top)
    per_s = fleet / heartbeat  # heartbeats per second, the whole fleet

    def cores(n: int) -> float:
        return per_s / n * (a + (n - 1) * b) * 1e-6

    def gib(n: int) -> float:
        return fleet / n * kib / 2**20

    basis = (
        f"{fleet:,} machines at the default {heartbeat:g} s heartbeat ({per_s:,.0f}/s), "
        f"measured at {top:,} machines: {a:.0f} us per heartbeat served + {b:.0f} us per "
        f"other replica, {kib:.0f} KiB per link; budget {budget.cores:g} core and "
        f"{budget.gib:g} GiB per replica"
    )
    for n in range(1, 1001):
        if cores(n) <= budget.cores and gib(n) <= budget.gib:
            return (
                f"on paper: {n} replicas of {fleet / n:,.0f} links, each {cores(n):.2f} core "
                f"and {gib(n):.1f} GiB ({basis})"
            )
    return (
        f"on paper: no replica count fits: the per-other-replica term alone costs each replica "
        f"{per_s * b * 1e-6:.2f} core ({basis})"
    )


def replica_curves(
    points: Sequence[int],
    counts: Sequence[int],
    *,
    quick: bool,
    budget: Budget | None = None,
    heartbeat: float | None = None,
) -> list[Curve]:
    """One curve per replica count (x: machines), the extrapolation in each note;
    ``heartbeat``: another interval than the default's (seconds)."""
    settings = _settings(quick)
    if heartbeat is not None:
        settings = dataclasses.replace(settings, heartbeat=heartbeat)
    if nats_binary() is None:
        raise RuntimeError("replicas: nats-server is not installed (apt-get install nats-server)")
    raise_fd_limit()
    print(_HEAD, flush=True)
    measured, left_out, joins = asyncio.run(_run(points, counts, settings))
    common = [
        f"folder store, one nats-server, heartbeat every {settings.heartbeat:g} s, windows of "
        f"{settings.window:g} s, links opened {WAVE} at a time; per-replica means",
        "joins through the replicas (16 at a time): "
        + ", ".join(f"{rate:.0f}/s up to {m:,}" for m, rate in sorted(joins.items())),
    ]
    if measured:
        common.append(extrapolate(measured, budget or Budget()))
    common += [f"left out: {why}" for why in left_out]
    curves = []
    for replicas in counts:
        mine = [p for p in measured if p.replicas == replicas]
        curves.append(
            Curve(
                name=f"control-replicas-{replicas}",
                x_label=f"machines ({replicas} replica{'s' if replicas > 1 else ''})",
                x=[float(p.machines) for p in mine],
                series={
                    "links_per_replica": [p.links for p in mine],
                    "rss_per_link": [p.rss_per_link_kib for p in mine],
                    "cpu_per_heartbeat": [p.us_per_heartbeat for p in mine],
                    "replica_cpu": [p.cpu_percent for p in mine],
                },
                units=dict(UNITS),
                note="; ".join(common),
            )
        )
    return curves


_HEAD = (
    f"{'replicas':>8} {'machines':>8} {'links each':>10} {'KiB/link':>9} "
    f"{'us/heartbeat':>12} {'% of a core':>11}"
)


def _row(p: ReplicaPoint) -> str:
    return (
        f"{p.replicas:>8} {p.machines:>8,} {p.links:>10,.0f} {p.rss_per_link_kib:>9.1f} "
        f"{p.us_per_heartbeat:>12.0f} {p.cpu_percent:>11.1f}"
    )


def points_table(curves: list[Curve]) -> str:
    """Every (replicas, machines) point as one row a person reads."""
    rows = [_HEAD]
    for curve in curves:
        replicas = int(curve.name.rsplit("-", 1)[1])
        s = curve.series
        for i, x in enumerate(curve.x):
            point = ReplicaPoint(
                machines=int(x),
                replicas=replicas,
                links=s["links_per_replica"][i],
                rss_per_link_kib=s["rss_per_link"][i],
                us_per_heartbeat=s["cpu_per_heartbeat"][i],
                cpu_percent=s["replica_cpu"][i],
            )
            rows.append(_row(point))
    return "\n".join(rows)
