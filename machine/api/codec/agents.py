"""Agents, their runs and events, and search hits to and from machine.v1 messages.

A run event's payload travels in the oneof field of its kind; read back, it is
the stored event's JSON object again. Token counts a runtime did not report
stay unset on the wire (unknown, not 0).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from google.protobuf.message import Message

from machine.api.codec.fields import time_field
from machine.api.views import SearchResult
from machine.models import (
    AgentRecord,
    AgentState,
    EventKind,
    RunErrorCode,
    RunRecord,
    RunState,
    SearchHit,
    StoredEvent,
)
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.timestamps import from_seconds

__all__ = [
    "agent_from_pb",
    "agent_to_pb",
    "event_from_pb",
    "event_to_pb",
    "hit_from_pb",
    "hit_to_pb",
    "run_from_pb",
    "run_to_pb",
    "search_from_pb",
    "search_to_pb",
]

logger = logging.getLogger(__name__)


_AGENT_STATE = {
    AgentState.ACTIVE: pb.AGENT_STATE_ACTIVE,
    AgentState.ARCHIVED: pb.AGENT_STATE_ARCHIVED,
}
_RUN_STATE = {
    RunState.QUEUED: pb.RUN_STATE_QUEUED,
    RunState.RUNNING: pb.RUN_STATE_RUNNING,
    RunState.WAITING_PERMISSION: pb.RUN_STATE_WAITING_PERMISSION,
    RunState.FINISHED: pb.RUN_STATE_FINISHED,
    RunState.FAILED: pb.RUN_STATE_FAILED,
    RunState.INTERRUPTED: pb.RUN_STATE_INTERRUPTED,
    RunState.CANCELLED: pb.RUN_STATE_CANCELLED,
}


def agent_to_pb(agent: AgentRecord) -> pb.Agent:
    """Domain agent -> message."""
    return pb.Agent(
        id=agent.id,
        name=agent.name,
        folder=agent.folder,
        runtime=agent.runtime,
        settings_json=json.dumps(agent.settings, sort_keys=True),
        state=_AGENT_STATE[agent.state],
        origin_machine=agent.origin_machine,
        local=agent.local,
        session_id=agent.session_id or "",
        created_at=from_seconds(agent.created_at),
        updated_at=from_seconds(agent.updated_at),
        last_seq=agent.last_seq,
    )


def run_to_pb(run: RunRecord) -> pb.Run:
    """Domain run -> message."""
    return pb.Run(
        id=run.id,
        agent_id=run.agent_id,
        state=_RUN_STATE[run.state],
        prompt=run.prompt,
        created_at=from_seconds(run.created_at),
        started_at=from_seconds(run.started_at),
        finished_at=from_seconds(run.finished_at),
        usage=pb.Usage(input_tokens=run.input_tokens, output_tokens=run.output_tokens),
        duration_ms=run.duration_ms,
        error_code=pb.RunErrorCode.Value(
            run.error_code.value if run.error_code else "RUN_ERROR_CODE_UNSPECIFIED"
        ),
    )


def event_to_pb(ev: StoredEvent) -> pb.RunEvent:
    """Stored event -> message (payload in its oneof field)."""
    out = pb.RunEvent(
        agent_id=ev.agent_id,
        seq=ev.seq,
        run_id=ev.run_id,
        kind=pb.RunEventKind.Value(ev.kind.value),
        time=from_seconds(ev.time),
    )
    p = ev.payload
    if ev.kind is EventKind.RUN_STARTED:
        out.run_started.CopyFrom(
            pb.RunStarted(
                prompt=p.get("prompt", ""),
                attachments=p.get("attachments", []),
                runtime=p.get("runtime", ""),
            )
        )
    elif ev.kind is EventKind.TEXT_DELTA:
        out.text_delta.CopyFrom(pb.TextDelta(text=p.get("text", "")))
    elif ev.kind is EventKind.TOOL_CALL:
        out.tool_call.CopyFrom(
            pb.ToolCall(
                call_id=p.get("call_id", ""),
                title=p.get("title", ""),
                tool_kind=p.get("tool_kind", ""),
                input_json=p.get("input_json", ""),
            )
        )
    elif ev.kind is EventKind.TOOL_RESULT:
        out.tool_result.CopyFrom(
            pb.ToolResult(
                call_id=p.get("call_id", ""), status=p.get("status", ""), output=p.get("output", "")
            )
        )
    elif ev.kind is EventKind.PERMISSION_REQUEST:
        out.permission_request.CopyFrom(
            pb.PermissionRequest(
                request_id=p.get("request_id", ""),
                call_id=p.get("call_id", ""),
                title=p.get("title", ""),
                options=[pb.PermissionOption(**o) for o in p.get("options", [])],
            )
        )
    elif ev.kind is EventKind.PERMISSION_ANSWERED:
        out.permission_answered.CopyFrom(
            pb.PermissionAnswered(
                request_id=p.get("request_id", ""),
                option_id=p.get("option_id", ""),
                remember=bool(p.get("remember")),
                by_rule=bool(p.get("by_rule")),
            )
        )
    elif ev.kind is EventKind.RUN_FINISHED:
        usage = p.get("usage", {})
        out.run_finished.CopyFrom(
            pb.RunFinished(
                stop_reason=p.get("stop_reason", ""),
                # Absent when the runtime did not report usage (unknown, not 0).
                usage=pb.Usage(
                    input_tokens=usage.get("input_tokens"),
                    output_tokens=usage.get("output_tokens"),
                ),
                duration_ms=p.get("duration_ms", 0),
            )
        )
    elif ev.kind is EventKind.RUN_ERROR:
        code = RunErrorCode(p.get("code", RunErrorCode.RUNTIME_FAILED.value))
        out.run_error.CopyFrom(
            pb.RunError(code=pb.RunErrorCode.Value(code.value), message=p.get("message", ""))
        )
    return out


def hit_to_pb(hit: SearchHit) -> pb.SearchHit:
    """Search hit -> message."""
    return pb.SearchHit(
        agent_id=hit.agent_id,
        agent_name=hit.agent_name,
        archived=hit.archived,
        run_id=hit.run_id,
        seq=hit.seq,
        source=hit.source,
        snippet=hit.snippet,
    )


def search_to_pb(result: SearchResult) -> pb.SearchResponse:
    """Search matches -> reply."""
    return pb.SearchResponse(hits=[hit_to_pb(h) for h in result.hits], indexing=result.indexing)


# ------------------------------------------------------------ client side
# Each reader is the inverse of the writer above (see the package docstring).


_AGENT_STATE_OF = {v: k for k, v in _AGENT_STATE.items()}
_RUN_STATE_OF = {v: k for k, v in _RUN_STATE.items()}


def agent_from_pb(msg: pb.Agent) -> AgentRecord:
    """Message -> domain agent."""
    return AgentRecord(
        id=msg.id,
        name=msg.name,
        folder=msg.folder,
        runtime=msg.runtime,
        settings=json.loads(msg.settings_json) if msg.settings_json else {},
        state=_AGENT_STATE_OF[msg.state],
        origin_machine=msg.origin_machine,
        local=msg.local,
        session_id=msg.session_id or None,
        created_at=time_field(msg, "created_at") or 0.0,
        updated_at=time_field(msg, "updated_at") or 0.0,
        last_seq=msg.last_seq,
    )


def _usage(msg: pb.Usage) -> tuple[int | None, int | None]:
    # Unset means the runtime did not report usage: unknown, not 0.
    return (
        msg.input_tokens if msg.HasField("input_tokens") else None,
        msg.output_tokens if msg.HasField("output_tokens") else None,
    )


def run_from_pb(msg: pb.Run) -> RunRecord:
    """Message -> domain run (the fields the wire carries)."""
    input_tokens, output_tokens = _usage(msg.usage)
    code = pb.RunErrorCode.Name(msg.error_code)
    return RunRecord(
        id=msg.id,
        agent_id=msg.agent_id,
        state=_RUN_STATE_OF[msg.state],
        prompt=msg.prompt,
        attachments=(),
        created_at=time_field(msg, "created_at") or 0.0,
        started_at=time_field(msg, "started_at"),
        finished_at=time_field(msg, "finished_at"),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        duration_ms=msg.duration_ms,
        stop_reason=None,
        error_code=None if msg.error_code == pb.RUN_ERROR_CODE_UNSPECIFIED else RunErrorCode(code),
    )


def _payload(msg: pb.RunEvent) -> dict[str, Any]:
    """The oneof payload as the stored event's JSON object (what event_to_pb reads)."""
    kind = msg.WhichOneof("payload")
    if kind is None:
        return {}
    part: Message = getattr(msg, kind)
    if kind == "permission_request":
        req = msg.permission_request
        return {
            "request_id": req.request_id,
            "call_id": req.call_id,
            "title": req.title,
            "options": [
                {"option_id": o.option_id, "name": o.name, "kind": o.kind} for o in req.options
            ],
        }
    if kind == "run_finished":
        fin = msg.run_finished
        input_tokens, output_tokens = _usage(fin.usage)
        return {
            "stop_reason": fin.stop_reason,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
            "duration_ms": fin.duration_ms,
        }
    if kind == "run_error":
        code = msg.run_error.code
        name = pb.RunErrorCode.Name(code) if code else RunErrorCode.RUNTIME_FAILED.value
        return {"code": name, "message": msg.run_error.message}
    # The other payloads are flat: scalar fields and lists of strings.
    fields = part.DESCRIPTOR.fields
    return {
        f.name: list(getattr(part, f.name)) if f.is_repeated else getattr(part, f.name)
        for f in fields
    }


def event_from_pb(msg: pb.RunEvent) -> StoredEvent:
    """Message -> stored event (payload as the kind's JSON object)."""
    return StoredEvent(
        agent_id=msg.agent_id,
        seq=msg.seq,
        run_id=msg.run_id,
        kind=EventKind(pb.RunEventKind.Name(msg.kind)),
        payload=_payload(msg),
        time=time_field(msg, "time") or 0.0,
    )


def hit_from_pb(msg: pb.SearchHit) -> SearchHit:
    """Message -> search hit."""
    return SearchHit(
        agent_id=msg.agent_id,
        agent_name=msg.agent_name,
        archived=msg.archived,
        run_id=msg.run_id,
        seq=msg.seq,
        source=msg.source,
        snippet=msg.snippet,
    )


def search_from_pb(msg: pb.SearchResponse) -> SearchResult:
    """Reply -> search matches."""
    return SearchResult(tuple(hit_from_pb(h) for h in msg.hits), msg.indexing)
