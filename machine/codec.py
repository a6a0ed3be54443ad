"""Translate domain records to and from machine.v1 protobuf messages.

Only the servicer and the CLI client use this module: protobuf stops here.
"""

from __future__ import annotations

import json
import logging

from machine.backup import BackupResult
from machine.backup_format import BackupManifest
from machine.backup_service import BackupStatus
from machine.erasure import ErasureView
from machine.models import (
    AgentRecord,
    AgentState,
    EventKind,
    RunErrorCode,
    RunRecord,
    RunState,
    ScheduleRecord,
    ScheduleRunRecord,
    SearchHit,
    StoredEvent,
)
from shared.backup_target import ManifestInfo
from shared.crypto import BoxKeyPair, decode_private_key
from shared.errors import InvalidArgument
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.timestamps import from_seconds

__all__ = ["agent_to_pb", "event_to_pb", "hit_to_pb", "run_to_pb"]

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


def schedule_to_pb(s: ScheduleRecord, next_fire: float | None) -> pb.Schedule:
    """Domain schedule (and when it fires next) -> message."""
    return pb.Schedule(
        id=s.id,
        agent_id=s.agent_id,
        cron=s.cron,
        prompt=s.prompt,
        next_run_at=from_seconds(next_fire),
        time_zone=s.time_zone,
        enabled=s.enabled,
        missed=s.missed,
        created_at=from_seconds(s.created_at),
        last_fire_at=from_seconds(s.last_fire),
    )


def schedule_run_to_pb(r: ScheduleRunRecord) -> pb.ScheduleRun:
    """Domain schedule fire -> message."""
    return pb.ScheduleRun(
        schedule_id=r.schedule_id,
        fire_time=from_seconds(r.fire_time),
        run_id=r.run_id,
        result=r.result,
        detail=r.detail,
        recorded_at=from_seconds(r.recorded_at),
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


_ID_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"


def _backup_time(backup_id: str) -> float:
    """When a backup was made, from its id (its first ten characters are the time in ms)."""
    ms = 0
    for ch in backup_id.partition("_")[2][:10]:
        ms = ms * 32 + _ID_ALPHABET.index(ch)
    return ms / 1000


def backup_result_to_pb(result: BackupResult) -> pb.Backup:
    """A backup just made."""
    return pb.Backup(
        id=result.backup_id,
        created_at=from_seconds(_backup_time(result.backup_id)),
        uploaded_bytes=result.uploaded_bytes,
        size_bytes=result.stored_bytes,
        segments=result.segments,
        uploaded_segments=result.uploaded,
        opens=True,
        pruned=list(result.pruned.manifests) if result.pruned else [],
    )


def backup_info_to_pb(info: ManifestInfo, manifest: BackupManifest | None) -> pb.Backup:
    """A stored backup; ``manifest`` is None when it does not open with this machine's key."""
    if manifest is None:
        return pb.Backup(
            id=info.backup_id,
            size_bytes=info.size,
            opens=False,
            created_at=from_seconds(_backup_time(info.backup_id)),
        )
    return pb.Backup(
        id=info.backup_id,
        size_bytes=info.size,
        opens=True,
        created_at=from_seconds(manifest.created_at),
        segments=len(manifest.segments),
        agents=sum(1 for s in manifest.segments if s.kind == "agent"),
    )


def recovery_key_from_pb(text: str) -> BoxKeyPair | None:
    """A recovery private key sent by the CLI (never logged), or None when empty."""
    if not text:
        return None
    try:
        return BoxKeyPair.from_private(decode_private_key(text))
    except InvalidArgument as e:
        raise InvalidArgument("recovery_private_key", e.reason) from None


def backup_status_to_pb(st: BackupStatus) -> pb.BackupStatus:
    """What ``status`` shows of backups."""
    check = st.last_check
    return pb.BackupStatus(
        target=st.target,
        keep=st.keep,
        last_backup_at=from_seconds(st.last_backup_at) if st.last_backup_at else None,
        last_backup_id=st.last_backup_id,
        last_backup_bytes=st.last_backup_bytes,
        next_run_at=from_seconds(st.next_run_at),
        last_check_at=from_seconds(check.at) if check else None,
        last_check_ok=check.ok if check else False,
        last_check_problem=check.problem if check else "",
        recovery_key=st.recovery_key,
        warnings=list(st.warnings),
    )


def erasure_to_pb(view: ErasureView) -> pb.Erasure:
    """An erasure receipt."""
    return pb.Erasure(
        agent_id=view.agent_id,
        state=view.state,
        attempts=view.attempts,
        erased_at=from_seconds(view.erased_at),
        machine_data=view.machine_data,
        attachments=view.attachments,
        runtime_copy=view.runtime_copy,
        backups=view.backups,
        detail=view.detail,
    )
