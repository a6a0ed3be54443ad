"""The servicer of the proto service `shared.pb.machine.v1.MachineService`: decode, one
domain call, encode.

Domain errors raised here are turned into gRPC statuses by
:class:`shared.rpc.ErrorInterceptor`; nothing in this module maps errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio

from machine.api import codec
from machine.api.views import DaemonStatus
from machine.app import Machine
from machine.backups.handoff import read_chunks
from machine.backups.reader import key_refused
from machine.models import StoredEvent
from machine.version import machine_version
from shared.backup_target import validate_backup_id
from shared.crypto import decode_public_key, encode_private_key, encode_public_key
from shared.errors import AgentsError, InvalidArgument
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from shared.timestamps import from_seconds, to_seconds

__all__ = ["SERVICE_NAME", "MachineServicer"]

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MachineService"].full_name

Ctx = grpc.aio.ServicerContext[Any, Any]


async def _send_events(context: Ctx, events: AsyncIterator[StoredEvent]) -> None:
    """Write each event and wait for gRPC to take it before reading the next: a
    client that does not read stops the stream's reads from the database.

    A client that goes away ends the stream quietly: the handler is cancelled,
    or a write fails on the closed call.
    """
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        async for ev in events:
            # Outside the try: an event that cannot be encoded is a fault to
            # report (the stream fails), not a client that went away.
            message = codec.event_to_pb(ev)
            try:
                await context.write(message)
            except Exception as e:
                # gRPC refuses writes on a call its client has closed (before the
                # cancellation reaches this task): the stream is over, not broken.
                logger.debug("stream ended: the call takes no more messages (%r)", e)
                return


async def _drain(parts: AsyncIterator[pb.UploadAttachmentRequest], limit: int) -> None:
    """Read (and drop) what is left of a refused upload, up to ``limit`` bytes.

    A client still sending when the server ends the call sees gRPC's own
    INTERNAL "Internal error from Core" instead of our status (a full disk,
    a bad agent id...): letting it finish sending delivers the real answer.
    """
    seen = 0
    try:
        async for msg in parts:
            seen += len(msg.chunk)
            if seen > limit:
                return
    except Exception as e:  # the client gave up meanwhile: nothing to deliver to
        logger.debug("draining a refused upload stopped: %r", e)


#: Backups whose caller left: referenced until they finish.
_background: set[asyncio.Task[Any]] = set()


async def _write_quietly(context: Ctx, message: Any) -> None:
    try:
        await context.write(message)
    except Exception as e:  # the client left; the work goes on
        logger.debug("progress not delivered: %r", e)


def _backup_id(value: str) -> str:
    return validate_backup_id(value, "backup_id")


class MachineServicer(pb_grpc.MachineServiceServicer):
    """Thin adapter from machine.v1 messages to the :class:`Machine` domain."""

    def __init__(self, machine: Machine) -> None:
        self._m = machine

    # ---------------------------------------------------------------- agents

    async def CreateAgent(self, request: pb.CreateAgentRequest, context: Ctx) -> pb.Agent:
        agent = await self._m.agents.create(
            name=request.name,
            folder=request.folder,
            runtime=request.runtime,
            settings_json=request.settings_json,
        )
        return codec.agent_to_pb(agent)

    async def ListAgents(
        self, request: pb.ListAgentsRequest, context: Ctx
    ) -> pb.ListAgentsResponse:
        agents = await self._m.agents.list(include_archived=request.include_archived)
        return pb.ListAgentsResponse(agents=[codec.agent_to_pb(a) for a in agents])

    async def GetAgent(self, request: pb.GetAgentRequest, context: Ctx) -> pb.Agent:
        return codec.agent_to_pb(await self._m.agents.get(request.agent_id))

    async def RenameAgent(self, request: pb.RenameAgentRequest, context: Ctx) -> pb.Agent:
        return codec.agent_to_pb(await self._m.agents.rename(request.agent_id, request.name))

    async def UpdateAgentSettings(
        self, request: pb.UpdateAgentSettingsRequest, context: Ctx
    ) -> pb.Agent:
        agent = await self._m.agents.configure(request.agent_id, request.settings_json)
        return codec.agent_to_pb(agent)

    async def ArchiveAgent(self, request: pb.ArchiveAgentRequest, context: Ctx) -> pb.Agent:
        return codec.agent_to_pb(await self._m.agents.archive(request.agent_id))

    async def UnarchiveAgent(self, request: pb.UnarchiveAgentRequest, context: Ctx) -> pb.Agent:
        return codec.agent_to_pb(await self._m.agents.unarchive(request.agent_id))

    # ---------------------------------------------------------------- runs

    # Prompt and Replay write their messages themselves (flow control, quiet
    # cancellation), which the generated base class's iterator type does not describe.
    async def Prompt(self, request: pb.PromptRequest, context: Ctx) -> None:  # type: ignore[override]
        with self._m.streams.opened(context.peer()):
            events = await self._m.runs.prompt(
                request.agent_id, request.text, list(request.attachments)
            )
            await _send_events(context, events)

    async def Replay(self, request: pb.ReplayRequest, context: Ctx) -> None:  # type: ignore[override]
        with self._m.streams.opened(context.peer()):
            events = await self._m.runs.replay(
                request.agent_id, request.after_seq, follow=request.follow
            )
            await _send_events(context, events)

    async def CancelRun(self, request: pb.CancelRunRequest, context: Ctx) -> pb.Run:
        return codec.run_to_pb(await self._m.runs.cancel(request.run_id))

    async def AnswerPermission(
        self, request: pb.AnswerPermissionRequest, context: Ctx
    ) -> pb.AnswerPermissionResponse:
        run = await self._m.runs.answer(
            request.run_id, request.request_id, request.option_id, remember=request.remember
        )
        return pb.AnswerPermissionResponse(run=codec.run_to_pb(run))

    async def GetRun(self, request: pb.GetRunRequest, context: Ctx) -> pb.Run:
        return codec.run_to_pb(await self._m.runs.get_run(request.run_id))

    async def ListRuns(self, request: pb.ListRunsRequest, context: Ctx) -> pb.ListRunsResponse:
        runs = await self._m.runs.list_runs(request.agent_id, request.limit)
        return pb.ListRunsResponse(runs=[codec.run_to_pb(r) for r in runs])

    async def Search(self, request: pb.SearchRequest, context: Ctx) -> pb.SearchResponse:
        hits = await self._m.agents.search(
            request.query, agent_id=request.agent_id, limit=request.limit
        )
        indexing = await self._m.agents.search_indexing()
        return pb.SearchResponse(hits=[codec.hit_to_pb(h) for h in hits], indexing=indexing)

    async def UploadAttachment(
        self, request_iterator: AsyncIterator[pb.UploadAttachmentRequest], context: Ctx
    ) -> pb.Attachment:
        parts = request_iterator.__aiter__()
        try:
            first = await parts.__anext__()
        except StopAsyncIteration:
            raise InvalidArgument("header", "an upload starts with a header") from None
        if first.WhichOneof("part") != "header":
            raise InvalidArgument("header", "an upload starts with a header")
        header = first.header

        async def chunks() -> AsyncIterator[bytes]:
            async for msg in parts:
                if msg.WhichOneof("part") != "chunk":
                    raise InvalidArgument("chunk", "only chunks may follow the header")
                yield msg.chunk

        try:
            record = await self._m.attachments.upload(
                agent_id=header.agent_id,
                file_name=header.file_name,
                declared_size=header.size,
                chunks=chunks(),
                media_type=header.media_type,
            )
        except AgentsError:
            await _drain(parts, self._m.attachments.limit)
            raise
        return pb.Attachment(
            sha256=record.sha256,
            size=record.size,
            agent_id=record.agent_id,
            media_type=record.media_type,
        )

    # ---------------------------------------------------------------- status

    async def CheckDatabase(
        self, request: pb.CheckDatabaseRequest, context: Ctx
    ) -> pb.CheckDatabaseResponse:
        result = await self._m.check_database()
        return pb.CheckDatabaseResponse(
            ok=result.ok,
            problems=list(result.problems),
            checked_at=from_seconds(result.finished_at),
            duration_ms=int(result.seconds * 1000),
            path=str(self._m.db.path),
        )

    async def Status(self, request: pb.StatusRequest, context: Ctx) -> pb.StatusResponse:
        st = await self._m.status()
        backup = self._m.backups.status() if self._m.backups else None
        return codec.status_to_pb(DaemonStatus(machine_version(), st, backup))

    # --------------------------------------------------------------- backups

    async def BackupNow(self, request: pb.BackupNowRequest, context: Ctx) -> None:  # type: ignore[override]
        service = self._m.require_backups()
        updates: asyncio.Queue[pb.BackupNowUpdate] = asyncio.Queue()

        def progress(stage: str, done: int, total: int) -> None:
            updates.put_nowait(
                pb.BackupNowUpdate(progress=pb.BackupProgress(stage=stage, done=done, total=total))
            )

        async def run() -> pb.Backup:
            result = await service.backup_now(progress)
            check = await service.restore_check(result.backup_id)
            problem = "" if check.ok else f"its restore check failed: {check.problem}"
            return codec.backup_result_to_pb(result, problem)

        task = asyncio.create_task(run())
        try:
            while not task.done() or not updates.empty():
                getter = asyncio.ensure_future(updates.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    await _write_quietly(context, getter.result())
                else:
                    getter.cancel()
            await context.write(pb.BackupNowUpdate(backup=task.result()))
        finally:
            # A client that goes away does not stop a backup half-way: it finishes.
            if not task.done():
                _background.add(task)
                task.add_done_callback(_background.discard)

    async def ListBackups(
        self, request: pb.ListBackupsRequest, context: Ctx
    ) -> pb.ListBackupsResponse:
        recovery = codec.recovery_key_from_pb(request.recovery_private_key)
        async with self._m.backups_at(request.from_dir) as engine:
            listed = await engine.list_described(recovery)
            chains = await engine.chains(recovery)
        return pb.ListBackupsResponse(
            backups=[
                codec.backup_info_to_pb(*described, chain=chains.get(described[0].backup_id))
                for described in reversed(listed)
            ]
        )

    async def VerifyBackup(
        self, request: pb.VerifyBackupRequest, context: Ctx
    ) -> pb.VerifyBackupResponse:
        recovery = codec.recovery_key_from_pb(request.recovery_private_key)
        async with self._m.backups_at(request.from_dir) as engine:
            with key_refused(recovery):
                # A point with every increment continuing it (the newest: no id).
                backup_id = _backup_id(request.backup_id) if request.backup_id else None
                chain = await (
                    engine.chain_for(backup_id, recovery) if backup_id else engine.chain_at()
                )
                result = await engine.verify_chain(chain, recovery)
        return pb.VerifyBackupResponse(
            ok=True,
            segments=result.segments,
            plain_bytes=result.plain_bytes,
            duration_ms=int(result.seconds * 1000),
        )

    async def Restore(self, request: pb.RestoreRequest, context: Ctx) -> pb.RestoreResponse:
        recovery = codec.recovery_key_from_pb(request.recovery_private_key)
        service = self._m.require_backups()
        async with self._m.backups_at(request.from_dir) as engine:
            with key_refused(recovery):
                result = await service.restore(
                    _backup_id(request.backup_id) if request.backup_id else None,
                    at=to_seconds(request.at) if request.HasField("at") else None,
                    recovery=recovery,
                    engine=engine,
                )
        return codec.restore_result_to_pb(result)

    async def CreateRecoveryKey(
        self, request: pb.CreateRecoveryKeyRequest, context: Ctx
    ) -> pb.CreateRecoveryKeyResponse:
        backups = self._m.require_backups()
        if request.public_key:
            # InvalidArgument naming public_key when malformed or unusable.
            public_key = decode_public_key(request.public_key)
            backups.keep_recovery_key(public_key)
            return pb.CreateRecoveryKeyResponse(public_key=encode_public_key(public_key))
        pair = backups.create_recovery_key()
        return pb.CreateRecoveryKeyResponse(
            private_key=encode_private_key(pair.private_key),
            public_key=encode_public_key(pair.public_key),
        )

    # ------------------------------------------------------- export / import

    async def Export(self, request: pb.ExportRequest, context: Ctx) -> None:  # type: ignore[override]
        handoff = self._m.require_handoff()
        path, _ = await handoff.export(list(request.agent_ids), request.folder)
        try:
            async for chunk in read_chunks(path):
                await context.write(pb.ExportChunk(data=chunk))
        finally:
            handoff.done(path)

    async def Import(
        self, request_iterator: AsyncIterator[pb.ImportChunk], context: Ctx
    ) -> pb.ImportResponse:
        async def chunks() -> AsyncIterator[bytes]:
            async for msg in request_iterator:
                yield msg.data

        result = await self._m.require_handoff().receive(chunks())
        return codec.in_result_to_pb(result)

    # ------------------------------------------------------------- schedules

    async def CreateSchedule(self, request: pb.CreateScheduleRequest, context: Ctx) -> pb.Schedule:
        svc = self._m.require_schedules()
        s = await svc.create(
            request.agent_id,
            request.cron,
            request.prompt,
            time_zone=request.time_zone,
            missed=request.missed,
        )
        return codec.schedule_to_pb(s, svc.next_fire(s))

    async def ListSchedules(
        self, request: pb.ListSchedulesRequest, context: Ctx
    ) -> pb.ListSchedulesResponse:
        svc = self._m.require_schedules()
        listed = await svc.list(request.agent_id)
        return pb.ListSchedulesResponse(
            schedules=[codec.schedule_to_pb(s, svc.next_fire(s)) for s in listed]
        )

    async def PauseSchedule(self, request: pb.PauseScheduleRequest, context: Ctx) -> pb.Schedule:
        svc = self._m.require_schedules()
        s = await svc.set_enabled(request.schedule_id, False)
        return codec.schedule_to_pb(s, svc.next_fire(s))

    async def ResumeSchedule(self, request: pb.ResumeScheduleRequest, context: Ctx) -> pb.Schedule:
        svc = self._m.require_schedules()
        s = await svc.set_enabled(request.schedule_id, True)
        return codec.schedule_to_pb(s, svc.next_fire(s))

    async def DeleteSchedule(
        self, request: pb.DeleteScheduleRequest, context: Ctx
    ) -> pb.DeleteScheduleResponse:
        await self._m.require_schedules().delete(request.schedule_id)
        return pb.DeleteScheduleResponse()

    async def ListScheduleRuns(
        self, request: pb.ListScheduleRunsRequest, context: Ctx
    ) -> pb.ListScheduleRunsResponse:
        runs = await self._m.require_schedules().runs(request.schedule_id, request.limit)
        return pb.ListScheduleRunsResponse(runs=[codec.schedule_run_to_pb(r) for r in runs])

    # --------------------------------------------------------------- erasure

    async def DeleteAgent(
        self, request: pb.DeleteAgentRequest, context: Ctx
    ) -> pb.DeleteAgentResponse:
        result = await self._m.require_erasure().delete(request.agent_id)
        return codec.delete_result_to_pb(result)

    async def ListErasures(
        self, request: pb.ListErasuresRequest, context: Ctx
    ) -> pb.ListErasuresResponse:
        views = await self._m.require_erasure().receipts()
        return pb.ListErasuresResponse(erasures=[codec.erasure_to_pb(v) for v in views])
