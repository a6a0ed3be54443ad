"""How long a daemon takes from its start to its first answer, as its data grows.

Machine: one data folder is grown step by step with ``bench/backup.py``'s
conversations (1,000 agents; ``--mb`` 100, 400, 800 and 1,500 MB of text give
machine.db files of about 0.15 to 2.2 GB). At each size a real
``agents-machine serve`` is timed from its process start to the first answer of
the ``Status`` RPC on its socket (polled every 10 ms), four ways:

- after a clean stop (SIGTERM): the file carries the clean-stop mark and the
  start skips the ``quick_check`` (machine.storage.clean_stop);
- after an unclean stop (SIGKILL): the start reads every page with
  ``quick_check`` first, which is what every start did before the mark;

each warm (the file read through just before) and cold (the page cache dropped
first, as after a reboot: ``/proc/sys/vm/drop_caches`` when writable, else each
of the data folder's files evicted with ``posix_fadvise``). The baseline is the
same start of an empty data folder in the same run; the ratio says how much
the start grew with the data. The daemon's own split of the largest start
(``machine open in ... s (...)``, one line in its log) is printed too.

Control plane: a real ``agents-control`` (folder store) with N machines joined
(10, 100, 1,000, 3,000; each linked once after its join, as its daemon would,
which confirms the join), stopped with SIGTERM and started again, timed from its
process start to the first answer of an admin ``GetAccount`` (warm and cold),
against the same start with one account and no machine.

Usage::

    .venv/bin/python -m bench.start [--quick] [--part machine|control|all]
        [--mb 100,400,800,1500] [--machines 10,100,1000,3000] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import grpc
import grpc.aio

from bench.backup import EVENT_BYTES, EVENTS_PER_RUN, _fill, _make_data, _paragraphs
from bench.connect import (
    join_machines,
    new_account_tokens,
    open_links,
    raise_fd_limit,
    start_control,
)
from bench.results import BenchResult, Curve
from controlplane.cli.admin_types import NewJoinToken
from controlplane.cli.client import AdminClient
from machine.link.connection import LinkState
from machine.storage.db import Database
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from tests.helpers.control_proc import ControlProc, start_serve, stop_serve
from tests.helpers.poll import apoll_until

ROOT = Path(__file__).resolve().parents[1]
MACHINE_EXE = Path(sys.executable).parent / "agents-machine"

MB_FULL: Final = (100, 400, 800, 1500)
MB_QUICK: Final = (1, 2, 4, 8)
AGENTS_FULL: Final = 1000
AGENTS_QUICK: Final = 20
MACHINES_FULL: Final = (10, 100, 1000, 3000)
MACHINES_QUICK: Final = (2, 4, 8, 16)
#: A start that has not answered by then is a failure of the bench, not a figure.
START_DEADLINE = 600.0
WAYS: Final = ("clean warm", "clean cold", "unclean warm", "unclean cold")


# -- the page cache -----------------------------------------------------------


def drop_caches(folder: Path, *, everything: bool) -> str:
    """Forget what the page cache holds: everything (as a reboot does) when asked
    and allowed, else every file under ``folder`` (``--quick``: the smoke test runs
    beside other tests). Returns which was done."""
    subprocess.run(["sync"], check=True)
    if everything:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "drop_caches"
        except OSError:
            pass
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "posix_fadvise"


def warm(folder: Path) -> None:
    """Read every file under ``folder`` through the page cache."""
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                while f.read(1 << 20):
                    pass


# -- the machine --------------------------------------------------------------


@dataclass
class Started:
    seconds: float
    steps: str


class Machine:
    """One data folder and the daemon serving it, started and stopped on demand."""

    def __init__(self, data: Path, *, everything: bool) -> None:
        self.data = data
        self.everything = everything
        self.socket = data / "machine.sock"
        self.log = data.parent / f"{data.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Started:
        """Start ``serve``; the seconds until ``Status`` answered, and the daemon's
        own split of its start."""
        before = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as log:
            began = time.monotonic()
            self.proc = subprocess.Popen(
                [str(MACHINE_EXE), "--data-dir", str(self.data), "serve", "--no-background"],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        asyncio.run(self._first_answer())
        seconds = time.monotonic() - began
        with self.log.open("rb") as f:
            f.seek(before)
            found = re.search(rb"machine open in ([^\n]*)", f.read())
        return Started(seconds, found.group(1).decode() if found else "")

    async def _first_answer(self) -> None:
        deadline = time.monotonic() + START_DEADLINE
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise SystemExit(f"bench: agents-machine exited early; see {self.log}")
            if time.monotonic() > deadline:
                raise SystemExit(f"bench: no Status answer within {START_DEADLINE} s")
            if self.socket.exists():
                async with grpc.aio.insecure_channel(f"unix://{self.socket}") as channel:
                    try:
                        await pb_grpc.MachineServiceStub(channel).Status(
                            pb.StatusRequest(), timeout=5
                        )
                        return
                    except grpc.aio.AioRpcError:
                        pass
            await asyncio.sleep(0.01)

    def stop(self, *, clean: bool) -> None:
        assert self.proc is not None
        if clean:
            self.proc.terminate()
        else:
            self.proc.kill()
        code = self.proc.wait(timeout=120)
        if clean and code != 0:
            raise SystemExit(f"bench: agents-machine stopped with {code}; see {self.log}")
        self.proc = None

    def measure(self, how: str) -> tuple[dict[str, float], str, str]:
        """The four starts (``WAYS``), how the cache was dropped, and the daemon's
        split of the unclean cold start."""
        figures: dict[str, float] = {}
        split = ""
        for way in WAYS:
            clean, cold = way.startswith("clean"), way.endswith("cold")
            # The stop before this start decides its way: start, then stop that way.
            self.start()
            self.stop(clean=clean)
            if cold:
                how = drop_caches(self.data, everything=self.everything)
            else:
                warm(self.data)
            started = self.start()
            figures[way] = started.seconds
            if way == "unclean cold":
                split = started.steps
            self.stop(clean=True)
        return figures, how, split


async def _grow(data: Path, agents: list[str], mb: int, step: int) -> None:
    """Add about ``mb`` MB of conversation text over ``agents``."""
    runs_each = max(1, (mb * 1024 * 1024) // (len(agents) * EVENTS_PER_RUN * EVENT_BYTES))
    pool = _paragraphs(20_000, 10 + step)
    db = await Database.open(data / "machine.db")
    try:
        for first in range(0, len(agents), 50):
            part = agents[first : first + 50]
            await db.write(lambda c, part=part: _fill(c, part, runs_each, pool, f"g{step}_"))
    finally:
        await db.close()


def machine_curve(
    mbs: tuple[int, ...], agents: int, work: Path, *, everything: bool
) -> tuple[Curve, list[str]]:
    notes: list[str] = []
    empty = Machine(work / "empty", everything=everything)
    empty.data.mkdir(mode=0o700)
    base, how, _ = empty.measure("")
    data = work / "machine"
    ids = asyncio.run(_make_data(data, agents, mbs[0]))
    machine = Machine(data, everything=everything)
    x: list[float] = []
    series: dict[str, list[float]] = {way: [] for way in WAYS}
    done = mbs[0]
    for step, mb in enumerate(mbs):
        if mb > done:
            asyncio.run(_grow(data, ids, mb - done, step))
            done = mb
        size = (data / "machine.db").stat().st_size
        figures, how, split = machine.measure(how)
        x.append(size / 2**20)
        line = []
        for way in WAYS:
            series[way].append(figures[way])
            line.append(f"{way} {figures[way]:.2f} s ({figures[way] / base[way]:.1f}x empty)")
        print(f"  machine.db {size / 2**20:,.0f} MiB: " + ", ".join(line), flush=True)
    notes.append(
        "empty data folder (baseline): "
        + ", ".join(f"{way} {base[way]:.2f} s" for way in WAYS)
        + f"; cold = caches dropped with {how}"
    )
    notes.append(f"largest unclean cold start, the daemon's own split: machine open in {split}")
    curve = Curve(
        name="machine-start",
        x_label="machine.db (MiB)",
        x=x,
        series={f"start, {way}": series[way] for way in WAYS},
        units={f"start, {way}": "s" for way in WAYS},
        note=notes[0],
    )
    return curve, notes


# -- the control plane --------------------------------------------------------


@dataclass
class ControlStarts:
    machines: int
    objects: int
    figures: dict[str, float] = field(default_factory=dict)


async def _first_admin_answer(cp: ControlProc, account_id: str) -> None:
    deadline = time.monotonic() + START_DEADLINE
    while True:
        try:
            async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=5) as client:
                await client.get_account(account_id)
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.01)


def _control_start(
    cp: ControlProc, account_id: str, cold: bool, store: Path, everything: bool
) -> float:
    stop_serve(cp)
    if cold:
        drop_caches(store, everything=everything)
    else:
        warm(store)
    began = time.monotonic()
    start_serve(cp)
    asyncio.run(_first_admin_answer(cp, account_id))
    return time.monotonic() - began


def control_curve(
    points: tuple[int, ...], work: Path, *, everything: bool
) -> tuple[Curve, list[str]]:
    raise_fd_limit()
    cp = start_control(work, heartbeat=5.0)
    store = work / "store"
    try:
        account_id, tokens = asyncio.run(new_account_tokens(cp, max(points)))
        base = {
            "warm": _control_start(cp, account_id, False, store, everything),
            "cold": _control_start(cp, account_id, True, store, everything),
        }
        rows: list[ControlStarts] = []
        joined = 0
        for n in points:
            # Each start listens on a new port: join at the current one.
            here = [dataclasses.replace(t, join_address=cp.public) for t in tokens]
            asyncio.run(_join_more(here, work, joined, n))
            joined = n
            objects = sum(1 for p in store.rglob("*") if p.is_file())
            row = ControlStarts(n, objects)
            for way in ("warm", "cold"):
                row.figures[way] = _control_start(cp, account_id, way == "cold", store, everything)
            rows.append(row)
            print(
                f"  {n} machines ({objects} objects): "
                + ", ".join(
                    f"{way} {row.figures[way]:.2f} s ({row.figures[way] / base[way]:.1f}x none)"
                    for way in ("warm", "cold")
                ),
                flush=True,
            )
    finally:
        stop_serve(cp)
    note = (
        f"one account, no machine (baseline): warm {base['warm']:.2f} s, cold {base['cold']:.2f} s"
    )
    curve = Curve(
        name="control-start",
        x_label="machines joined",
        x=[float(r.machines) for r in rows],
        series={
            "start, warm": [r.figures["warm"] for r in rows],
            "start, cold": [r.figures["cold"] for r in rows],
            "store objects": [float(r.objects) for r in rows],
        },
        units={"start, warm": "s", "start, cold": "s", "store objects": ""},
        note=note,
    )
    return curve, [note]


async def _join_more(tokens: list[NewJoinToken], work: Path, have: int, want: int) -> None:
    """Join machines ``have`` .. ``want`` - 1 (their folders are numbered on), then link
    each once, as a real machine's daemon does right after its join: that confirms
    the join (a join never confirmed is an intent the next start resolves)."""
    await join_machines(tokens, work / "machines", want, first=have)
    async with open_links(work / "machines", want, first=have, wave=500) as opened:
        await apoll_until(
            lambda: all(link.state is LinkState.CONNECTED for link in opened.links),
            deadline=120 + (want - have) / 10,
            what="every new machine linked once",
            step=0.1,
        )


def _points(text: str) -> tuple[int, ...]:
    try:
        points = tuple(sorted(int(p) for p in text.split(",")))
    except ValueError:
        raise SystemExit(f"bench: {text!r} is not a list of numbers like 10,100") from None
    if not points or points[0] < 1:
        raise SystemExit(f"bench: {text!r}: every point must be at least 1")
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a minute or two)")
    parser.add_argument("--part", choices=("machine", "control", "all"), default="all")
    parser.add_argument("--mb", help="MB of text at each machine point, e.g. 100,400")
    parser.add_argument("--machines", help="machines joined at each control point, e.g. 10,100")
    parser.add_argument("--json", type=Path, help="write the figures here (bench/results.py)")
    args = parser.parse_args(argv)
    mbs = _points(args.mb) if args.mb else MB_QUICK if args.quick else MB_FULL
    machines = (
        _points(args.machines) if args.machines else MACHINES_QUICK if args.quick else MACHINES_FULL
    )
    result = BenchResult("start", "python -m bench.start" + (" --quick" if args.quick else ""))
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp:
        work = Path(tmp)
        if args.part in ("machine", "all"):
            print("machine: start to the first Status answer, against machine.db's size")
            (work / "m").mkdir()
            agents = AGENTS_QUICK if args.quick else AGENTS_FULL
            curve, notes = machine_curve(mbs, agents, work / "m", everything=not args.quick)
            result.curves.append(curve)
            result.notes.extend(notes)
            for note in notes:
                print("  " + note)
        if args.part in ("control", "all"):
            print("control plane: start to the first admin answer, against machines joined")
            (work / "c").mkdir()
            curve, notes = control_curve(machines, work / "c", everything=not args.quick)
            result.curves.append(curve)
            result.notes.extend(notes)
            for note in notes:
                print("  " + note)
    result.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
