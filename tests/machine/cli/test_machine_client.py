"""MachineClient: typed records from a real daemon, domain errors back, and codec
readers that invert the daemon's writers (the CLI's --json relies on it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from machine.api import codec
from machine.api.views import DaemonStatus, ScheduleView
from machine.app import MachineStatus
from machine.backups.service import BackupStatus, RestoreCheck
from machine.cli.client import DaemonNotRunning, DaemonUnreachable, MachineClient
from machine.config import MachineConfig
from machine.models import (
    AgentRecord,
    AgentState,
    EventKind,
    RunErrorCode,
    RunRecord,
    RunState,
    ScheduleRecord,
    StoredEvent,
)
from shared.cli import message_dict
from shared.errors import InvalidArgument, InvalidState, NotFound, TransientError
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.rpc import ErrorInterceptor

T0 = 1_764_600_000.123456


def _events() -> list[StoredEvent]:
    run, agent = "run_0000000000aaaaaaaaaaaaaaaa", "ag_0000000000aaaaaaaaaaaaaaaa"
    payloads: list[tuple[EventKind, dict[str, object]]] = [
        (EventKind.RUN_STARTED, {"prompt": "hi", "attachments": ["a" * 64], "runtime": "echo"}),
        (EventKind.TEXT_DELTA, {"text": "hello"}),
        (
            EventKind.TOOL_CALL,
            {"call_id": "c1", "title": "write", "tool_kind": "edit", "input_json": "{}"},
        ),
        (EventKind.TOOL_RESULT, {"call_id": "c1", "status": "completed", "output": "ok"}),
        (
            EventKind.PERMISSION_REQUEST,
            {
                "request_id": "r1",
                "call_id": "c1",
                "title": "write",
                "options": [{"option_id": "allow_once", "name": "Allow", "kind": "allow_once"}],
            },
        ),
        (
            EventKind.PERMISSION_ANSWERED,
            {"request_id": "r1", "option_id": "allow_once", "remember": True, "by_rule": False},
        ),
        (
            EventKind.RUN_FINISHED,
            {
                "stop_reason": "end_turn",
                "usage": {"input_tokens": 0, "output_tokens": None},
                "duration_ms": 12,
            },
        ),
        (EventKind.RUN_ERROR, {"code": "RUNTIME_FAILED", "message": "boom"}),
    ]
    return [
        StoredEvent(agent, seq, run, kind, payload, T0 + seq)
        for seq, (kind, payload) in enumerate(payloads, 1)
    ]


@pytest.mark.parametrize("event", _events(), ids=lambda e: e.kind.value)
def test_event_reader_inverts_writer(event: StoredEvent) -> None:
    msg = codec.event_to_pb(event)
    back = codec.event_from_pb(msg)
    assert back.kind is event.kind and back.payload == event.payload
    assert codec.message_of(back) == msg


def test_records_read_back_to_the_same_message() -> None:
    agent = AgentRecord(
        "ag_0000000000aaaaaaaaaaaaaaaa", "a", "/w", "echo", {"b": 1, "a": [2]},
        AgentState.ARCHIVED, "m_x", False, None, T0, T0 + 1, 7,
    )  # fmt: skip
    runs = [
        RunRecord(
            "run_0000000000aaaaaaaaaaaaaaaa", agent.id, RunState.FAILED, "p", (), T0, T0 + 0.5,
            T0 + 2, 3, None, 1500, None, RunErrorCode.RUNTIME_FAILED,
        ),
        RunRecord(
            "run_0000000000aaaaaaaaaaaaaaab", agent.id, RunState.QUEUED, "p", (), T0, None,
            None, None, None, 0, None, None,
        ),
    ]  # fmt: skip
    schedule = ScheduleRecord(
        "sch_0000000000aaaaaaaaaaaaaaaa", agent.id, "0 7 * * *", "UTC", "p", False, "once",
        T0, T0, None,
    )  # fmt: skip
    status = DaemonStatus(
        "1.2.3",
        MachineStatus("/d", "m_x", True, 1, 2, 3, 0, ["echo"], T0, 9),
        BackupStatus(
            "folder", 7, None, "", 0, T0 + 60, RestoreCheck(False, "", T0, 0.0, "bad"), True,
            ("w",),
        ),
    )  # fmt: skip
    messages = [
        codec.agent_to_pb(agent),
        *(codec.run_to_pb(r) for r in runs),
        codec.schedule_to_pb(schedule, None),
        codec.schedule_to_pb(schedule, T0 + 5),
        codec.status_to_pb(status),
        codec.status_to_pb(DaemonStatus("1", status.machine, None)),
    ]
    readers = {
        pb.Agent: codec.agent_from_pb,
        pb.Run: codec.run_from_pb,
        pb.Schedule: codec.schedule_from_pb,
        pb.StatusResponse: codec.status_from_pb,
    }
    for msg in messages:
        record = readers[type(msg)](msg)  # type: ignore[operator]
        assert message_dict(codec.message_of(record)) == message_dict(msg)
    assert codec.run_from_pb(codec.run_to_pb(runs[0])).output_tokens is None
    assert codec.agent_from_pb(codec.agent_to_pb(agent)) == agent


async def test_agents_runs_and_schedules_come_back_typed(
    daemon: MachineConfig, tmp_path: Path
) -> None:
    async with MachineClient(daemon) as client:
        agent = await client.create_agent("first", str(tmp_path), settings_json='{"delay_ms": 1}')
        assert isinstance(agent, AgentRecord)
        assert (agent.state, agent.settings) == (AgentState.ACTIVE, {"delay_ms": 1})
        assert await client.get_agent(agent.id) == agent
        renamed = await client.rename_agent(agent.id, "second")
        assert renamed.name == "second"

        events = [ev async for ev in client.prompt(agent.id, "hello there")]
        assert events[0].kind is EventKind.RUN_STARTED
        assert events[0].payload["prompt"] == "hello there"
        assert events[-1].kind is EventKind.RUN_FINISHED
        replayed = [ev async for ev in client.replay(agent.id)]
        assert [e.seq for e in replayed] == [e.seq for e in events]
        runs = await client.list_runs(agent.id)
        assert [(r.id, r.state) for r in runs] == [(events[0].run_id, RunState.FINISHED)]
        found = await client.search("hello", agent_id=agent.id)
        assert found.hits and all(h.agent_id == agent.id for h in found.hits)

        view = await client.create_schedule(agent.id, "0 7 * * *", "daily", time_zone="UTC")
        assert isinstance(view, ScheduleView) and view.next_run_at is not None
        paused = await client.pause_schedule(view.schedule.id)
        assert paused.schedule.enabled is False
        assert [v.schedule.id for v in await client.list_schedules(agent.id)] == [view.schedule.id]
        assert await client.list_schedule_runs(view.schedule.id) == []
        await client.delete_schedule(view.schedule.id)
        assert await client.list_schedules() == []

        archived = await client.archive_agent(agent.id)
        assert archived.state is AgentState.ARCHIVED
        assert [a.id for a in await client.list_agents()] == []
        assert [a.id for a in await client.list_agents(include_archived=True)] == [agent.id]
        status = await client.status()
        assert (status.machine.active_agents, status.machine.archived_agents) == (0, 1)


async def test_refusals_are_domain_errors_with_the_grpc_error_as_cause(
    daemon: MachineConfig, tmp_path: Path
) -> None:
    async with MachineClient(daemon) as client:
        with pytest.raises(NotFound) as missing:
            await client.get_agent("ag_0000000000aaaaaaaaaaaaaaaa")
        assert isinstance(missing.value.__cause__, grpc.aio.AioRpcError)
        agent = await client.create_agent("a", str(tmp_path))
        with pytest.raises(InvalidState):
            await client.delete_agent(agent.id)  # still active: archive it first
        with pytest.raises(InvalidArgument) as bad:
            await client.create_schedule(agent.id, "not a cron", "p")
        assert bad.value.field == "cron"
        # A rule with no fire time (31 February) is refused, not stored and INTERNAL.
        with pytest.raises(InvalidArgument, match="never fires") as never:
            await client.create_schedule(agent.id, "0 0 31 2 *", "p")
        assert never.value.field == "cron"
        assert await client.list_schedules() == []
        # A refused stream raises while it is read.
        with pytest.raises(NotFound):
            [ev async for ev in client.replay("ag_0000000000aaaaaaaaaaaaaaab")]


async def test_no_daemon_is_daemon_not_running(tmp_path: Path) -> None:
    cfg = MachineConfig(data_dir=tmp_path / "d").validate()
    with pytest.raises(DaemonNotRunning):
        async with MachineClient(cfg):
            pass
    # A socket file nobody listens on (a daemon that was killed) answers the same.
    cfg.socket.parent.mkdir(parents=True, exist_ok=True)
    cfg.socket.touch()
    async with MachineClient(cfg) as client:
        with pytest.raises(DaemonNotRunning) as down:
            await client.status()
    assert down.value.data_dir == cfg.data_dir


async def test_a_socket_this_user_cannot_reach_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = MachineConfig(data_dir=tmp_path / "d").validate()

    def denied(self: Path, *args: object, **kwargs: object) -> bool:
        raise PermissionError(13, "Permission denied", str(self))

    # Tests run as root, whom permissions do not stop: the refusal is made here.
    monkeypatch.setattr(Path, "exists", denied)
    with pytest.raises(DaemonUnreachable, match="Permission denied .run this as the user"):
        async with MachineClient(cfg):
            pass


async def test_a_daemon_that_answers_unavailable_is_running_and_says_why(
    tmp_path: Path,
) -> None:
    # A daemon whose call failed on something it depends on (the control plane is
    # down) answers UNAVAILABLE with the domain error: not "the daemon is not running".
    cfg = MachineConfig(data_dir=tmp_path / "d").validate()
    cfg.socket.parent.mkdir(parents=True)

    async def status(request: bytes, context: Any) -> bytes:
        raise TransientError("control plane 127.0.0.1:1: connection refused")

    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    handler = grpc.method_handlers_generic_handler(
        "shared.pb.machine.v1.MachineService",
        {"Status": grpc.unary_unary_rpc_method_handler(status)},
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{cfg.socket}")
    await server.start()
    try:
        async with MachineClient(cfg) as client:
            with pytest.raises(TransientError, match="control plane") as down:
                await client.status()
        assert not isinstance(down.value, DaemonNotRunning)
    finally:
        await server.stop(None)
    # Once nobody answers on the socket, it is the daemon that is not running.
    cfg.socket.touch()  # as a killed daemon leaves it
    async with MachineClient(cfg) as client:
        with pytest.raises(DaemonNotRunning):
            await client.status()


def _filled(cls: Any) -> Any:
    """A message of ``cls`` with every scalar, enum, time and nested field set to
    something not its default, so a field a reader drops shows."""
    from google.protobuf.descriptor import FieldDescriptor as F

    msg = cls()
    for f in cls.DESCRIPTOR.fields:
        value: Any
        if f.message_type is not None:
            if f.is_repeated:
                continue  # repeated messages: each has a reader of its own
            if f.message_type.full_name == "google.protobuf.Timestamp":
                getattr(msg, f.name).seconds = int(T0) + f.number
            else:
                getattr(msg, f.name).CopyFrom(_filled(type(getattr(msg, f.name))))
            continue
        if f.type == F.TYPE_ENUM:
            value = f.enum_type.values[-1].number
        elif f.type == F.TYPE_BOOL:
            value = True
        elif f.type == F.TYPE_STRING:
            value = f"{f.name}-x"
        elif f.type == F.TYPE_BYTES:
            value = b"x"
        else:
            value = f.number + 1
        if f.is_repeated:
            getattr(msg, f.name).append(value)
        else:
            setattr(msg, f.name, value)
    return msg


@pytest.mark.parametrize(
    ("cls", "reader"),
    [
        (pb.Backup, codec.backup_view_from_pb),
        (pb.VerifyBackupResponse, codec.verify_from_pb),
        (pb.Erasure, codec.erasure_from_pb),
        (pb.DeleteAgentResponse, codec.delete_result_from_pb),
        (pb.ImportResponse, codec.in_result_from_pb),
        (pb.ScheduleRun, codec.schedule_run_from_pb),
        (pb.StatusResponse, codec.status_from_pb),
    ],
)
def test_every_field_of_a_reply_survives_the_cli_reading_it_back(cls: Any, reader: Any) -> None:
    """--json prints what the client read, re-encoded: a field added to the wire but
    not to the client's record would print as its default (backup list's increments)."""
    msg = _filled(cls)
    assert message_dict(codec.message_of(reader(msg))) == message_dict(msg)


def test_every_field_of_a_restore_survives_the_cli_reading_it_back() -> None:
    msg = _filled(pb.RestoreResponse)
    back = codec.restore_result_to_pb(codec.in_result_from_pb(msg))
    assert message_dict(back) == message_dict(msg)
