"""The machine daemon as a real process: prompt, crash, restart, permissions, bad input."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path

import grpc
import grpc.aio
import pytest

from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from tests.helpers.machine_proc import MachineProc, run_cli

pytestmark = pytest.mark.integration

DEADLINE = 20.0


def stub_for(proc: MachineProc) -> tuple[grpc.aio.Channel, pb_grpc.MachineServiceAsyncStub]:
    channel = grpc.aio.insecure_channel(proc.target)
    return channel, pb_grpc.MachineServiceStub(channel)


async def replay(stub: pb_grpc.MachineServiceAsyncStub, agent_id: str) -> list[pb.RunEvent]:
    call = stub.Replay(pb.ReplayRequest(agent_id=agent_id, after_seq=0))
    return [ev async for ev in call]


def db_rows(data_dir: Path, sql: str, *args: object) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(f"file:{data_dir / 'machine.db'}?mode=ro", uri=True)
    try:
        return list(conn.execute(sql, args))
    finally:
        conn.close()


def counts(data_dir: Path) -> dict[str, int]:
    return {
        t: int(db_rows(data_dir, f"SELECT COUNT(*) FROM {t}")[0][0])  # type: ignore[call-overload]
        for t in ("agents", "runs", "events", "attachments")
    }


async def test_prompt_sigkill_restart_replay(
    machine_proc: Callable[..., MachineProc], tmp_path: Path
) -> None:
    proc = machine_proc().start()
    channel, stub = stub_for(proc)
    try:
        agent = await stub.CreateAgent(pb.CreateAgentRequest(name="a", folder=str(tmp_path)))
        quick = [ev async for ev in stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="hi"))]
        assert quick[0].kind == pb.RUN_STARTED and quick[-1].kind == pb.RUN_FINISHED
        text = "".join(ev.text_delta.text for ev in quick if ev.kind == pb.TEXT_DELTA)
        assert text == "echo: hi"

        slow = stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="/slow 300 " + "w " * 60))
        received: list[pb.RunEvent] = []

        async def read_some() -> None:
            async for ev in slow:
                received.append(ev)
                if sum(e.kind == pb.TEXT_DELTA for e in received) >= 2:
                    return

        await asyncio.wait_for(read_some(), DEADLINE)
        proc.kill()  # SIGKILL in the middle of the run
        slow.cancel()
    finally:
        await channel.close()

    proc.start()
    channel, stub = stub_for(proc)
    try:
        events = await replay(stub, agent.id)
        by_seq = {ev.seq: ev for ev in events}
        for ev in received:  # everything the client saw survived the crash
            assert by_seq[ev.seq] == ev
        run_id = received[0].run_id
        run_events = [ev for ev in events if ev.run_id == run_id]
        errors = [ev for ev in run_events if ev.kind == pb.RUN_ERROR]
        assert len(errors) == 1 and errors[0].run_error.code == pb.RUN_INTERRUPTED
        assert run_events[-1] == errors[0]
        assert [ev.seq for ev in events] == list(range(1, len(events) + 1))
        stored = db_rows(
            proc.data_dir, "SELECT seq, kind FROM events WHERE agent_id = ? ORDER BY seq", agent.id
        )
        names = {v: k for k, v in pb.RunEventKind.items()}
        for ev in received:
            assert (ev.seq, names[ev.kind]) in stored
        run = await stub.GetRun(pb.GetRunRequest(run_id=run_id))
        assert run.state == pb.RUN_STATE_INTERRUPTED

        after = [ev async for ev in stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="again"))]
        assert after[-1].kind == pb.RUN_FINISHED
    finally:
        await channel.close()
    assert proc.stop() == 0
    # A clean restart adds no second RUN_INTERRUPTED.
    proc.start()
    channel, stub = stub_for(proc)
    try:
        events = await replay(stub, agent.id)
        assert sum(ev.run_error.code == pb.RUN_INTERRUPTED for ev in events) == 1
    finally:
        await channel.close()
    assert proc.stop() == 0


async def test_permission_pause_survives_restart(
    machine_proc: Callable[..., MachineProc], tmp_path: Path
) -> None:
    proc = machine_proc().start()
    channel, stub = stub_for(proc)
    try:
        agent = await stub.CreateAgent(pb.CreateAgentRequest(name="t", folder=str(tmp_path)))
        call = stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="/tool deploy prod"))
        request: pb.RunEvent | None = None

        async def wait_request() -> pb.RunEvent:
            async for ev in call:
                if ev.kind == pb.PERMISSION_REQUEST:
                    return ev
            raise AssertionError("stream ended without a permission request")

        request = await asyncio.wait_for(wait_request(), DEADLINE)
        call.cancel()
    finally:
        await channel.close()
    proc.kill()

    proc.start()
    channel, stub = stub_for(proc)
    try:
        run = await stub.GetRun(pb.GetRunRequest(run_id=request.run_id))
        assert run.state == pb.RUN_STATE_WAITING_PERMISSION
        follow = stub.Replay(
            pb.ReplayRequest(agent_id=agent.id, after_seq=request.seq, follow=True)
        )
        answered = await stub.AnswerPermission(
            pb.AnswerPermissionRequest(
                run_id=request.run_id,
                request_id=request.permission_request.request_id,
                option_id="allow_once",
            )
        )
        assert answered.run.state == pb.RUN_STATE_RUNNING

        async def until_end() -> list[pb.RunEvent]:
            out = []
            async for ev in follow:
                out.append(ev)
                if ev.kind in (pb.RUN_FINISHED, pb.RUN_ERROR):
                    return out
            return out

        rest = await asyncio.wait_for(until_end(), DEADLINE)
        follow.cancel()
        assert [ev.kind for ev in rest][0] == pb.PERMISSION_ANSWERED
        assert rest[-1].kind == pb.RUN_FINISHED
        assert any(
            ev.kind == pb.TOOL_RESULT and ev.tool_result.status == "completed" for ev in rest
        )
        events = await replay(stub, agent.id)
        assert sum(ev.kind == pb.TOOL_CALL for ev in events) == 1  # not stored twice
    finally:
        await channel.close()
    assert proc.stop() == 0


async def test_bad_input_clear_status_cli_exit_2_nothing_written(
    machine_proc: Callable[..., MachineProc], tmp_path: Path
) -> None:
    proc = machine_proc("--prompt-limit", "1KiB", "--attachment-limit", "4KiB").start()
    data = proc.data_dir
    channel, stub = stub_for(proc)
    try:
        agent = await stub.CreateAgent(pb.CreateAgentRequest(name="ok", folder=str(tmp_path)))
        old = await stub.CreateAgent(pb.CreateAgentRequest(name="old", folder=str(tmp_path)))
        await stub.ArchiveAgent(pb.ArchiveAgentRequest(agent_id=old.id))
        foreign = "ag_0000000000aaaaaaaaaaaaaaaa"
        conn = sqlite3.connect(data / "machine.db")
        conn.execute(
            "INSERT INTO agents (id, name, folder, runtime, state, origin_machine, created_at,"
            " updated_at) VALUES (?, 'f', '/', 'echo', 'archived', 'mc_0000000000bbbbbbbbbbbbbbbb',"
            " 0, 0)",
            (foreign,),
        )
        conn.commit()
        conn.close()
        big = tmp_path / "big.bin"
        big.write_bytes(b"x" * 5000)
        before = counts(data)

        async def status_of(coro: object) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await coro  # type: ignore[misc]
            return err.value.code(), err.value.details() or ""

        async def prompt(agent_id: str, text: str) -> list[pb.RunEvent]:
            return [ev async for ev in stub.Prompt(pb.PromptRequest(agent_id=agent_id, text=text))]

        def answer(run_id: str, request_id: str, option_id: str) -> object:
            return stub.AnswerPermission(
                pb.AnswerPermissionRequest(
                    run_id=run_id, request_id=request_id, option_id=option_id, remember=True
                )
            )

        good_run = "run_0000000000aaaaaaaaaaaaaaaa"  # well formed, never made
        INVALID = grpc.StatusCode.INVALID_ARGUMENT

        cases = [
            (prompt("ag_nope", "hi"), grpc.StatusCode.INVALID_ARGUMENT, "agent_id"),
            (prompt(agent.id, ""), grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty"),
            (prompt(agent.id, "x" * 1025), grpc.StatusCode.INVALID_ARGUMENT, "prompt: larger"),
            (prompt(old.id, "hi"), grpc.StatusCode.FAILED_PRECONDITION, "archived"),
            (prompt(foreign, "hi"), grpc.StatusCode.FAILED_PRECONDITION, "origin is machine"),
            (
                stub.CreateAgent(
                    pb.CreateAgentRequest(name="n", folder=str(tmp_path), runtime="nope")
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "runtime: unknown runtime 'nope'",
            ),
            (
                stub.CancelRun(pb.CancelRunRequest(run_id="../../etc")),
                grpc.StatusCode.INVALID_ARGUMENT,
                "run_id: invalid run id",
            ),
            (
                stub.CancelRun(pb.CancelRunRequest(run_id=agent.id)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "run_id: invalid run id",
            ),
            (answer("run_nope", "req", "allow_once"), INVALID, "run_id: invalid run id"),
            (answer(good_run, "", "allow_once"), INVALID, "request_id: must be 1 to 200"),
            (answer(good_run, "r" * 201, "allow_once"), INVALID, "request_id: must be 1 to 200"),
            (answer(good_run, "req", ""), INVALID, "option_id: must be 1 to 200"),
        ]
        for coro, code, text in cases:
            got_code, details = await status_of(coro)
            assert got_code == code and text in details, (got_code, details)

        async def parts() -> object:
            yield pb.UploadAttachmentRequest(
                header=pb.AttachmentHeader(agent_id=agent.id, file_name="big.bin", size=0)
            )
            for _ in range(3):
                yield pb.UploadAttachmentRequest(chunk=b"x" * 2000)

        code, details = await status_of(stub.UploadAttachment(parts()))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "attachment: larger" in details
    finally:
        await channel.close()

    cli_cases = [
        (("agent", "prompt", "ag_nope", "hi"), "agent_id: invalid agent id"),
        (("agent", "prompt", agent.id, ""), "prompt: must not be empty"),
        (("agent", "prompt", agent.id, "x" * 1025), "prompt: larger than the limit of 1024"),
        (("agent", "prompt", old.id, "hi"), "the agent is archived"),
        (("agent", "prompt", foreign, "hi"), "origin is machine"),
        (("agent", "create", "n", "--runtime", "nope"), "runtime: unknown runtime"),
        (
            ("agent", "prompt", agent.id, "hi", "--attach", str(big)),
            f"attachment: {big} is larger than the limit of 4096 bytes",  # before sending
        ),
        (("agent", "cancel", "../../etc"), "run_id: invalid run id"),
        (("agent", "answer", "run_nope", "req", "allow_once"), "run_id: invalid run id"),
        (("agent", "answer", "run_0000000000aaaaaaaaaaaaaaaa", "", "x"), "request_id: must be"),
    ]
    for args, text in cli_cases:
        done = await asyncio.to_thread(run_cli, data, *args)
        assert done.returncode == 2, (args, done.stderr)
        first = done.stderr.splitlines()[0]
        assert first.startswith("agents-machine: ") and text in first, (args, done.stderr)
        assert "Traceback" not in done.stderr
    assert counts(data) == before
    assert db_rows(data, "SELECT COUNT(*) FROM permissions")[0][0] == 0
    assert sorted(p.name for p in (data / "attachments").iterdir()) == []
    assert proc.stop() == 0
