"""Translate domain records to and from machine.v1 protobuf messages.

Only the servicer and the CLI's client (machine.cli.client) use this module:
protobuf stops here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message

from machine.api.views import (
    BackupView,
    DaemonStatus,
    DatabaseCheck,
    ScheduleView,
    SearchResult,
    VerifyReport,
)
from machine.app import MachineStatus
from machine.backups.engine import BackupResult
from machine.backups.service import BackupStatus, RestoreCheck
from machine.backups.transfer import InResult
from machine.erasure.service import DeleteResult, ErasureView
from machine.formats.backup import BackupManifest
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
from shared.ids import id_time_ms
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.timestamps import from_seconds, to_seconds

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


def _backup_time(backup_id: str) -> float:
    """When a backup was made, from its id (its first ten characters are the time in ms)."""
    return id_time_ms(backup_id) / 1000


def backup_result_to_pb(result: BackupResult, problem: str = "") -> pb.Backup:
    """A backup just made; ``problem``: its restore check failed, and why."""
    return pb.Backup(
        id=result.backup_id,
        agents=result.agents,
        problem=problem,
        # The manifest's time, as a listing shows it (the id's is a moment earlier).
        created_at=from_seconds(result.created_at or _backup_time(result.backup_id)),
        uploaded_bytes=result.uploaded_bytes,
        size_bytes=result.stored_bytes,
        segments=result.segments,
        uploaded_segments=result.uploaded,
        opens=True,
        pruned=list(result.pruned.manifests) if result.pruned else [],
    )


def backup_info_to_pb(
    info: ManifestInfo, manifest: BackupManifest | None, problem: str = ""
) -> pb.Backup:
    """A stored backup; ``manifest`` is None when it does not open with this machine's
    key, and ``problem`` says why."""
    if manifest is None:
        return pb.Backup(
            id=info.backup_id,
            size_bytes=info.size,
            opens=False,
            created_at=from_seconds(_backup_time(info.backup_id)),
            problem=problem,
        )
    return pb.Backup(
        id=info.backup_id,
        # As BackupNow counts it: every segment it names, and its manifest.
        size_bytes=info.size + sum(s.size for s in manifest.segments),
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


# ------------------------------------------------------------ client side
# The CLI's client reads the daemon's replies back into records. Each reader
# is the inverse of the writer above: writing a record read here gives the
# message it was read from (the CLI prints --json that way).


def _time(msg: Message, name: str) -> float | None:
    """A Timestamp field as Unix seconds; None when it is not set."""
    return to_seconds(getattr(msg, name)) if msg.HasField(name) else None


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
        created_at=_time(msg, "created_at") or 0.0,
        updated_at=_time(msg, "updated_at") or 0.0,
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
        created_at=_time(msg, "created_at") or 0.0,
        started_at=_time(msg, "started_at"),
        finished_at=_time(msg, "finished_at"),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        duration_ms=msg.duration_ms,
        stop_reason=None,
        error_code=None if msg.error_code == pb.RUN_ERROR_CODE_UNSPECIFIED else RunErrorCode(code),
    )


def schedule_from_pb(msg: pb.Schedule) -> ScheduleView:
    """Message -> domain schedule and when it fires next."""
    created = _time(msg, "created_at") or 0.0
    record = ScheduleRecord(
        id=msg.id,
        agent_id=msg.agent_id,
        cron=msg.cron,
        time_zone=msg.time_zone,
        prompt=msg.prompt,
        enabled=msg.enabled,
        missed=msg.missed,
        created_at=created,
        updated_at=created,  # not on the wire
        last_fire=_time(msg, "last_fire_at"),
    )
    return ScheduleView(record, _time(msg, "next_run_at"))


def schedule_run_from_pb(msg: pb.ScheduleRun) -> ScheduleRunRecord:
    """Message -> domain schedule fire."""
    return ScheduleRunRecord(
        schedule_id=msg.schedule_id,
        fire_time=_time(msg, "fire_time") or 0.0,
        run_id=msg.run_id,
        result=msg.result,
        detail=msg.detail,
        recorded_at=_time(msg, "recorded_at") or 0.0,
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
        time=_time(msg, "time") or 0.0,
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


def search_to_pb(result: SearchResult) -> pb.SearchResponse:
    """Search matches -> reply."""
    return pb.SearchResponse(hits=[hit_to_pb(h) for h in result.hits], indexing=result.indexing)


def search_from_pb(msg: pb.SearchResponse) -> SearchResult:
    """Reply -> search matches."""
    return SearchResult(tuple(hit_from_pb(h) for h in msg.hits), msg.indexing)


def erasure_from_pb(msg: pb.Erasure) -> ErasureView:
    """Message -> erasure receipt."""
    return ErasureView(
        agent_id=msg.agent_id,
        state=msg.state,
        erased_at=_time(msg, "erased_at") or 0.0,
        attempts=msg.attempts,
        machine_data=msg.machine_data,
        attachments=msg.attachments,
        runtime_copy=msg.runtime_copy,
        backups=msg.backups,
        detail=msg.detail,
    )


def delete_result_to_pb(result: DeleteResult) -> pb.DeleteAgentResponse:
    """What a delete did -> reply."""
    return pb.DeleteAgentResponse(
        agent_id=result.agent_id, runtime_erasure_queued=result.runtime_erasure_queued
    )


def delete_result_from_pb(msg: pb.DeleteAgentResponse) -> DeleteResult:
    """Reply -> what a delete did."""
    return DeleteResult(msg.agent_id, msg.runtime_erasure_queued)


def in_result_to_pb(result: InResult) -> pb.ImportResponse:
    """What an import or a restore did -> reply (the restore's has the same fields)."""
    return pb.ImportResponse(
        imported=result.restored,
        skipped=result.skipped_existing,
        skipped_erased=result.skipped_erased,
        attachments=result.attachments,
    )


def restore_result_to_pb(result: InResult) -> pb.RestoreResponse:
    """What a restore did -> reply."""
    return pb.RestoreResponse(
        restored=result.restored,
        skipped=result.skipped_existing,
        skipped_erased=result.skipped_erased,
        attachments=result.attachments,
    )


def in_result_from_pb(msg: pb.ImportResponse | pb.RestoreResponse) -> InResult:
    """An import's or a restore's reply -> what it did."""
    restored = msg.imported if isinstance(msg, pb.ImportResponse) else msg.restored
    return InResult(
        restored=tuple(restored),
        skipped_existing=tuple(msg.skipped),
        skipped_erased=tuple(msg.skipped_erased),
        attachments=msg.attachments,
    )


def backup_view_to_pb(b: BackupView) -> pb.Backup:
    """A backup as shown -> message."""
    return pb.Backup(
        id=b.id,
        created_at=from_seconds(b.created_at),
        agents=b.agents,
        uploaded_bytes=b.uploaded_bytes,
        size_bytes=b.size_bytes,
        segments=b.segments,
        uploaded_segments=b.uploaded_segments,
        opens=b.opens,
        pruned=b.pruned,
        problem=b.problem,
    )


def backup_view_from_pb(msg: pb.Backup) -> BackupView:
    """Message -> a backup as shown."""
    return BackupView(
        id=msg.id,
        created_at=_time(msg, "created_at"),
        agents=msg.agents,
        uploaded_bytes=msg.uploaded_bytes,
        size_bytes=msg.size_bytes,
        segments=msg.segments,
        uploaded_segments=msg.uploaded_segments,
        opens=msg.opens,
        pruned=tuple(msg.pruned),
        problem=msg.problem,
    )


def verify_to_pb(report: VerifyReport) -> pb.VerifyBackupResponse:
    """A verified backup -> reply."""
    return pb.VerifyBackupResponse(
        ok=report.ok,
        segments=report.segments,
        plain_bytes=report.plain_bytes,
        duration_ms=report.duration_ms,
    )


def verify_from_pb(msg: pb.VerifyBackupResponse) -> VerifyReport:
    """Reply -> a verified backup."""
    return VerifyReport(msg.ok, msg.segments, msg.plain_bytes, msg.duration_ms)


def backup_status_from_pb(msg: pb.BackupStatus) -> BackupStatus:
    """Message -> what ``status`` shows of backups."""
    check = None
    if msg.HasField("last_check_at"):
        check = RestoreCheck(
            ok=msg.last_check_ok,
            backup_id="",  # not on the wire
            at=to_seconds(msg.last_check_at),
            seconds=0.0,
            problem=msg.last_check_problem,
        )
    return BackupStatus(
        target=msg.target,
        keep=msg.keep,
        last_backup_at=_time(msg, "last_backup_at"),
        last_backup_id=msg.last_backup_id,
        last_backup_bytes=msg.last_backup_bytes,
        next_run_at=_time(msg, "next_run_at") or 0.0,
        last_check=check,
        recovery_key=msg.recovery_key,
        warnings=tuple(msg.warnings),
    )


def status_to_pb(st: DaemonStatus) -> pb.StatusResponse:
    """The daemon's status -> reply."""
    m = st.machine
    return pb.StatusResponse(
        joined=m.joined,
        version=st.version,
        data_dir=m.data_dir,
        machine_id=m.machine_id,
        active_agents=m.active_agents,
        archived_agents=m.archived_agents,
        open_runs=m.open_runs,
        waiting_runs=m.waiting_runs,
        runtimes=m.runtimes,
        started_at=from_seconds(m.started_at),
        schema_version=m.schema_version,
        backup=backup_status_to_pb(st.backup) if st.backup else None,
        attachment_limit=m.attachment_limit,
    )


def status_from_pb(msg: pb.StatusResponse) -> DaemonStatus:
    """Reply -> the daemon's status."""
    machine = MachineStatus(
        data_dir=msg.data_dir,
        machine_id=msg.machine_id,
        joined=msg.joined,
        active_agents=msg.active_agents,
        archived_agents=msg.archived_agents,
        open_runs=msg.open_runs,
        waiting_runs=msg.waiting_runs,
        runtimes=list(msg.runtimes),
        started_at=_time(msg, "started_at") or 0.0,
        schema_version=msg.schema_version,
        attachment_limit=msg.attachment_limit,
    )
    backup = backup_status_from_pb(msg.backup) if msg.HasField("backup") else None
    return DaemonStatus(msg.version, machine, backup)


def check_from_pb(msg: pb.CheckDatabaseResponse) -> DatabaseCheck:
    """Reply -> the daemon's integrity check of machine.db."""
    return DatabaseCheck(
        ok=msg.ok,
        problems=tuple(msg.problems),
        path=msg.path,
        checked_at=_time(msg, "checked_at"),
        duration_ms=msg.duration_ms,
    )


def message_of(record: object) -> Message:
    """The wire message of a record :class:`machine.cli.client.MachineClient` returned
    (what the CLI prints for --json, so its JSON is the daemon's reply)."""
    for cls, encode in _ENCODERS:
        if isinstance(record, cls):
            return encode(record)
    raise TypeError(f"no message for {type(record).__name__}")


_ENCODERS: tuple[tuple[type[Any], Callable[[Any], Message]], ...] = (
    (AgentRecord, agent_to_pb),
    (RunRecord, run_to_pb),
    (StoredEvent, event_to_pb),
    (ScheduleView, lambda v: schedule_to_pb(v.schedule, v.next_run_at)),
    (ScheduleRunRecord, schedule_run_to_pb),
    (SearchResult, search_to_pb),
    (ErasureView, erasure_to_pb),
    (DeleteResult, delete_result_to_pb),
    (InResult, in_result_to_pb),
    (BackupView, backup_view_to_pb),
    (VerifyReport, verify_to_pb),
    (DaemonStatus, status_to_pb),
)
