"""The built-in ``echo`` runtime: deterministic, needs nothing installed.

It replies ``echo: <prompt>`` as several TEXT_DELTAs. Directives at the start
of a prompt make it exercise the rest of the engine:

- ``/slow MS TEXT``: wait MS milliseconds before each delta (interruptible runs);
- ``/tool NAME ARGS``: emit a TOOL_CALL, ask permission, then a TOOL_RESULT
  (allowed) or a rejection text;
- ``/fail MESSAGE``: fail with RuntimeFailed.

The setting ``delay_ms`` slows every prompt the same way as ``/slow``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from machine.runtimes.base import (
    PermissionOption,
    PermissionRequest,
    RunContext,
    RunOutcome,
    RuntimeFailed,
    SessionStarted,
    TextDelta,
    ToolCall,
    ToolResult,
    UsageReport,
)
from shared.errors import InvalidArgument

__all__ = ["EchoRuntime", "create_runtime", "portable_settings", "validate_settings"]

logger = logging.getLogger(__name__)

_MAX_DELAY_MS = 60_000
_MAX_DELTAS = 16

OPTIONS = (
    PermissionOption("allow_once", "Allow once", "allow_once"),
    PermissionOption("allow_always", "Always allow", "allow_always"),
    PermissionOption("reject_once", "Reject", "reject_once"),
    PermissionOption("reject_always", "Always reject", "reject_always"),
)


def validate_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Check echo's settings: only ``delay_ms`` (0 to 60000)."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        if key != "delay_ms":
            raise InvalidArgument(
                "settings_json", f"unknown echo setting {key!r} (known: delay_ms)"
            )
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgument("settings_json", "delay_ms must be an integer")
        if not 0 <= value <= _MAX_DELAY_MS:
            raise InvalidArgument("settings_json", f"delay_ms must be 0 to {_MAX_DELAY_MS}")
        out[key] = value
    return out


def portable_settings(settings: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Echo's settings hold no secret: ``delay_ms`` travels, nothing is withheld."""
    return {k: v for k, v in settings.items() if k == "delay_ms"}, []


def create_runtime(*, agent_id: str, folder: Path, settings: Mapping[str, Any]) -> EchoRuntime:
    """Make the echo runtime for one agent."""
    return EchoRuntime(agent_id, int(settings.get("delay_ms", 0)))


def _chunks(text: str) -> list[str]:
    size = max(8, math.ceil(len(text) / _MAX_DELTAS))
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


class EchoRuntime:
    """Replies with the prompt; see the module docstring for directives."""

    name = "echo"

    def __init__(self, agent_id: str, delay_ms: int = 0) -> None:
        self.agent_id = agent_id
        self.delay_ms = delay_ms

    async def run(self, ctx: RunContext) -> RunOutcome:
        """Drive one prompt."""
        if ctx.session_id is None:
            await ctx.emit(SessionStarted(f"echo-{self.agent_id}"))
        text = ctx.prompt
        delay_ms = self.delay_ms
        head, _, rest = text.partition(" ")
        if head == "/slow":
            ms_text, _, text = rest.partition(" ")
            try:
                delay_ms = min(int(ms_text), _MAX_DELAY_MS)
            except ValueError:
                text = rest
        elif head == "/fail":
            raise RuntimeFailed(f"echo: asked to fail: {rest}")
        elif head == "/tool":
            name, _, args = rest.partition(" ")
            return await self._tool(ctx, name or "tool", args, delay_ms)
        reply = f"echo: {text}"
        await self._say(ctx, reply, delay_ms)
        await ctx.emit(UsageReport(len(ctx.prompt.split()), len(reply.split())))
        return RunOutcome("end_turn")

    async def _say(self, ctx: RunContext, reply: str, delay_ms: int) -> None:
        for piece in _chunks(reply):
            if delay_ms:
                # Pacing the reply (a real model streams slowly too), not synchronisation.
                await asyncio.sleep(delay_ms / 1000)
            await ctx.emit(TextDelta(piece))

    async def _tool(self, ctx: RunContext, name: str, args: str, delay_ms: int) -> RunOutcome:
        call_id = "call-1"
        await ctx.emit(ToolCall(call_id, name, "other", json.dumps({"args": args})))
        decision = await ctx.ask_permission(PermissionRequest(call_id, call_id, name, OPTIONS))
        allowed = not decision.cancelled and decision.option_id.startswith("allow")
        if allowed:
            await ctx.emit(ToolResult(call_id, "completed", f"{name} ran with {args!r}"))
            await self._say(ctx, f"echo: tool {name} allowed", delay_ms)
        else:
            await ctx.emit(ToolResult(call_id, "failed", "rejected by the user"))
            await self._say(ctx, f"echo: tool {name} was rejected", delay_ms)
        return RunOutcome("end_turn")

    async def close(self) -> None:
        """Nothing to stop."""

    async def delete_session(self, session_id: str) -> None:
        """Echo keeps no session files."""

    async def erase_session(self, session_id: str | None, folder: Path) -> tuple[str, str]:
        """Echo keeps no copy of a conversation: nothing to erase."""
        return "done", "the echo runtime keeps no copy"
