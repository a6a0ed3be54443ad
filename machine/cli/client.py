"""The typed client of the local machine daemon, as the CLI uses it.

:class:`MachineClient` dials the daemon's Unix socket and offers one method
per RPC. Methods take plain values and return domain records
(:mod:`machine.models`) or the small views of :mod:`machine.api.views`; streams
are async iterators of them. A refused call raises the domain error the
daemon raised (rebuilt by :func:`shared.rpc.rpc_errors`, the gRPC error as
its ``__cause__``); a daemon that does not answer raises
:class:`DaemonNotRunning`. Protobuf stops here and in :mod:`machine.api.codec`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from types import TracebackType
from typing import TypeVar

import grpc.aio

from machine.api import codec
from machine.api.views import (
    BackupProgress,
    BackupView,
    DaemonStatus,
    DatabaseCheck,
    RecoveryKeyText,
    ScheduleView,
    SearchResult,
    VerifyReport,
)
from machine.backups.transfer import InResult
from machine.config import MachineConfig
from machine.erasure.service import DeleteResult, ErasureView
from machine.models import AgentRecord, AttachmentRecord, RunRecord, ScheduleRunRecord, StoredEvent
from shared.crypto import BoxKeyPair, encode_private_key
from shared.errors import AgentsError, InvalidState, TransientError
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from shared.rpc import from_server, rpc_errors
from shared.timestamps import from_seconds

__all__ = ["MAX_MESSAGE", "DaemonNotRunning", "DaemonUnreachable", "MachineClient"]

logger = logging.getLogger(__name__)

#: The largest message the client sends (a prompt read from stdin included).
MAX_MESSAGE = 64 * 1024 * 1024

_M = TypeVar("_M")
_T = TypeVar("_T")


class DaemonNotRunning(AgentsError):
    """The daemon's socket does not answer (``during_call``: it stopped answering
    after the call reached it, so whether the call took effect is unknown)."""

    def __init__(self, cfg: MachineConfig, *, during_call: bool = False) -> None:
        if during_call:
            message = (
                f"the machine daemon stopped answering during the call (on {cfg.socket});"
                " whether it was done shows once the daemon runs again (its log says why"
                " it stopped)"
            )
        else:
            message = f"the machine daemon is not running (no answer on {cfg.socket})"
        super().__init__(message)
        self.data_dir = cfg.data_dir
        self.during_call = during_call


def _never_connected(exc: BaseException | None) -> bool:
    """Whether a failed call never reached a daemon (nothing listening), as opposed
    to one whose daemon went away while it ran (the socket closed or reset)."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return True
    return "failed to connect" in (exc.details() or "")


class DaemonUnreachable(AgentsError):
    """The daemon's socket cannot be reached by this user (permissions)."""


def _key_text(recovery: BoxKeyPair | None) -> str:
    # Sent over the local socket only; the daemon never logs it.
    return encode_private_key(recovery.private_key) if recovery is not None else ""


