"""Answering a permission request inline, when a person is at the terminal."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from machine.cli import agents as cli
from machine.cli.client import MachineClient
from machine.config import MachineConfig
from machine.daemon import ServeInfo, serve
from machine.models import PendingPermission, RunState
from shared.cli import ExitCode, Output


def _request() -> PendingPermission:
    return PendingPermission(
        run_id="run_0000000000aaaaaaaaaaaaaaaa",
        request_id="call-1",
        agent_id="ag_0000000000aaaaaaaaaaaaaaaa",
        call_id="call-1",
        title="write",
        options=(("allow_once", "Allow once", ""), ("reject_once", "Reject", "")),
        seq=3,
        state="pending",
    )


def test_choose_maps_numbers_ids_and_remember() -> None:
    req = _request()
    assert cli.choose(req, "1") == ("allow_once", False)
    assert cli.choose(req, " 2+ ") == ("reject_once", True)
    assert cli.choose(req, "allow_once") == ("allow_once", False)
    assert cli.choose(req, "3") is None
    assert cli.choose(req, "yes") is None


async def test_ask_at_terminal_retries_then_leaves_pending_on_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    replies = iter(["maybe", "2+"])
    monkeypatch.setattr("builtins.input", lambda _prompt: next(replies))
    assert await cli.ask_at_terminal(_request()) == ("reject_once", True)
    monkeypatch.setattr("builtins.input", lambda _prompt: "")
    assert await cli.ask_at_terminal(_request()) is None


async def test_prompt_stream_answers_inline_and_finishes(tmp_path: Path) -> None:
    cfg = MachineConfig(data_dir=tmp_path / "d", background_loops=False, shutdown_grace_seconds=0)
    ready: asyncio.Future[ServeInfo] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(serve(cfg, ready=ready.set_result, stop=stop))
    asked: list[str] = []

    async def person(req: PendingPermission) -> tuple[str, bool] | None:
        asked.append(req.title)
        allow = [option_id for option_id, _, _ in req.options if option_id == "allow_once"]
        return allow[0], False

    try:
        info = await asyncio.wait_for(ready, 10)
        assert info.socket == cfg.socket
        async with MachineClient(cfg) as client:
            agent = await client.create_agent("a", str(tmp_path))
            events = client.prompt(agent.id, "/tool write x")
            code = await asyncio.wait_for(
                cli.stream_events(Output(as_json=False), events, ask=person, client=client), 20
            )
            assert code == ExitCode.OK
            assert asked == ["write"]
            runs = await client.list_runs(agent.id)
            assert [r.state for r in runs] == [RunState.FINISHED]
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def test_a_stream_that_breaks_mid_line_ends_the_line_before_the_error() -> None:
    """The daemon goes away after a partial line: the error that follows on the
    terminal starts on a line of its own."""
    import io

    from machine.models import EventKind, StoredEvent

    run, agent = "run_0000000000aaaaaaaaaaaaaaaa", "ag_0000000000aaaaaaaaaaaaaaaa"

    async def events() -> AsyncIterator[StoredEvent]:
        yield StoredEvent(agent, 1, run, EventKind.RUN_STARTED, {"prompt": "hi"}, 0.0)
        yield StoredEvent(agent, 2, run, EventKind.TEXT_DELTA, {"text": "half a"}, 0.0)
        raise ConnectionError("the daemon stopped")

    stream = io.StringIO()
    with pytest.raises(ConnectionError):
        await cli.stream_events(Output(as_json=False, stream=stream), events())
    assert stream.getvalue() == f"[run {run}]\nhalf a\n"
