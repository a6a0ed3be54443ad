"""Answering a permission request inline, when a person is at the terminal."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc.aio
import pytest

from machine import cli
from machine.config import MachineConfig
from machine.daemon import ServeInfo, serve
from shared.cli import ExitCode, Output
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc


def _request() -> pb.PermissionRequest:
    return pb.PermissionRequest(
        request_id="call-1",
        title="write",
        options=[
            pb.PermissionOption(option_id="allow_once", name="Allow once"),
            pb.PermissionOption(option_id="reject_once", name="Reject"),
        ],
    )


def test_choose_maps_numbers_ids_and_remember() -> None:
    req = _request()
    assert cli._choose(req, "1") == ("allow_once", False)
    assert cli._choose(req, " 2+ ") == ("reject_once", True)
    assert cli._choose(req, "allow_once") == ("allow_once", False)
    assert cli._choose(req, "3") is None
    assert cli._choose(req, "yes") is None


async def test_ask_at_terminal_retries_then_leaves_pending_on_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    replies = iter(["maybe", "2+"])
    monkeypatch.setattr("builtins.input", lambda _prompt: next(replies))
    assert await cli._ask_at_terminal(_request()) == ("reject_once", True)
    monkeypatch.setattr("builtins.input", lambda _prompt: "")
    assert await cli._ask_at_terminal(_request()) is None


async def test_prompt_stream_answers_inline_and_finishes(tmp_path: Path) -> None:
    cfg = MachineConfig(data_dir=tmp_path / "d", background_loops=False, shutdown_grace_seconds=0)
    ready: asyncio.Future[ServeInfo] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(serve(cfg, ready=ready.set_result, stop=stop))
    asked: list[str] = []

    async def person(req: pb.PermissionRequest) -> tuple[str, bool] | None:
        asked.append(req.title)
        allow = [o.option_id for o in req.options if o.option_id.startswith("allow_once")]
        return allow[0], False

    try:
        info = await asyncio.wait_for(ready, 10)
        async with grpc.aio.insecure_channel(f"unix://{info.socket}") as channel:
            stub = pb_grpc.MachineServiceStub(channel)
            agent = await stub.CreateAgent(pb.CreateAgentRequest(name="a", folder=str(tmp_path)))
            events = stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="/tool write x"))
            code = await asyncio.wait_for(
                cli._stream(Output(as_json=False), events, ask=person, stub=stub), 20
            )
            assert code == ExitCode.OK
            assert asked == ["write"]
            runs = await stub.ListRuns(pb.ListRunsRequest(agent_id=agent.id))
            assert [pb.RunState.Name(r.state) for r in runs.runs] == ["RUN_STATE_FINISHED"]
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