class MachineClient:
    """The local daemon's RPCs as typed async methods (an async context manager)."""

    def __init__(self, cfg: MachineConfig) -> None:
        self._cfg = cfg
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.MachineServiceAsyncStub | None = None

    async def __aenter__(self) -> MachineClient:
        try:
            present = self._cfg.socket.exists()
        except OSError as e:  # a folder on the way this user may not enter
            raise DaemonUnreachable(
                f"cannot reach the machine daemon at {self._cfg.socket}: {e.strerror or e}"
                " (run this as the user the daemon runs as)"
            ) from None
        if not present:
            raise DaemonNotRunning(self._cfg)
        self._channel = grpc.aio.insecure_channel(
            f"unix://{self._cfg.socket}",
            options=[("grpc.max_send_message_length", MAX_MESSAGE)],
        )
        self._stub = pb_grpc.MachineServiceStub(self._channel)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._channel is not None:
            await self._channel.close(None)
        self._channel = self._stub = None

    @property
    def _rpc(self) -> pb_grpc.MachineServiceAsyncStub:
        if self._stub is None:
            raise InvalidState("machine client", "not open: use it in `async with`")
        return self._stub

    @contextlib.asynccontextmanager
    async def _errors(self) -> AsyncIterator[None]:
        """Domain errors for gRPC failures; an unavailable daemon is not running.

        A TransientError the daemon itself answered with (the control plane or
        the backup target is down) is passed on as it is: the daemon runs.
        """
        try:
            async with rpc_errors():
                yield
        except TransientError as e:
            if from_server(e.__cause__):
                raise
            during = not _never_connected(e.__cause__)
            raise DaemonNotRunning(self._cfg, during_call=during) from e

    async def _call(self, reply: Awaitable[_M], decode: Callable[[_M], _T]) -> _T:
        """Await one unary call and decode its reply."""
        async with self._errors():
            msg: _M = await reply
        return decode(msg)

    async def _stream(
        self, call: AsyncIterable[_M], decode: Callable[[_M], _T]
    ) -> AsyncIterator[_T]:
        """The decoded messages of a server stream."""
        async with self._errors():
            async for msg in call:
                yield decode(msg)

    # ------------------------------------------------------------ daemon

    async def status(self) -> DaemonStatus:
        """The daemon's version, counts and backups."""
        return await self._call(self._rpc.Status(pb.StatusRequest()), codec.status_from_pb)

    async def check_database(self) -> DatabaseCheck:
        """A full integrity check of machine.db, run by the daemon."""
        reply = self._rpc.CheckDatabase(pb.CheckDatabaseRequest())
        return await self._call(reply, codec.check_from_pb)

    # ------------------------------------------------------------ agents

    async def create_agent(
        self, name: str, folder: str, *, runtime: str = "", settings_json: str = ""
    ) -> AgentRecord:
        """A new agent working in ``folder`` (absolute); empty values take the defaults."""
        request = pb.CreateAgentRequest(
            name=name, folder=folder, runtime=runtime, settings_json=settings_json
        )
        return await self._call(self._rpc.CreateAgent(request), codec.agent_from_pb)

    async def list_agents(self, *, include_archived: bool = False) -> list[AgentRecord]:
        """The agents, archived ones too when asked."""
        reply = self._rpc.ListAgents(pb.ListAgentsRequest(include_archived=include_archived))
        return await self._call(reply, lambda m: [codec.agent_from_pb(a) for a in m.agents])

    async def get_agent(self, agent_id: str) -> AgentRecord:
        """One agent."""
        reply = self._rpc.GetAgent(pb.GetAgentRequest(agent_id=agent_id))
        return await self._call(reply, codec.agent_from_pb)

    async def rename_agent(self, agent_id: str, name: str) -> AgentRecord:
        """The agent renamed."""
        reply = self._rpc.RenameAgent(pb.RenameAgentRequest(agent_id=agent_id, name=name))
        return await self._call(reply, codec.agent_from_pb)

    async def configure_agent(self, agent_id: str, settings_json: str) -> AgentRecord:
        """The agent with its runtime settings replaced by ``settings_json``."""
        request = pb.UpdateAgentSettingsRequest(agent_id=agent_id, settings_json=settings_json)
        return await self._call(self._rpc.UpdateAgentSettings(request), codec.agent_from_pb)

    async def archive_agent(self, agent_id: str) -> AgentRecord:
        """The agent archived."""
        reply = self._rpc.ArchiveAgent(pb.ArchiveAgentRequest(agent_id=agent_id))
        return await self._call(reply, codec.agent_from_pb)

    async def unarchive_agent(self, agent_id: str) -> AgentRecord:
        """The agent active again."""
        reply = self._rpc.UnarchiveAgent(pb.UnarchiveAgentRequest(agent_id=agent_id))
        return await self._call(reply, codec.agent_from_pb)

    async def delete_agent(self, agent_id: str) -> DeleteResult:
        """Erase an archived agent everywhere the machine reaches."""
        reply = self._rpc.DeleteAgent(pb.DeleteAgentRequest(agent_id=agent_id))
        return await self._call(reply, codec.delete_result_from_pb)

    async def list_erasures(self) -> list[ErasureView]:
        """The erasure receipts."""
        reply = self._rpc.ListErasures(pb.ListErasuresRequest())
        return await self._call(reply, lambda m: [codec.erasure_from_pb(e) for e in m.erasures])

    async def upload_attachment(
        self,
        agent_id: str,
        file_name: str,
        size: int,
        chunks: Iterable[bytes],
        media_type: str = "",
    ) -> AttachmentRecord:
        """Store a file of ``size`` bytes for the agent's next prompt; ``media_type``
        empty lets the daemon guess it from ``file_name``."""

        async def parts() -> AsyncIterator[pb.UploadAttachmentRequest]:
            header = pb.AttachmentHeader(
                agent_id=agent_id, file_name=file_name, size=size, media_type=media_type
            )
            yield pb.UploadAttachmentRequest(header=header)
            for chunk in chunks:
                yield pb.UploadAttachmentRequest(chunk=chunk)

        def decode(m: pb.Attachment) -> AttachmentRecord:
            return AttachmentRecord(
                m.sha256, m.size, m.agent_id, file_name, media_type=m.media_type
            )

        return await self._call(self._rpc.UploadAttachment(parts()), decode)

    # ------------------------------------------------------------ runs

    def prompt(
        self, agent_id: str, text: str, attachments: Iterable[str] = ()
    ) -> AsyncIterator[StoredEvent]:
        """Start a run and stream its events until it ends."""
        request = pb.PromptRequest(agent_id=agent_id, text=text, attachments=list(attachments))
        return self._stream(self._rpc.Prompt(request), codec.event_from_pb)

    def replay(
        self, agent_id: str, *, after_seq: int = 0, follow: bool = False
    ) -> AsyncIterator[StoredEvent]:
        """The agent's stored events after ``after_seq``; then new ones when following."""
        request = pb.ReplayRequest(agent_id=agent_id, after_seq=after_seq, follow=follow)
        return self._stream(self._rpc.Replay(request), codec.event_from_pb)

    async def cancel_run(self, run_id: str) -> RunRecord:
        """The run, cancelled."""
        reply = self._rpc.CancelRun(pb.CancelRunRequest(run_id=run_id))
        return await self._call(reply, codec.run_from_pb)

    async def answer_permission(
        self, run_id: str, request_id: str, option_id: str, *, remember: bool = False
    ) -> RunRecord:
        """Answer a run's permission request; the run as it is after the answer."""
        request = pb.AnswerPermissionRequest(
            run_id=run_id, request_id=request_id, option_id=option_id, remember=remember
        )
        reply = self._rpc.AnswerPermission(request)
        return await self._call(reply, lambda m: codec.run_from_pb(m.run))

    async def list_runs(self, agent_id: str, *, limit: int = 0) -> list[RunRecord]:
        """The agent's runs, newest first (``limit`` 0: the daemon's default)."""
        reply = self._rpc.ListRuns(pb.ListRunsRequest(agent_id=agent_id, limit=limit))
        return await self._call(reply, lambda m: [codec.run_from_pb(r) for r in m.runs])

    async def search(self, query: str, *, agent_id: str = "", limit: int = 0) -> SearchResult:
        """Full-text matches in conversations, tool logs and summaries."""
        request = pb.SearchRequest(query=query, agent_id=agent_id, limit=limit)
        return await self._call(self._rpc.Search(request), codec.search_from_pb)

    # ------------------------------------------------------------ schedules

    async def create_schedule(
        self, agent_id: str, cron: str, prompt: str, *, time_zone: str = "", missed: str = ""
    ) -> ScheduleView:
        """A new schedule; empty values take the daemon's defaults."""
        request = pb.CreateScheduleRequest(
            agent_id=agent_id, cron=cron, prompt=prompt, time_zone=time_zone, missed=missed
        )
        return await self._call(self._rpc.CreateSchedule(request), codec.schedule_from_pb)

    async def list_schedules(self, agent_id: str = "") -> list[ScheduleView]:
        """The schedules of one agent, or all of them."""
        reply = self._rpc.ListSchedules(pb.ListSchedulesRequest(agent_id=agent_id))
        return await self._call(reply, lambda m: [codec.schedule_from_pb(s) for s in m.schedules])

    async def pause_schedule(self, schedule_id: str) -> ScheduleView:
        """The schedule, paused."""
        reply = self._rpc.PauseSchedule(pb.PauseScheduleRequest(schedule_id=schedule_id))
        return await self._call(reply, codec.schedule_from_pb)

    async def resume_schedule(self, schedule_id: str) -> ScheduleView:
        """The schedule, firing again from now."""
        reply = self._rpc.ResumeSchedule(pb.ResumeScheduleRequest(schedule_id=schedule_id))
        return await self._call(reply, codec.schedule_from_pb)

    async def delete_schedule(self, schedule_id: str) -> None:
        """Delete a schedule."""
        reply = self._rpc.DeleteSchedule(pb.DeleteScheduleRequest(schedule_id=schedule_id))
        await self._call(reply, lambda m: None)

    async def list_schedule_runs(
        self, schedule_id: str, *, limit: int = 0
    ) -> list[ScheduleRunRecord]:
        """A schedule's fires, newest first."""
        request = pb.ListScheduleRunsRequest(schedule_id=schedule_id, limit=limit)
        reply = self._rpc.ListScheduleRuns(request)
        return await self._call(reply, lambda m: [codec.schedule_run_from_pb(r) for r in m.runs])

    # ------------------------------------------------------------ backups

    def backup_now(self) -> AsyncIterator[BackupProgress | BackupView]:
        """Back up now: progress steps, then the backup made (the last item)."""

        def decode(m: pb.BackupNowUpdate) -> BackupProgress | BackupView:
            if m.HasField("progress"):
                return BackupProgress(m.progress.stage, m.progress.done, m.progress.total)
            return codec.backup_view_from_pb(m.backup)

        return self._stream(self._rpc.BackupNow(pb.BackupNowRequest()), decode)

    async def list_backups(
        self, from_dir: str = "", recovery: BoxKeyPair | None = None
    ) -> list[BackupView]:
        """Backups at the target (or in ``from_dir``), newest first; ``recovery``
        opens those made with another machine's key."""
        request = pb.ListBackupsRequest(from_dir=from_dir, recovery_private_key=_key_text(recovery))
        reply = self._rpc.ListBackups(request)
        return await self._call(reply, lambda m: [codec.backup_view_from_pb(b) for b in m.backups])

    async def verify_backup(
        self, backup_id: str, *, from_dir: str = "", recovery: BoxKeyPair | None = None
    ) -> VerifyReport:
        """Open a backup and authenticate every segment."""
        request = pb.VerifyBackupRequest(
            backup_id=backup_id, from_dir=from_dir, recovery_private_key=_key_text(recovery)
        )
        return await self._call(self._rpc.VerifyBackup(request), codec.verify_from_pb)

    async def restore(
        self,
        backup_id: str,
        *,
        from_dir: str = "",
        recovery: BoxKeyPair | None = None,
        at: float | None = None,
    ) -> InResult:
        """Restore a backup's agents (archived), skipping those already here. With no
        ``backup_id``: to the time ``at`` (None: the newest), increments included."""
        request = pb.RestoreRequest(
            backup_id=backup_id,
            from_dir=from_dir,
            recovery_private_key=_key_text(recovery),
            at=from_seconds(at),
        )
        return await self._call(self._rpc.Restore(request), codec.in_result_from_pb)

    async def create_recovery_key(self, public_key: str = "") -> RecoveryKeyText:
        """Make the machine's recovery key; its private half is in the reply only.

        With ``public_key`` (agpk1_…), keep that one instead: the caller made the
        pair and showed its private half (the reply's is then empty)."""
        reply = self._rpc.CreateRecoveryKey(pb.CreateRecoveryKeyRequest(public_key=public_key))
        return await self._call(reply, lambda m: RecoveryKeyText(m.private_key, m.public_key))

    # ------------------------------------------------------------ export / import

    def export(self, agent_ids: Iterable[str] = (), folder: str = "") -> AsyncIterator[bytes]:
        """The .tar.gz export of the agents named or working in ``folder``, in chunks."""
        request = pb.ExportRequest(agent_ids=list(agent_ids), folder=folder)
        return self._stream(self._rpc.Export(request), lambda m: m.data)

    async def import_export(self, chunks: Iterable[bytes]) -> InResult:
        """Import an export's bytes (the agents arrive archived)."""

        async def parts() -> AsyncIterator[pb.ImportChunk]:
            for chunk in chunks:
                yield pb.ImportChunk(data=chunk)

        return await self._call(self._rpc.Import(parts()), codec.in_result_from_pb)
