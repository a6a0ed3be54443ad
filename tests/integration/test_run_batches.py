"""A run's events are committed in batches: SIGKILL in the middle of one loses
nothing a client was shown, and leaves no run with a hole in its events."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc.aio
import pytest

from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from tests.helpers.machine_proc import MachineProc
from tests.helpers.moto_server import free_port

pytestmark = pytest.mark.integration

AGENTS = 6
DEADLINE = 60.0


def _batches(metrics_url: str) -> tuple[float, float]:
    """(events-or-writes committed, commits) from the daemon's commit histogram."""
    page = urllib.request.urlopen(metrics_url, timeout=15).read().decode()
    total = re.search(r"^agents_machine_db_commit_batch_size_sum (\S+)$", page, re.M)
    count = re.search(r"^agents_machine_db_commit_batch_size_count (\S+)$", page, re.M)
    assert total and count, page[:2000]
    return float(total.group(1)), float(count.group(1))


async def test_sigkill_mid_batch_loses_no_event_a_client_saw(
    machine_proc: Callable[..., MachineProc], tmp_path: Path
) -> None:
    port = free_port()
    proc = machine_proc("--metrics", f"127.0.0.1:{port}").start()
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    channel = grpc.aio.insecure_channel(proc.target)
    stub = pb_grpc.MachineServiceStub(channel)
    seen: dict[str, list[pb.RunEvent]] = {}
    try:
        agents = [
            (await stub.CreateAgent(pb.CreateAgentRequest(name=f"a{i}", folder=str(tmp_path)))).id
            for i in range(AGENTS)
        ]

        async def prompt_forever(agent_id: str, n: int) -> None:
            # Half the agents stream a whole reply at once (a batch per run), half
            # pace it by a millisecond a delta (batches across runs).
            words = " ".join(f"w{n}-{i}" for i in range(40))
            text = words if n % 2 else f"/slow 1 {words}"
            got = seen.setdefault(agent_id, [])
            while True:
                async for ev in stub.Prompt(pb.PromptRequest(agent_id=agent_id, text=text)):
                    got.append(ev)

        tasks = [asyncio.create_task(prompt_forever(a, n)) for n, a in enumerate(agents)]
        try:
            # Kill once runs have been streaming a while and commits carry
            # several writes each: a batch is being built or committed now.
            end = time.monotonic() + DEADLINE
            while True:
                shown = sum(len(v) for v in seen.values())
                committed, commits = await asyncio.to_thread(_batches, metrics_url)
                if shown >= 400 and commits and committed / commits > 2:
                    break
                assert time.monotonic() < end, (shown, committed, commits)
                for task in tasks:
                    if task.done():
                        task.result()
                await asyncio.sleep(0.05)  # polling interval of the condition above
            proc.kill()  # SIGKILL while the runs stream
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await channel.close()

    proc.start()
    channel = grpc.aio.insecure_channel(proc.target)
    stub = pb_grpc.MachineServiceStub(channel)
    try:
        for agent_id, shown_events in seen.items():
            call = stub.Replay(pb.ReplayRequest(agent_id=agent_id, after_seq=0))
            stored = [ev async for ev in call]
            # No hole: seqs run 1..n, and everything a client was shown is stored as shown.
            assert [ev.seq for ev in stored] == list(range(1, len(stored) + 1))
            by_seq = {ev.seq: ev for ev in stored}
            for ev in shown_events:
                assert by_seq[ev.seq] == ev
            runs: dict[str, list[pb.RunEvent]] = {}
            for ev in stored:
                runs.setdefault(ev.run_id, []).append(ev)
            for run_events in runs.values():
                kinds = [ev.kind for ev in run_events]
                # A run killed before its RUN_STARTED committed ends with its error alone.
                assert kinds[0] == pb.RUN_STARTED or kinds == [pb.RUN_ERROR], kinds
                ends = [k for k in kinds if k in (pb.RUN_FINISHED, pb.RUN_ERROR)]
                assert ends == [kinds[-1]], kinds  # exactly one end, the last event
                if kinds[-1] == pb.RUN_FINISHED:
                    # Finished only with every delta of its reply stored.
                    prompt = run_events[0].run_started.prompt.removeprefix("/slow 1 ")
                    deltas = [e.text_delta.text for e in run_events if e.kind == pb.TEXT_DELTA]
                    reply = "".join(deltas)
                    assert reply == f"echo: {prompt}"
                else:
                    assert run_events[-1].run_error.code == pb.RUN_INTERRUPTED
    finally:
        await channel.close()
    assert proc.stop() == 0
