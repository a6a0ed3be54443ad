"""A prompt's round trip against a bare ping, same daemon, same socket, same run.

    python -m bench.roundtrip [--prompts 200] [--json PATH]

It starts a real ``agents-machine serve`` (echo runtime, its metrics on a
loopback port) and, over one gRPC channel on its Unix socket, times:

- ping: the unary ``Status`` call (what any request over that socket costs);
- prompt: ``Prompt`` of a short text to an echo agent, from the call to the
  RUN_FINISHED event arriving (the run made durable: its row, RUN_STARTED,
  the deltas and RUN_FINISHED each committed with fsync before being sent);
- replay: ``Replay`` of that prompt's events (the same stream of messages
  with nothing run or committed: what gRPC alone costs for it).

Prints p50 and p90 of each, the ratio of the p50s, and the database commits
per prompt read from the daemon's own commit histogram (each commit is one
fsync of the WAL).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc.aio
import psutil

from bench.results import BenchResult, Row
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from tests.helpers.machine_proc import MachineProc
from tests.helpers.moto_server import free_port


def _commits(metrics_url: str) -> tuple[float, float]:
    """The daemon's commits so far and the seconds they took (its own histograms)."""
    page = urllib.request.urlopen(metrics_url, timeout=15).read().decode()

    def sample(name: str) -> float:
        found = re.search(rf"^{name} (\S+)$", page, re.M)
        return float(found.group(1)) if found else 0.0

    return (
        sample("agents_machine_db_commit_batch_size_count"),
        sample("agents_machine_db_commit_seconds_sum"),
    )


def _cpu(pid: int) -> float:
    """CPU seconds of process ``pid`` so far (user and system, every thread)."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q * 100) - 1] if len(values) > 1 else values[0]


async def _measure(
    proc: MachineProc, prompts: int, folder: Path, metrics_url: str
) -> dict[str, float]:
    async with grpc.aio.insecure_channel(proc.target) as channel:
        stub = pb_grpc.MachineServiceStub(channel)
        agent = await stub.CreateAgent(pb.CreateAgentRequest(name="bench", folder=str(folder)))
        # Warm both paths (the runtime's first start, the channel's first calls).
        for _ in range(5):
            await stub.Status(pb.StatusRequest())
            [ev async for ev in stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="warm"))]
        assert proc.proc is not None
        pid = proc.proc.pid
        pings: list[float] = []
        ping_cpu = _cpu(pid)
        for _ in range(prompts):
            start = time.perf_counter()
            await stub.Status(pb.StatusRequest())
            pings.append(time.perf_counter() - start)
        ping_cpu = _cpu(pid) - ping_cpu
        before = await asyncio.to_thread(_commits, metrics_url)
        prompt_cpu = _cpu(pid)
        trips: list[float] = []
        for i in range(prompts):
            start = time.perf_counter()
            async for ev in stub.Prompt(pb.PromptRequest(agent_id=agent.id, text=f"hello {i}")):
                if ev.kind == pb.RUN_FINISHED:
                    trips.append(time.perf_counter() - start)
        prompt_cpu = _cpu(pid) - prompt_cpu
        after = await asyncio.to_thread(_commits, metrics_url)
        # The same stream of events read back: what gRPC alone costs to stream a
        # finished prompt's events (no run, no commit).
        last = [ev async for ev in stub.Replay(pb.ReplayRequest(agent_id=agent.id, after_seq=0))]
        start_seq = last[-1].seq - sum(ev.run_id == last[-1].run_id for ev in last)
        replays: list[float] = []
        for _ in range(prompts):
            start = time.perf_counter()
            call = stub.Replay(pb.ReplayRequest(agent_id=agent.id, after_seq=start_seq))
            [ev async for ev in call]
            replays.append(time.perf_counter() - start)
    return {
        "replay_p50": statistics.median(replays),
        "replay_events": float(last[-1].seq - start_seq),
        "ping_p50": statistics.median(pings),
        "ping_p90": _quantile(pings, 0.9),
        "prompt_p50": statistics.median(trips),
        "prompt_mean": statistics.fmean(trips),
        "prompt_p90": _quantile(trips, 0.9),
        "commits_per_prompt": (after[0] - before[0]) / prompts,
        "commit_s_per_prompt": (after[1] - before[1]) / prompts,
        "ping_cpu": ping_cpu / prompts,
        "prompt_cpu": prompt_cpu / prompts,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=200, help="prompts and pings timed")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.prompts < 2:
        parser.error("--prompts must be at least 2")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="rt-", dir="/tmp") as tmp:
        proc = MachineProc(Path(tmp) / "data", "--metrics", f"127.0.0.1:{port}").start()
        try:
            f = asyncio.run(
                _measure(proc, args.prompts, Path(tmp), f"http://127.0.0.1:{port}/metrics")
            )
        finally:
            proc.stop()
    ratio = f["prompt_p50"] / f["ping_p50"]
    print(f"echo prompt round trip vs Status ping, {args.prompts} each, one Unix socket")
    print(
        f"Status ping             : p50 {f['ping_p50'] * 1e3:6.2f} ms, "
        f"p90 {f['ping_p90'] * 1e3:6.2f} ms"
    )
    print(
        f"prompt to RUN_FINISHED  : p50 {f['prompt_p50'] * 1e3:6.2f} ms, "
        f"p90 {f['prompt_p90'] * 1e3:6.2f} ms "
        f"({f['commits_per_prompt']:.1f} commits per prompt)"
    )
    print(
        f"Replay of its {f['replay_events']:.0f} events: p50 {f['replay_p50'] * 1e3:6.2f} ms "
        "(the same stream without running or committing anything)"
    )
    replay_ratio = f["replay_p50"] / f["ping_p50"]
    print(f"ratio prompt/ping p50 {ratio:.2f}x (replay/ping {replay_ratio:.2f}x)")
    where = _where_it_goes(f)
    print(where)
    result = BenchResult("roundtrip", "python -m bench.roundtrip " + " ".join(argv or sys.argv[1:]))
    result.rows.append(
        Row(
            "echo prompt to RUN_FINISHED, p50",
            f["prompt_p50"] * 1e3,
            f["ping_p50"] * 1e3,
            "ms",
            "unary Status ping, same socket",
            target="<= 2x",
        )
    )
    result.notes.append(f"{f['commits_per_prompt']:.1f} database commits (fsyncs) per prompt")
    result.notes.append(
        f"replaying the prompt's {f['replay_events']:.0f} events (gRPC streaming alone) takes"
        f" {f['replay_p50'] * 1e3:.2f} ms p50 = {f['replay_p50'] / f['ping_p50']:.2f}x the ping"
    )
    result.notes.append(where)
    result.write(args.json)
    return 0


def _where_it_goes(f: dict[str, float]) -> str:
    """Where a prompt's time goes, from the daemon's own figures: its commits' time
    (histogram sum) and its CPU per call, against the mean round trip."""
    commit_ms = f["commit_s_per_prompt"] * 1e3
    return (
        f"where a prompt's time goes (means): {f['prompt_mean'] * 1e3:.2f} ms per prompt, of"
        f" which its commits (fsync included) {commit_ms:.2f} ms; the daemon's CPU"
        f" {f['prompt_cpu'] * 1e3:.2f} ms per prompt vs {f['ping_cpu'] * 1e3:.2f} ms per ping"
    )


if __name__ == "__main__":
    sys.exit(main())
