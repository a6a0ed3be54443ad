"""A small but real ACP agent, run as a subprocess by tests.

Run it as ``python tests/helpers/fake_acp_agent.py --state-dir DIR``. It speaks
ACP over stdio with the ``agent-client-protocol`` package's agent side and
behaves deterministically, keyed by the prompt text:

- default: replies "fake: <prompt>" in a few ``agent_message_chunk`` updates;
- ``/tool NAME``: starts a tool call, asks ``session/request_permission``
  (allow_once / allow_always / reject_once); on allow it completes the call and
  says "fake: tool NAME finished", on reject it fails the call and says
  "fake: tool NAME rejected";
- ``/slow``: streams many chunks with small pauses, stopping on ``session/cancel``;
- ``/crash``: sends one chunk, then the process exits with code 3;
- ``/fs`` and ``/terminal``: asks the client to read a file / create a terminal
  and reports whether the client refused ("fake: fs refused").

It advertises ``session/delete``: a deleted session's file goes, an unknown one
answers "resource not found". With ``--fail-delete`` every ``session/delete``
answers an internal error instead (a runtime that cannot erase).

Sessions are kept in ``DIR/sessions/<id>.json`` so ``session/load`` works after
a restart; a turn is stored only once it completes, and tool call ids are
``call-<completed turns>-<NAME>``, so a prompt driven again after an
interrupted turn asks about the same tool call id. Every protocol step is
appended to ``DIR/events.jsonl`` for tests to observe.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import uuid
from pathlib import Path
from typing import Any, cast

import acp
from acp import helpers
from acp.agent import connection as agent_connection
from acp.agent.router import build_agent_router
from acp.router import MessageRouter
from acp.schema import (
    AgentCapabilities,
    AllowedOutcome,
    DeleteSessionRequest,
    Implementation,
    InitializeResponse,
    LoadSessionResponse,
    NewSessionResponse,
    PermissionOption,
    PromptResponse,
    SessionCapabilities,
    SessionDeleteCapabilities,
    TextContentBlock,
    ToolCallUpdate,
    Usage,
)

SLOW_CHUNKS = 60
SLOW_PAUSE = 0.05


class FakeAgent:
    """Deterministic ACP agent; see the module docstring."""

    def __init__(self, state_dir: Path, *, fail_delete: bool = False) -> None:
        self._state_dir = state_dir
        self._fail_delete = fail_delete
        self._sessions_dir = state_dir / "sessions"
        self._sessions_dir.mkdir(parents=True, exist_ok=True)
        self._cancelled: dict[str, asyncio.Event] = {}
        self._conn: Any = None

    # -- plumbing ---------------------------------------------------------

    def on_connect(self, conn: Any) -> None:
        self._conn = conn

    def _log(self, event: str, **fields: Any) -> None:
        record = {"event": event, "pid": os.getpid(), **fields}
        with (self._state_dir / "events.jsonl").open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")

    def _session_path(self, session_id: str) -> Path:
        # Session ids are uuid4 strings we made ourselves; anything else is unknown.
        uuid.UUID(session_id)
        return self._sessions_dir / f"{session_id}.json"

    def _read_session(self, session_id: str) -> dict[str, Any]:
        try:
            path = self._session_path(session_id)
            return dict(json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, OSError):
            raise acp.RequestError.resource_not_found(session_id) from None

    def _write_session(self, session_id: str, data: dict[str, Any]) -> None:
        path = self._session_path(session_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)

    async def _say(self, session_id: str, text: str) -> None:
        await self._conn.session_update(
            session_id=session_id, update=helpers.update_agent_message_text(text)
        )

    # -- ACP agent methods ------------------------------------------------

    async def initialize(
        self,
        protocol_version: int,
        client_capabilities: Any = None,
        client_info: Any = None,
        **kwargs: Any,
    ) -> InitializeResponse:
        fs = getattr(client_capabilities, "fs", None)
        self._log(
            "initialize",
            protocol_version=protocol_version,
            fs_read=bool(getattr(fs, "read_text_file", False)),
            fs_write=bool(getattr(fs, "write_text_file", False)),
            terminal=bool(getattr(client_capabilities, "terminal", False)),
            claude_config_dir=os.environ.get("CLAUDE_CONFIG_DIR"),
            has_token="FAKE_AGENT_TOKEN" in os.environ,
            cwd=os.getcwd(),
        )
        return InitializeResponse(
            protocol_version=acp.PROTOCOL_VERSION,
            agent_capabilities=AgentCapabilities(
                load_session=True,
                session_capabilities=SessionCapabilities(delete=SessionDeleteCapabilities()),
            ),
            agent_info=Implementation(name="fake-acp-agent", version="1.0"),
        )

    async def new_session(
        self, cwd: str, mcp_servers: Any = None, **kwargs: Any
    ) -> NewSessionResponse:
        session_id = str(uuid.uuid4())
        self._write_session(session_id, {"cwd": cwd, "turns": []})
        self._log("new_session", session_id=session_id, cwd=cwd)
        return NewSessionResponse(session_id=session_id)

    async def load_session(
        self, cwd: str, session_id: str, mcp_servers: Any = None, **kwargs: Any
    ) -> LoadSessionResponse:
        data = self._read_session(session_id)
        # ACP: loading replays the conversation to the client before answering.
        for turn in data["turns"]:
            await self._conn.session_update(
                session_id=session_id, update=helpers.update_user_message_text(turn["prompt"])
            )
            await self._say(session_id, turn["reply"])
        self._log("load_session", session_id=session_id, cwd=cwd, turns=len(data["turns"]))
        return LoadSessionResponse()

    async def delete_session(self, session_id: str, **kwargs: Any) -> dict[str, Any]:
        self._log("delete_session", session_id=session_id, failing=self._fail_delete)
        if self._fail_delete:
            raise acp.RequestError.internal_error({"reason": "asked to fail"})
        try:
            self._session_path(session_id).unlink()
        except (ValueError, FileNotFoundError):
            raise acp.RequestError.resource_not_found(session_id) from None
        return {}

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        self._log("cancel", session_id=session_id)
        self._cancelled.setdefault(session_id, asyncio.Event()).set()

    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> PromptResponse:
        data = self._read_session(session_id)
        text = " ".join(b.text for b in prompt if isinstance(b, TextContentBlock))
        cancelled = self._cancelled[session_id] = asyncio.Event()
        self._log("prompt", session_id=session_id, text=text)
        stop_reason, reply = await self._respond(session_id, text, len(data["turns"]), cancelled)
        if stop_reason == "end_turn":
            data["turns"].append({"prompt": text, "reply": reply})
            self._write_session(session_id, data)
        self._log("prompt_end", session_id=session_id, stop_reason=stop_reason)
        words = len(text.split())
        return PromptResponse(
            stop_reason=stop_reason,
            usage=Usage(input_tokens=words, output_tokens=7, total_tokens=words + 7),
        )

    # -- behaviours -------------------------------------------------------

    async def _respond(
        self, session_id: str, text: str, turns_done: int, cancelled: asyncio.Event
    ) -> tuple[Any, str]:
        words = text.split()
        if "/crash" in words:
            await self._say(session_id, "fake: crashing")
            self._log("crash", session_id=session_id)
            os._exit(3)
        if "/slow" in words:
            parts = []
            for i in range(SLOW_CHUNKS):
                if cancelled.is_set():
                    return "cancelled", ""
                part = f"slow {i} "
                parts.append(part)
                await self._say(session_id, part)
                await asyncio.sleep(SLOW_PAUSE)
            return "end_turn", "".join(parts)
        if "/tool" in words:
            idx = words.index("/tool")
            name = words[idx + 1] if idx + 1 < len(words) else "tool"
            return await self._tool(session_id, name, turns_done)
        if "/fs" in words:
            reply = await self._probe(session_id, "fs")
            return "end_turn", reply
        if "/terminal" in words:
            reply = await self._probe(session_id, "terminal")
            return "end_turn", reply
        reply = f"fake: {text}"
        # A few chunks, cut at fixed places so the test can check the join.
        pieces = [reply[:6], reply[6:12], reply[12:]]
        for piece in pieces:
            if piece:
                await self._say(session_id, piece)
        return "end_turn", reply

    async def _tool(self, session_id: str, name: str, turns_done: int) -> tuple[Any, str]:
        call_id = f"call-{turns_done}-{name}"
        title = f"Run {name}"
        await self._conn.session_update(
            session_id=session_id,
            update=helpers.start_tool_call(
                call_id, title, kind="edit", status="pending", raw_input={"name": name}
            ),
        )
        options = [
            PermissionOption(option_id="allow-once", name="Allow once", kind="allow_once"),
            PermissionOption(option_id="allow-always", name="Always allow", kind="allow_always"),
            PermissionOption(option_id="reject-once", name="Reject", kind="reject_once"),
        ]
        self._log("permission_asked", session_id=session_id, call_id=call_id)
        response = await self._conn.request_permission(
            session_id=session_id,
            tool_call=ToolCallUpdate(tool_call_id=call_id, title=title),
            options=options,
        )
        outcome = response.outcome
        if not isinstance(outcome, AllowedOutcome):
            self._log("permission_answer", session_id=session_id, outcome="cancelled")
            return "cancelled", ""
        self._log("permission_answer", session_id=session_id, outcome=outcome.option_id)
        if outcome.option_id.startswith("allow"):
            await self._conn.session_update(
                session_id=session_id,
                update=helpers.update_tool_call(
                    call_id,
                    status="completed",
                    content=[helpers.tool_content(helpers.text_block(f"{name} done"))],
                ),
            )
            reply = f"fake: tool {name} finished"
        else:
            await self._conn.session_update(
                session_id=session_id,
                update=helpers.update_tool_call(
                    call_id,
                    status="failed",
                    content=[helpers.tool_content(helpers.text_block("rejected"))],
                ),
            )
            reply = f"fake: tool {name} rejected"
        await self._say(session_id, reply)
        return "end_turn", reply

    async def _probe(self, session_id: str, what: str) -> str:
        try:
            if what == "fs":
                await self._conn.read_text_file(session_id=session_id, path="/etc/hostname")
            else:
                await self._conn.create_terminal(session_id=session_id, command="true")
        except acp.RequestError:
            reply = f"fake: {what} refused"
        else:
            reply = f"fake: {what} allowed"
        await self._say(session_id, reply)
        return reply


def _router_with_delete(agent: Any, use_unstable_protocol: bool = False) -> MessageRouter:
    # The package knows session/delete's schema but routes no handler for it yet.
    router = build_agent_router(agent, use_unstable_protocol=use_unstable_protocol)
    router.route_request("session/delete", DeleteSessionRequest, agent, "delete_session")
    return router


def main() -> None:
    """Parse arguments and serve ACP on stdin/stdout until the client goes away."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--fail-delete", action="store_true")
    args = parser.parse_args()
    agent = FakeAgent(args.state_dir, fail_delete=args.fail_delete)
    agent_connection.build_agent_router = _router_with_delete  # type: ignore[assignment]
    # The fake implements only the methods it needs; the package routes the rest.
    asyncio.run(acp.run_agent(cast(acp.Agent, agent)))


if __name__ == "__main__":
    main()
