"""The real machine daemon drives the fake ACP agent across a daemon crash.

A run paused on a permission request must survive SIGKILL of the daemon: after
a restart it is still waiting, the person answers (through the RPC, or through
the CLI), and the run resumes to RUN_FINISHED with every event stored once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from tests.helpers.machine_proc import AGENTS_MACHINE, MachineProc, run_cli
from tests.helpers.poll import apoll_until

pytestmark = pytest.mark.integration


ROOT = Path(__file__).resolve().parents[2]
FAKE_AGENT = ROOT / "tests" / "helpers" / "fake_acp_agent.py"
DEADLINE = 30.0


class Setup:
    def __init__(self, tmp_path: Path) -> None:
        self.data_dir = tmp_path / "d"
        self.work = tmp_path / "work"
        self.work.mkdir()
        self.state = tmp_path / "fake"
        self.state.mkdir()
        self.daemon = MachineProc(self.data_dir)

    def agent_events(self) -> list[dict[str, Any]]:
        path = self.state / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    def kill_leftover_agents(self) -> None:
        # Fake agents exit when their stdin closes; make sure of it, by pid.
        for pid in {e["pid"] for e in self.agent_events()}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    # The test command installs the project: a missing script is a broken install.
    assert AGENTS_MACHINE.exists(), "agents-machine missing: run .venv/bin/pip install -e ."
    s = Setup(tmp_path)
    try:
        yield s
    finally:
        s.daemon.kill()
        s.kill_leftover_agents()


@contextlib.asynccontextmanager
async def stub_for(daemon: MachineProc) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(daemon.target) as channel:
        yield pb_grpc.MachineServiceStub(channel)


async def replay(stub: Any, agent_id: str) -> list[Any]:
    events = []
    async for ev in stub.Replay(pb.ReplayRequest(agent_id=agent_id, after_seq=0), timeout=10):
        events.append(ev)
    return events


async def wait_state(stub: Any, run_id: str, state: int) -> Any:
    async def reached() -> Any:
        run = await stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=5)
        return run if run.state == state else None

    return await apoll_until(reached, deadline=DEADLINE, what=f"run state {state}", step=0.05)


@pytest.mark.parametrize("answer_with", ["rpc", "cli"])
async def test_permission_pending_across_daemon_kill(setup: Setup, answer_with: str) -> None:
    daemon = setup.daemon
    await asyncio.to_thread(daemon.start)
    settings = {"command": [sys.executable, str(FAKE_AGENT), "--state-dir", str(setup.state)]}
    async with stub_for(daemon) as stub:
        agent = await stub.CreateAgent(
            pb.CreateAgentRequest(
                name="acp agent",
                folder=str(setup.work),
                runtime="acp",
                settings_json=json.dumps(settings),
            ),
            timeout=10,
        )
        request = None
        call = stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="/tool write"), timeout=30)
        async for ev in call:
            if ev.kind == pb.PERMISSION_REQUEST:
                request = ev
                break
        call.cancel()
        assert request is not None
        run_id = request.run_id
        pending = request.permission_request
        assert pending.request_id == "call-0-write"
        assert [o.option_id for o in pending.options] == [
            "allow-once",
            "allow-always",
            "reject-once",
        ]
        await wait_state(stub, run_id, pb.RUN_STATE_WAITING_PERMISSION)

    daemon.kill()
    await asyncio.to_thread(daemon.start)
    async with stub_for(daemon) as stub:
        run = await stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=5)
        assert run.state == pb.RUN_STATE_WAITING_PERMISSION
        runs = await stub.ListRuns(pb.ListRunsRequest(agent_id=agent.id), timeout=5)
        assert [(r.id, r.state) for r in runs.runs] == [(run_id, pb.RUN_STATE_WAITING_PERMISSION)]
        before = await replay(stub, agent.id)
        assert before[-1].kind == pb.PERMISSION_REQUEST
        assert all(ev.kind != pb.RUN_ERROR for ev in before)

        if answer_with == "rpc":
            await stub.AnswerPermission(
                pb.AnswerPermissionRequest(
                    run_id=run_id, request_id=pending.request_id, option_id="allow-once"
                ),
                timeout=10,
            )
        else:
            done = await asyncio.to_thread(
                run_cli, setup.data_dir, "agent", "answer", run_id, pending.request_id, "allow-once"
            )
            assert done.returncode == 0, done.stderr[-2000:]

        await wait_state(stub, run_id, pb.RUN_STATE_FINISHED)
        events = await replay(stub, agent.id)

    # The agent was restarted and its session loaded, not replaced.
    loads = [e for e in setup.agent_events() if e["event"] == "load_session"]
    assert len(loads) == 1
    assert [e["event"] for e in setup.agent_events()].count("new_session") == 1

    seqs = [ev.seq for ev in events]
    assert seqs == list(range(1, len(events) + 1))
    kinds = [ev.kind for ev in events]
    assert kinds.count(pb.RUN_STARTED) == 1
    assert kinds.count(pb.TOOL_CALL) == 1
    assert kinds.count(pb.PERMISSION_REQUEST) == 1
    assert kinds.count(pb.PERMISSION_ANSWERED) == 1
    assert kinds.count(pb.TOOL_RESULT) == 1
    assert kinds.count(pb.RUN_FINISHED) == 1
    assert pb.RUN_ERROR not in kinds
    assert kinds[-1] == pb.RUN_FINISHED
    text = "".join(ev.text_delta.text for ev in events if ev.kind == pb.TEXT_DELTA)
    assert text == "fake: tool write finished"
    (result,) = [ev.tool_result for ev in events if ev.kind == pb.TOOL_RESULT]
    assert (result.call_id, result.status, result.output) == (
        "call-0-write",
        "completed",
        "write done",
    )
    answered = [ev.permission_answered for ev in events if ev.kind == pb.PERMISSION_ANSWERED]
    assert answered[0].option_id == "allow-once"
