"""ACP ``session/update`` notifications turned into run events.

An agent message chunk becomes a :class:`~machine.runtimes.base.TextDelta`,
a tool call start a :class:`~machine.runtimes.base.ToolCall`, and the first
update that finds a tool call completed or failed its
:class:`~machine.runtimes.base.ToolResult` (once per call, its output cut at
64 KiB). Thoughts, plans, modes, commands and context-window usage have no
event of their own and are dropped.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from acp.schema import (
    AgentMessageChunk,
    ContentToolCallContent,
    ResourceContentBlock,
    TextContentBlock,
    ToolCallProgress,
    ToolCallStart,
)

from machine.runtimes.acp.client import Turn
from machine.runtimes.base import RunContext, TextDelta, ToolCall, ToolResult

__all__ = ["emit_update"]

logger = logging.getLogger(__name__)

_MAX_TOOL_OUTPUT_CHARS = 64 * 1024


async def emit_update(update: Any, turn: Turn, ctx: RunContext) -> None:
    """Emit the events one ``session/update`` stands for (none for most kinds)."""
    if isinstance(update, AgentMessageChunk):
        content = update.content
        if isinstance(content, TextContentBlock) and content.text:
            await ctx.emit(TextDelta(content.text))
    elif isinstance(update, ToolCallStart):
        call_id = update.tool_call_id
        turn.titles[call_id] = update.title
        raw = update.raw_input
        await ctx.emit(
            ToolCall(
                call_id=call_id,
                title=update.title,
                kind=update.kind or "other",
                input_json="{}" if raw is None else _json(raw),
            )
        )
        await _maybe_result(update, turn, ctx)
    elif isinstance(update, ToolCallProgress):
        if update.title:
            turn.titles[update.tool_call_id] = update.title
        await _maybe_result(update, turn, ctx)
    # Thoughts, plans, modes, commands and context-window usage have no
    # event of their own; they are dropped here on purpose.


async def _maybe_result(
    update: ToolCallStart | ToolCallProgress, turn: Turn, ctx: RunContext
) -> None:
    status = update.status
    if status not in ("completed", "failed") or update.tool_call_id in turn.finished:
        return
    turn.finished.add(update.tool_call_id)
    await ctx.emit(
        ToolResult(call_id=update.tool_call_id, status=status, output=_tool_output(update))
    )


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _tool_output(update: ToolCallStart | ToolCallProgress) -> str:
    """Text of a finished tool call: its text content, else its raw output."""
    parts: list[str] = []
    for item in update.content or ():
        if isinstance(item, ContentToolCallContent):
            block = item.content
            if isinstance(block, TextContentBlock):
                parts.append(block.text)
            elif isinstance(block, ResourceContentBlock):
                parts.append(block.uri)
    text = "\n".join(parts)
    if not text and update.raw_output is not None:
        raw = update.raw_output
        text = raw if isinstance(raw, str) else _json(raw)
    if len(text) > _MAX_TOOL_OUTPUT_CHARS:
        text = text[:_MAX_TOOL_OUTPUT_CHARS] + "\n[truncated]"
    return text
