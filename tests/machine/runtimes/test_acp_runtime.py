"""AcpRuntime against the fake ACP agent run as a real subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from machine.runtimes.acp import (
    AcpRuntime,
    create_runtime,
    validate_acp_settings,
    validate_settings,
)
from machine.runtimes.base import (
    PermissionDecision,
    PermissionOption,
    PermissionRequest,
    ResumeInfo,
    RunContext,
    RunOutcome,
    RuntimeEvent,
    RuntimeFailed,
    SessionStarted,
    TextDelta,
    ToolCall,
    ToolResult,
    UsageReport,
)
from shared.errors import InvalidArgument
from tests.helpers.poll import apoll_until

FAKE_AGENT = Path(__file__).resolve().parents[2] / "helpers" / "fake_acp_agent.py"
DEADLINE = 15.0

Answer = Callable[[PermissionRequest], Awaitable[PermissionDecision]]


async def wait_until(cond: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    """Poll ``cond`` until it holds or the deadline passes."""
    fail = AssertionError(f"timed out waiting for {what}")
    await apoll_until(cond, deadline=timeout, what=what, step=0.02, fail=lambda: fail)


class Recorder:
    """In-memory emit/ask_permission callbacks for a RunContext."""

    def __init__(self, answer: Answer | None = None) -> None:
        self.events: list[RuntimeEvent] = []
        self.asked: list[PermissionRequest] = []
        # Everything in arrival order, to check that a request follows its tool call.
        self.log: list[object] = []
        self._answer = answer

    async def emit(self, event: RuntimeEvent) -> None:
        self.events.append(event)
        self.log.append(event)

    async def ask_permission(self, request: PermissionRequest) -> PermissionDecision:
        self.asked.append(request)
        self.log.append(request)
        if self._answer is None:
            await asyncio.Event().wait()  # a person who never answers
        assert self._answer is not None
        return await self._answer(request)

    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, TextDelta))

    def of(self, kind: type[Any]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def choose(option_id: str) -> Answer:
    async def answer(request: PermissionRequest) -> PermissionDecision:
        return PermissionDecision(option_id=option_id)

    return answer


class FakeAgent:
    """Paths and the event log of one fake agent state folder."""

    def __init__(self, tmp_path: Path) -> None:
        self.state = tmp_path / "agent-state"
        self.state.mkdir()
        self.folder = tmp_path / "work"
        self.folder.mkdir()
        self.settings: dict[str, Any] = {
            "command": [sys.executable, str(FAKE_AGENT), "--state-dir", str(self.state)],
            "env": {"FAKE_AGENT_TOKEN": "not-a-real-secret"},
            "kind": "generic",
        }

    def events(self) -> list[dict[str, Any]]:
        path = self.state / "events.jsonl"
        if not path.exists():
            return []
        lines = path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def count(self, event: str, **fields: Any) -> int:
        return sum(
            1
            for e in self.events()
            if e["event"] == event and all(e.get(k) == v for k, v in fields.items())
        )

    def ctx(
        self,
        prompt: str,
        rec: Recorder,
        *,
        session_id: str | None = None,
        resume: ResumeInfo | None = None,
    ) -> RunContext:
        return RunContext(
            agent_id="ag_test",
            run_id="run_test",
            folder=self.folder,
            prompt=prompt,
            settings=self.settings,
            emit=rec.emit,
            ask_permission=rec.ask_permission,
            session_id=session_id,
            resume=resume,
        )


@pytest.fixture
def agent(tmp_path: Path) -> FakeAgent:
    return FakeAgent(tmp_path)


@pytest.fixture
async def runtime() -> AsyncIterator[AcpRuntime]:
    rt = AcpRuntime(close_grace=2.0)
    try:
        yield rt
    finally:
        await rt.close()


async def test_streams_text_session_and_usage(agent: FakeAgent, runtime: AcpRuntime) -> None:
    rec = Recorder()
    outcome = await runtime.run(agent.ctx("hello there world", rec))

    assert outcome == RunOutcome("end_turn")
    assert isinstance(rec.events[0], SessionStarted)
    assert rec.text() == "fake: hello there world"
    assert len(rec.of(TextDelta)) == 3
    assert rec.of(UsageReport) == [UsageReport(input_tokens=3, output_tokens=7)]
    assert rec.events.count(rec.events[0]) == 1
    (init,) = [e for e in agent.events() if e["event"] == "initialize"]
    # No file-system or terminal access is offered to the agent.
    assert (init["fs_read"], init["fs_write"], init["terminal"]) == (False, False, False)
    (new,) = [e for e in agent.events() if e["event"] == "new_session"]
    assert new["cwd"] == str(agent.folder.resolve())
    assert rec.events[0] == SessionStarted(new["session_id"])


async def test_permission_allow(agent: FakeAgent, runtime: AcpRuntime) -> None:
    rec = Recorder(choose("allow-once"))
    outcome = await runtime.run(agent.ctx("/tool write", rec))

    assert outcome.stop_reason == "end_turn"
    (call,) = rec.of(ToolCall)
    assert call == ToolCall(
        call_id="call-0-write", title="Run write", kind="edit", input_json='{"name": "write"}'
    )
    (request,) = rec.asked
    assert request.request_id == "call-0-write"
    assert request.call_id == "call-0-write"
    assert request.title == "Run write"
    assert [(o.option_id, o.kind) for o in request.options] == [
        ("allow-once", "allow_once"),
        ("allow-always", "allow_always"),
        ("reject-once", "reject_once"),
    ]
    assert rec.log.index(call) < rec.log.index(request)
    assert rec.of(ToolResult) == [ToolResult("call-0-write", "completed", "write done")]
    assert rec.text() == "fake: tool write finished"
    assert agent.count("permission_answer", outcome="allow-once") == 1


async def test_permission_reject(agent: FakeAgent, runtime: AcpRuntime) -> None:
    rec = Recorder(choose("reject-once"))
    outcome = await runtime.run(agent.ctx("/tool rm", rec))

    assert outcome.stop_reason == "end_turn"
    assert rec.of(ToolResult) == [ToolResult("call-0-rm", "failed", "rejected")]
    assert rec.text() == "fake: tool rm rejected"
    assert agent.count("permission_answer", outcome="reject-once") == 1


async def test_permission_cancelled_or_unknown_option(
    agent: FakeAgent, runtime: AcpRuntime
) -> None:
    async def cancelled(request: PermissionRequest) -> PermissionDecision:
        return PermissionDecision(option_id="", cancelled=True)

    rec = Recorder(cancelled)
    assert (await runtime.run(agent.ctx("/tool a", rec))).stop_reason == "cancelled"
    # An option the agent never offered is never passed on as if chosen.
    rec2 = Recorder(choose("allow-everything-forever"))
    assert (await runtime.run(agent.ctx("/tool b", rec2))).stop_reason == "cancelled"
    assert agent.count("permission_answer", outcome="cancelled") == 2
    assert rec.of(ToolResult) == [] and rec2.of(ToolResult) == []


async def test_cancel_sends_session_cancel(agent: FakeAgent, runtime: AcpRuntime) -> None:
    rec = Recorder()
    task = asyncio.create_task(runtime.run(agent.ctx("/slow", rec)))
    await wait_until(lambda: len(rec.of(TextDelta)) >= 2, "a few slow chunks")
    pid = runtime.pid
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert agent.count("cancel") == 1
    await wait_until(
        lambda: agent.count("prompt_end", stop_reason="cancelled") == 1, "prompt ended cancelled"
    )
    # Cancelled before the end: far fewer chunks than the agent would send.
    assert len(rec.of(TextDelta)) < 60
    # The process survives a cancel and serves the next run.
    rec2 = Recorder()
    await runtime.run(agent.ctx("again", rec2))
    assert rec2.text() == "fake: again"
    assert runtime.pid == pid


async def test_cancel_while_waiting_for_permission(agent: FakeAgent, runtime: AcpRuntime) -> None:
    rec = Recorder()  # never answers
    task = asyncio.create_task(runtime.run(agent.ctx("/tool write", rec)))
    await wait_until(lambda: len(rec.asked) == 1, "the permission request")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The answer, the session/cancel notification and the prompt's end reach the
    # agent's log in no fixed order: wait for all three, then check each exactly once.
    await wait_until(
        lambda: (
            agent.count("prompt_end", stop_reason="cancelled") >= 1
            and agent.count("permission_answer", outcome="cancelled") >= 1
            and agent.count("cancel") >= 1
        ),
        "prompt ended cancelled, permission answered cancelled, cancel sent",
    )
    assert agent.count("prompt_end", stop_reason="cancelled") == 1
    assert agent.count("permission_answer", outcome="cancelled") == 1
    assert agent.count("cancel") == 1


async def test_crash_is_runtime_failed_and_next_run_restarts(
    agent: FakeAgent, runtime: AcpRuntime
) -> None:
    rec = Recorder()
    await runtime.run(agent.ctx("first", rec))
    first_pid = runtime.pid

    with pytest.raises(RuntimeFailed) as failed:
        await runtime.run(agent.ctx("/crash now", Recorder()))
    assert "exited (code 3)" in failed.value.message
    assert "not-a-real-secret" not in failed.value.message
    assert runtime.pid is None

    rec3 = Recorder()
    await runtime.run(agent.ctx("after", rec3))
    assert rec3.text() == "fake: after"
    assert runtime.pid not in (None, first_pid)


async def test_process_and_session_reused_across_runs(
    agent: FakeAgent, runtime: AcpRuntime
) -> None:
    rec1 = Recorder()
    await runtime.run(agent.ctx("one", rec1))
    session = rec1.events[0]
    assert isinstance(session, SessionStarted)
    pid = runtime.pid

    rec2 = Recorder()
    await runtime.run(agent.ctx("two", rec2, session_id=session.session_id))
    assert rec2.events[0] == session
    assert rec2.text() == "fake: two"
    assert runtime.pid == pid
    assert agent.count("initialize") == 1
    assert agent.count("new_session") == 1
    assert agent.count("load_session") == 0
    assert len({e["pid"] for e in agent.events()}) == 1


async def test_session_loaded_by_a_new_process(agent: FakeAgent) -> None:
    rt1 = AcpRuntime()
    try:
        rec1 = Recorder()
        await rt1.run(agent.ctx("remember me", rec1))
    finally:
        await rt1.close()
    session = rec1.events[0]
    assert isinstance(session, SessionStarted)

    rt2 = AcpRuntime()
    try:
        rec2 = Recorder()
        await rt2.run(agent.ctx("and now", rec2, session_id=session.session_id))
    finally:
        await rt2.close()
    assert agent.count("load_session", session_id=session.session_id, turns=1) == 1
    assert agent.count("new_session") == 1
    assert rec2.events[0] == session
    # The history the agent replays while loading is not this run's output.
    assert rec2.text() == "fake: and now"


async def test_resume_after_restart_reasks_same_request(agent: FakeAgent) -> None:
    # The first daemon: the run pauses on the permission request...
    rt1 = AcpRuntime()
    rec1 = Recorder()
    task = asyncio.create_task(rt1.run(agent.ctx("/tool write", rec1)))
    try:
        await wait_until(lambda: len(rec1.asked) == 1, "the permission request")
        # ...and the daemon dies; its agent process goes with it.
        pid = rt1.pid
        assert pid is not None
        os.killpg(pid, signal.SIGKILL)
        with pytest.raises(RuntimeFailed):
            await task
    finally:
        await rt1.close()
    pending = rec1.asked[0]
    session = rec1.events[0]
    assert isinstance(session, SessionStarted)

    # The next daemon drives the run again with the person's stored answer.
    decision = PermissionDecision(option_id="allow-once")

    async def engine_answer(request: PermissionRequest) -> PermissionDecision:
        assert request.request_id == pending.request_id
        return decision

    rt2 = AcpRuntime()
    rec2 = Recorder(engine_answer)
    try:
        outcome = await rt2.run(
            agent.ctx(
                "/tool write",
                rec2,
                session_id=session.session_id,
                resume=ResumeInfo(pending=pending, decision=decision),
            )
        )
    finally:
        await rt2.close()
    assert outcome.stop_reason == "end_turn"
    assert agent.count("load_session", session_id=session.session_id) == 1
    assert rec2.asked == [pending]
    assert rec2.events[0] == session
    assert rec2.of(ToolResult) == [ToolResult("call-0-write", "completed", "write done")]
    assert rec2.text() == "fake: tool write finished"


async def test_resume_keeps_paused_request_id_when_agent_renames_call(agent: FakeAgent) -> None:
    # Real agents (Claude) give the re-asked tool call a fresh id.
    options = (
        PermissionOption("allow-once", "Allow once", "allow_once"),
        PermissionOption("allow-always", "Always allow", "allow_always"),
        PermissionOption("reject-once", "Reject", "reject_once"),
    )
    pending = PermissionRequest("toolu_old", "toolu_old", "Run write", options)
    decision = PermissionDecision(option_id="allow-always")
    rec = Recorder(choose("allow-always"))
    rt = AcpRuntime()
    try:
        await rt.run(agent.ctx("/tool write", rec, resume=ResumeInfo(pending, decision)))
    finally:
        await rt.close()
    (asked,) = rec.asked
    assert asked.request_id == "toolu_old"
    assert asked.call_id == "call-0-write"
    assert rec.text() == "fake: tool write finished"


async def test_fs_and_terminal_requests_refused(agent: FakeAgent, runtime: AcpRuntime) -> None:
    rec = Recorder()
    await runtime.run(agent.ctx("/fs", rec))
    assert rec.text() == "fake: fs refused"
    rec2 = Recorder()
    await runtime.run(agent.ctx("/terminal", rec2))
    assert rec2.text() == "fake: terminal refused"


async def test_missing_command_and_bad_settings_fail_the_run(
    agent: FakeAgent, runtime: AcpRuntime
) -> None:
    agent.settings = {"command": [str(agent.folder / "no-such-agent"), "--secret-arg"]}
    with pytest.raises(RuntimeFailed) as failed:
        await runtime.run(agent.ctx("hi", Recorder()))
    assert failed.value.message == "acp start no-such-agent: command not found"

    agent.settings = {"command": []}
    with pytest.raises(RuntimeFailed, match=r"settings\.command"):
        await runtime.run(agent.ctx("hi", Recorder()))


def test_validate_settings_normalises() -> None:
    clean = validate_acp_settings({"command": ("claude-code-acp",), "env": {"A_1": "x"}})
    assert clean == {"command": ["claude-code-acp"], "env": {"A_1": "x"}, "kind": "generic"}
    clean = validate_acp_settings({"command": ["codex-acp"], "kind": "codex"})
    assert clean["kind"] == "codex" and clean["env"] == {}


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({}, "settings.command"),
        ({"command": "claude"}, "settings.command"),
        ({"command": []}, "settings.command"),
        ({"command": ["a", 3]}, "settings.command[1]"),
        ({"command": ["a\x00b"]}, "settings.command[0]"),
        ({"command": [" "]}, "settings.command[0]"),
        ({"command": ["a"], "env": ["X=1"]}, "settings.env"),
        ({"command": ["a"], "env": {"BAD-NAME": "1"}}, "settings.env"),
        ({"command": ["a"], "env": {"TOKEN": 5}}, "settings.env.TOKEN"),
        ({"command": ["a"], "kind": "gemini"}, "settings.kind"),
        ({"command": ["a"], "comand": ["typo"]}, "settings.comand"),
    ],
)
def test_validate_settings_names_the_field(settings: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_acp_settings(settings)
    assert err.value.field == field


def test_registry_hooks(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_settings({"command": ["a", 3]})
    assert err.value.field == "settings_json"
    assert "command[1]" in err.value.reason
    rt = create_runtime(
        agent_id="ag_x", folder=tmp_path, settings={"command": ["a"]}, claude_home=tmp_path
    )
    assert isinstance(rt, AcpRuntime) and rt.name == "acp"


async def test_agent_env_and_cwd(tmp_path: Path) -> None:
    agent = FakeAgent(tmp_path)
    agent.settings["kind"] = "claude"
    home = tmp_path / "claude-home"
    rt = AcpRuntime(claude_home=home)
    try:
        await rt.run(agent.ctx("hi", Recorder()))
    finally:
        await rt.close()
    (init,) = [e for e in agent.events() if e["event"] == "initialize"]
    assert init["claude_config_dir"] == str(home)
    assert init["has_token"] is True
    assert init["cwd"] == str(agent.folder)


def test_validate_settings_never_echoes_env_values() -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_acp_settings({"command": ["a"], "env": {"TOKEN": "sk-secret\x00"}})
    assert "sk-secret" not in str(err.value)


SID = "0b7c6a8e-1f2d-4c3b-9a8e-7d6c5b4a3f21"
OTHER = "5e4d3c2b-1a09-4f8e-8d7c-6b5a49382716"


def _touch(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


async def test_delete_session_claude_removes_only_that_session(tmp_path: Path) -> None:
    home = tmp_path / "claude"
    outside = tmp_path / "outside"
    for sid in (SID, OTHER):
        _touch(home / "projects" / "-work-a" / f"{sid}.jsonl")
        _touch(home / "projects" / "-work-a" / sid / "subagents" / "agent-1.jsonl")
        _touch(home / "todos" / f"{sid}-agent-{sid}.json")
        _touch(home / "file-history" / sid / "f1")
        _touch(home / "session-env" / sid / "env")
        _touch(home / "debug" / f"{sid}.txt")
    # A linked project folder pointing outside the Claude folder is left alone.
    _touch(outside / f"{SID}.jsonl")
    (home / "projects" / "-linked").symlink_to(outside, target_is_directory=True)
    _touch(home / "settings.json")

    rt = AcpRuntime({"command": ["claude-code-acp"], "kind": "claude"}, claude_home=home)
    await rt.delete_session(SID)

    left = _tree(home)
    assert not any(SID in p for p in left)
    assert sum(OTHER in p for p in left) == 6
    assert "settings.json" in left
    assert (outside / f"{SID}.jsonl").exists()


async def test_delete_session_codex_removes_only_that_session(tmp_path: Path) -> None:
    home = tmp_path / "codex"
    mine = _touch(
        home / "sessions" / "2025" / "01" / "02" / f"rollout-2025-01-02T03-04-05-{SID}.jsonl"
    )
    other = _touch(
        home / "sessions" / "2025" / "01" / "02" / f"rollout-2025-01-02T03-04-06-{OTHER}.jsonl"
    )
    archived = _touch(home / "archived_sessions" / f"rollout-2024-12-31T00-00-00-{SID}.jsonl")
    rt = AcpRuntime({"command": ["codex-acp"], "kind": "codex"}, codex_home=home)
    await rt.delete_session(SID)
    assert not mine.exists() and not archived.exists()
    assert other.exists()


@pytest.mark.parametrize(
    "bad", ["../../etc/passwd", "*", "", SID + "/..", SID[:-1] + "*", "a" * 300, f"{SID}\n"]
)
async def test_delete_session_refuses_malicious_ids(tmp_path: Path, bad: str) -> None:
    home = tmp_path / "claude"
    _touch(home / "projects" / "p" / f"{SID}.jsonl")
    _touch(home / "projects" / "p" / "*.jsonl")
    _touch(tmp_path / "etc" / "passwd")
    before = _tree(tmp_path)
    rt = AcpRuntime({"command": ["claude-code-acp"], "kind": "claude"}, claude_home=home)
    with pytest.raises(InvalidArgument) as err:
        await rt.delete_session(bad)
    assert err.value.field == "session_id"
    assert _tree(tmp_path) == before


async def test_delete_session_generic_touches_nothing(tmp_path: Path) -> None:
    home = tmp_path / "claude"
    path = _touch(home / "projects" / "p" / f"{SID}.jsonl")
    rt = AcpRuntime({"command": ["some-agent"]}, claude_home=home)
    await rt.delete_session(SID)
    assert path.exists()
