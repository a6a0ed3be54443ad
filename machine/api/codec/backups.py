"""Backups, verifies, imports and restores, and what ``status`` shows of backups,
to and from machine.v1 messages.

A backup's time on the wire is its manifest's when the manifest opens, else
the one its id names. A recovery private key sent by the CLI is read here and
never logged.
"""

from __future__ import annotations

import logging

from machine.api.codec.fields import time_field
from machine.api.views import BackupView, VerifyReport
from machine.backups.chain import Chain
from machine.backups.engine import BackupResult
from machine.backups.service import BackupStatus, RestoreCheck
from machine.backups.transfer import InResult, SettingDiff, SettingsNote
from machine.formats.backup import BackupManifest
from shared.backup_target import ManifestInfo
from shared.crypto import BoxKeyPair, decode_private_key
from shared.errors import InvalidArgument
from shared.ids import id_time_ms
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.timestamps import from_seconds, to_seconds

__all__ = [
    "backup_info_to_pb",
    "backup_result_to_pb",
    "backup_status_from_pb",
    "backup_status_to_pb",
    "backup_view_from_pb",
    "backup_view_to_pb",
    "in_result_from_pb",
    "in_result_to_pb",
    "recovery_key_from_pb",
    "restore_result_to_pb",
    "verify_from_pb",
    "verify_to_pb",
]

logger = logging.getLogger(__name__)


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
    info: ManifestInfo,
    manifest: BackupManifest | None,
    problem: str = "",
    *,
    chain: Chain | None = None,
) -> pb.Backup:
    """A stored backup; ``manifest`` is None when it does not open with this machine's
    key, and ``problem`` says why; ``chain`` (a :class:`machine.backups.chain.Chain`)
    the increments continuing it."""
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
        increments=len(chain.increments) if chain is not None else 0,
        newest_increment_at=(
            from_seconds(chain.increments[-1].created_at)
            if chain is not None and chain.increments
            else None
        ),
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
        increment_interval_seconds=round(st.increment_interval or 0),
        last_increment_at=from_seconds(st.last_increment_at) if st.last_increment_at else None,
    )


def _notes_to_pb(notes: tuple[SettingsNote, ...]) -> list[pb.AgentSettingsNote]:
    return [
        pb.AgentSettingsNote(agent_id=n.agent_id, withheld=n.withheld, problem=n.problem)
        for n in notes
    ]


def in_result_to_pb(result: InResult) -> pb.ImportResponse:
    """What an import or a restore did -> reply (the restore's has the same fields)."""
    return pb.ImportResponse(
        imported=result.restored,
        skipped=result.skipped_existing,
        skipped_erased=result.skipped_erased,
        attachments=result.attachments,
        agent_settings=_notes_to_pb(result.agent_settings),
        session_notes=result.sessions,
    )


def restore_result_to_pb(result: InResult) -> pb.RestoreResponse:
    """What a restore did -> reply."""
    return pb.RestoreResponse(
        restored=result.restored,
        skipped=result.skipped_existing,
        skipped_erased=result.skipped_erased,
        attachments=result.attachments,
        settings=[
            pb.SettingDifference(name=d.name, in_backup=d.in_backup, here=d.here)
            for d in result.settings
        ],
        agent_settings=_notes_to_pb(result.agent_settings),
        session_notes=result.sessions,
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
        increments=b.increments,
        newest_increment_at=(
            from_seconds(b.newest_increment_at) if b.newest_increment_at is not None else None
        ),
    )


def verify_to_pb(report: VerifyReport) -> pb.VerifyBackupResponse:
    """A verified backup -> reply."""
    return pb.VerifyBackupResponse(
        ok=report.ok,
        segments=report.segments,
        plain_bytes=report.plain_bytes,
        duration_ms=report.duration_ms,
    )


# ------------------------------------------------------------ client side
# Each reader is the inverse of the writer above (see the package docstring).


def in_result_from_pb(msg: pb.ImportResponse | pb.RestoreResponse) -> InResult:
    """An import's or a restore's reply -> what it did."""
    restored = msg.imported if isinstance(msg, pb.ImportResponse) else msg.restored
    settings = () if isinstance(msg, pb.ImportResponse) else msg.settings
    return InResult(
        restored=tuple(restored),
        skipped_existing=tuple(msg.skipped),
        skipped_erased=tuple(msg.skipped_erased),
        attachments=msg.attachments,
        settings=tuple(SettingDiff(d.name, d.in_backup, d.here) for d in settings),
        agent_settings=tuple(
            SettingsNote(n.agent_id, tuple(n.withheld), n.problem) for n in msg.agent_settings
        ),
        sessions=tuple(msg.session_notes),
    )


def backup_view_from_pb(msg: pb.Backup) -> BackupView:
    """Message -> a backup as shown."""
    return BackupView(
        id=msg.id,
        created_at=time_field(msg, "created_at"),
        agents=msg.agents,
        uploaded_bytes=msg.uploaded_bytes,
        size_bytes=msg.size_bytes,
        segments=msg.segments,
        uploaded_segments=msg.uploaded_segments,
        opens=msg.opens,
        pruned=tuple(msg.pruned),
        problem=msg.problem,
        increments=msg.increments,
        newest_increment_at=time_field(msg, "newest_increment_at"),
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
        last_backup_at=time_field(msg, "last_backup_at"),
        last_backup_id=msg.last_backup_id,
        last_backup_bytes=msg.last_backup_bytes,
        next_run_at=time_field(msg, "next_run_at") or 0.0,
        last_check=check,
        recovery_key=msg.recovery_key,
        warnings=tuple(msg.warnings),
        increment_interval=float(msg.increment_interval_seconds) or None,
        last_increment_at=time_field(msg, "last_increment_at"),
    )
