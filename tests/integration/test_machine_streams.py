"""Slow readers against a real machine daemon: bounded memory, capped streams, quiet ends.

The bound this file holds the daemon to (docs/machine.md, "Streams"): a Replay
stream whose client never reads costs at most ``PER_STREAM_MIB`` of RSS with
events of 512 KiB, and the memory goes back once the streams are cancelled.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path

import grpc
import grpc.aio
import psutil
import pytest

from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from tests.helpers.machine_proc import MachineProc
from tests.helpers.poll import apoll_until

pytestmark = pytest.mark.integration

DEADLINE = 30.0
STREAMS = 50
EVENTS = 60
EVENT_BYTES = 512 * 1024
# Documented bound per never-read stream (measured: about 2 MiB).
PER_STREAM_MIB = 4
# "Falls back": within this much of the RSS before the streams were opened.
SETTLED_MIB = 40


def rss_mib(proc: MachineProc) -> float:
    assert proc.proc is not None
    return float(psutil.Process(proc.proc.pid).memory_info().rss) / 2**20


def add_large_events(data_dir: Path, agent_id: str, run_id: str) -> None:
    """Append EVENTS text deltas of EVENT_BYTES to the agent's conversation (daemon stopped)."""
    conn = sqlite3.connect(data_dir / "machine.db")
    try:
        with conn:
            last = conn.execute("SELECT last_seq FROM agents WHERE id = ?", (agent_id,)).fetchone()
            payload = json.dumps({"text": "x" * EVENT_BYTES})
            conn.executemany(
                "INSERT INTO events (agent_id, seq, run_id, kind, payload_json, time)"
                " VALUES (?, ?, ?, 'TEXT_DELTA', ?, ?)",
                [(agent_id, last[0] + 1 + i, run_id, payload, time.time()) for i in range(EVENTS)],
            )
            conn.execute(
                "UPDATE agents SET last_seq = last_seq + ? WHERE id = ?", (EVENTS, agent_id)
            )
    finally:
        conn.close()


async def test_never_read_replay_streams_are_bounded_capped_and_end_quietly(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / "machine.toml").write_text(f"max_streams_per_client = {STREAMS}\n")
    proc = MachineProc(data)
    with proc:
        async with grpc.aio.insecure_channel(proc.target) as channel:
            stub = pb_grpc.MachineServiceStub(channel)
            agent = await stub.CreateAgent(pb.CreateAgentRequest(name="a", folder=str(tmp_path)))
            first = [ev async for ev in stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="hi"))]
        assert proc.stop() == 0
        add_large_events(data, agent.id, first[0].run_id)
        proc.start()
        before = rss_mib(proc)

        channels = [grpc.aio.insecure_channel(proc.target) for _ in range(STREAMS + 1)]
        try:
            calls = [
                pb_grpc.MachineServiceStub(ch).Replay(pb.ReplayRequest(agent_id=agent.id))
                for ch in channels[:STREAMS]
            ]
            # Every stream has started sending (headers go out with its first event).
            await asyncio.wait_for(asyncio.gather(*(c.initial_metadata() for c in calls)), DEADLINE)
            # One more is over the per-client cap (every Unix-socket caller is one client).
            extra = pb_grpc.MachineServiceStub(channels[STREAMS]).Replay(
                pb.ReplayRequest(agent_id=agent.id)
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await asyncio.wait_for(extra.read(), DEADLINE)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limit of 50" in (refused.value.details() or "")

            # Memory over a window while nobody reads: the streams stay stuck.
            peak = before
            end = time.monotonic() + 3.0
            while time.monotonic() < end:
                peak = max(peak, rss_mib(proc))
                await asyncio.sleep(0.1)  # sampling interval of the measurement window
            bound = before + STREAMS * PER_STREAM_MIB
            assert peak < bound, f"RSS {peak:.0f} MiB, bound {bound:.0f} (from {before:.0f})"

            for call in calls:
                call.cancel()
        finally:
            for ch in channels:
                await ch.close()

        settled = before + SETTLED_MIB
        await apoll_until(
            lambda: rss_mib(proc) <= settled,
            deadline=DEADLINE,
            what="RSS back down",
            step=0.2,
            fail=lambda: AssertionError(f"RSS stayed {rss_mib(proc):.0f} MiB (from {before:.0f})"),
        )

        # The daemon still serves a whole replay afterwards.
        async with grpc.aio.insecure_channel(proc.target) as channel:
            stub = pb_grpc.MachineServiceStub(channel)
            count = 0
            async for _ in stub.Replay(pb.ReplayRequest(agent_id=agent.id)):
                count += 1
            assert count == len(first) + EVENTS
        assert proc.stop() == 0
    log = proc.log()
    assert "Traceback" not in log and "ExecuteBatchError" not in log
