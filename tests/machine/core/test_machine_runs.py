"""The run engine with the echo runtime: streaming, durability, queueing, cancel,
restart semantics, permissions, bad input."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from machine.app import Machine, open_machine
from machine.config import MachineConfig
from machine.models import EventKind, RunState, StoredEvent
from shared.errors import InvalidArgument, InvalidId, InvalidState, NotFound, TooLarge
from tests.helpers.runs import read_until

DEADLINE = 10.0


async def collect(events: AsyncIterator[StoredEvent]) -> list[StoredEvent]:
    return [ev async for ev in events]


def counts(db_path: Path) -> dict[str, int]:
    conn = sqlite3.connect(db_path)
    try:
        return {
            t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
            for t in ("agents", "runs", "events", "permissions", "attachments")
        }
    finally:
        conn.close()


async def new_agent(m: Machine, tmp_path: Path, name: str = "a") -> str:
    return (await m.agents.create(name=name, folder=str(tmp_path))).id


async def test_prompt_streams_stored_events(machine_app: Machine, tmp_path: Path) -> None:
    agent = await new_agent(machine_app, tmp_path)
    stream = await machine_app.runs.prompt(agent, "hello there, machine")
    got = []
    async for ev in stream:
        # Durable before yielded: the event is already readable from the database.
        stored = await machine_app.db.read(
            lambda c, s=ev.seq: c.execute(
                "SELECT kind FROM events WHERE agent_id = ? AND seq = ?", (agent, s)
            ).fetchone()
        )
        assert stored is not None and stored[0] == ev.kind.value
        got.append(ev)
    kinds = [ev.kind for ev in got]
    assert kinds[0] is EventKind.RUN_STARTED and kinds[-1] is EventKind.RUN_FINISHED
    deltas = [ev.payload["text"] for ev in got if ev.kind is EventKind.TEXT_DELTA]
    assert len(deltas) > 1 and "".join(deltas) == "echo: hello there, machine"
    assert [ev.seq for ev in got] == list(range(1, len(got) + 1))
    run = await machine_app.runs.get_run(got[0].run_id)
    assert run.state is RunState.FINISHED and run.input_tokens == 3 and run.finished_at
    agent_rec = await machine_app.agents.get(agent)
    assert agent_rec.session_id == f"echo-{agent}"


async def test_prompts_to_a_busy_agent_wait_in_order(machine_app: Machine, tmp_path: Path) -> None:
    agent = await new_agent(machine_app, tmp_path)
    first = await machine_app.runs.prompt(agent, "/slow 20 first prompt")
    second = await machine_app.runs.prompt(agent, "second prompt")
    a, b = await asyncio.wait_for(asyncio.gather(collect(first), collect(second)), DEADLINE)
    assert a[-1].kind is EventKind.RUN_FINISHED and b[-1].kind is EventKind.RUN_FINISHED
    assert b[0].seq > a[-1].seq  # the second run started after the first ended


async def test_cancel_a_running_run(machine_app: Machine, tmp_path: Path) -> None:
    agent = await new_agent(machine_app, tmp_path)
    stream = await machine_app.runs.prompt(agent, "/slow 500 " + "word " * 40)
    started = await read_until(stream, EventKind.RUN_STARTED)
    run_id = started[0].run_id
    run = await machine_app.runs.cancel(run_id)
    assert run.state is RunState.CANCELLED
    rest = await asyncio.wait_for(collect(stream), DEADLINE)
    assert rest[-1].kind is EventKind.RUN_ERROR and rest[-1].payload["code"] == "CANCELLED"
    with pytest.raises(InvalidState, match="already ended"):
        await machine_app.runs.cancel(run_id)


async def test_runtime_failure_ends_the_run(machine_app: Machine, tmp_path: Path) -> None:
    agent = await new_agent(machine_app, tmp_path)
    events = await collect(await machine_app.runs.prompt(agent, "/fail on purpose"))
    assert events[-1].payload["code"] == "RUNTIME_FAILED"
    assert "on purpose" in events[-1].payload["message"]
    assert (await machine_app.runs.get_run(events[0].run_id)).state is RunState.FAILED


async def test_restart_interrupts_in_flight_runs_exactly_once(
    machine_config: MachineConfig, tmp_path: Path
) -> None:
    async with open_machine(machine_config) as m:
        agent = await new_agent(m, tmp_path)
        finished = await collect(await m.runs.prompt(agent, "before"))
    # Simulate a crash mid-run: a run left 'running' with a RUN_STARTED and a delta.
    conn = sqlite3.connect(machine_config.db_path)
    last = finished[-1].seq
    conn.execute(
        "INSERT INTO runs (id, agent_id, state, prompt, created_at, started_at)"
        " VALUES ('run_0000000000crashedcrashedcr', ?, 'running', 'p', 1, 1)",
        (agent,),
    )
    for seq, kind in ((last + 1, "RUN_STARTED"), (last + 2, "TEXT_DELTA")):
        conn.execute(
            "INSERT INTO events (agent_id, seq, run_id, kind, payload_json, time)"
            " VALUES (?, ?, 'run_0000000000crashedcrashedcr', ?, '{\"text\": \"x\"}', 1)",
            (agent, seq, kind),
        )
    conn.execute("UPDATE agents SET last_seq = ? WHERE id = ?", (last + 2, agent))
    conn.commit()
    conn.close()
    for _ in range(2):  # a second restart must add nothing
        async with open_machine(machine_config) as m:
            events = await collect(await m.runs.replay(agent, 0))
            errors = [
                e
                for e in events
                if e.run_id == "run_0000000000crashedcrashedcr" and e.kind == "RUN_ERROR"
            ]
            assert len(errors) == 1 and errors[0].payload["code"] == "RUN_INTERRUPTED"
            assert events[-1] == errors[0]
            assert (
                await m.runs.get_run("run_0000000000crashedcrashedcr")
            ).state is RunState.INTERRUPTED
    async with open_machine(machine_config) as m:
        after = await collect(await m.runs.prompt(agent, "after"))
        assert after[-1].kind is EventKind.RUN_FINISHED


async def test_shutdown_interrupts_running_run(
    machine_config: MachineConfig, tmp_path: Path
) -> None:
    async with open_machine(machine_config) as m:
        agent = await new_agent(m, tmp_path)
        stream = await m.runs.prompt(agent, "/slow 500 " + "word " * 40)
        await read_until(stream, EventKind.TEXT_DELTA)
    async with open_machine(machine_config) as m:
        events = await collect(await m.runs.replay(agent, 0))
        assert [e.kind for e in events].count(EventKind.RUN_ERROR) == 1
        assert events[-1].payload["code"] == "RUN_INTERRUPTED"


async def test_permission_waits_survives_restart_and_resumes(
    machine_config: MachineConfig, tmp_path: Path
) -> None:
    async with open_machine(machine_config) as m:
        agent = await new_agent(m, tmp_path)
        stream = await m.runs.prompt(agent, "/tool ls -la")
        seen = await read_until(stream, EventKind.PERMISSION_REQUEST)
        request = seen[-1]
        run = await m.runs.get_run(request.run_id)
        assert run.state is RunState.WAITING_PERMISSION
    async with open_machine(machine_config) as m:
        assert (await m.runs.get_run(request.run_id)).state is RunState.WAITING_PERMISSION
        # A later prompt waits behind the paused run.
        later = await m.runs.prompt(agent, "after the tool")
        with pytest.raises(InvalidArgument) as err:
            await m.runs.answer(request.run_id, request.payload["request_id"], "maybe")
        assert err.value.field == "option_id"
        follow = await m.runs.replay(agent, request.seq, follow=True)
        await m.runs.answer(request.run_id, request.payload["request_id"], "allow_once")
        resumed = await read_until(follow, EventKind.RUN_FINISHED)
        later_events = await asyncio.wait_for(collect(later), DEADLINE)
        events = await collect(await m.runs.replay(agent, 0))
    run_events = [e for e in events if e.run_id == request.run_id]
    kinds = [e.kind for e in run_events]
    # Re-emitted TOOL_CALL was suppressed; the request was answered from the store.
    assert kinds.count(EventKind.TOOL_CALL) == 1
    assert kinds.count(EventKind.PERMISSION_REQUEST) == 1
    assert kinds.count(EventKind.PERMISSION_ANSWERED) == 1
    assert kinds[-1] is EventKind.RUN_FINISHED
    assert any(
        e.kind is EventKind.TOOL_RESULT and e.payload["status"] == "completed" for e in resumed
    )
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert later_events[0].seq > run_events[-1].seq


async def test_remembered_answer_is_per_agent_and_tool(
    machine_app: Machine, tmp_path: Path
) -> None:
    agent = await new_agent(machine_app, tmp_path)
    other = await new_agent(machine_app, tmp_path, "other")
    stream = await machine_app.runs.prompt(agent, "/tool ls one")
    req = (await read_until(stream, EventKind.PERMISSION_REQUEST))[-1]
    await machine_app.runs.answer(req.run_id, "call-1", "reject_always", remember=True)
    rest = await collect(stream)
    assert any(e.kind is EventKind.TOOL_RESULT and e.payload["status"] == "failed" for e in rest)
    # Same agent, same tool: answered by the rule, no pause.
    again = await asyncio.wait_for(
        collect(await machine_app.runs.prompt(agent, "/tool ls two")), DEADLINE
    )
    answered = [e for e in again if e.kind is EventKind.PERMISSION_ANSWERED]
    assert answered[0].payload["by_rule"] is True
    assert answered[0].payload["option_id"] == "reject_once"
    # Another tool, or another agent: asked again.
    for who, prompt in ((agent, "/tool cat x"), (other, "/tool ls three")):
        s = await machine_app.runs.prompt(who, prompt)
        r = (await read_until(s, EventKind.PERMISSION_REQUEST))[-1]
        await machine_app.runs.cancel(r.run_id)


async def test_bad_input_writes_nothing(machine_app: Machine, tmp_path: Path) -> None:
    agent = await new_agent(machine_app, tmp_path)
    archived = await new_agent(machine_app, tmp_path, "old")
    await machine_app.agents.archive(archived)
    conn = sqlite3.connect(machine_app.config.db_path)
    conn.execute(
        "INSERT INTO agents (id, name, folder, runtime, state, origin_machine, created_at,"
        " updated_at) VALUES ('ag_0000000000aaaaaaaaaaaaaaaa', 'f', '/', 'echo', 'archived',"
        " 'mc_0000000000bbbbbbbbbbbbbbbb', 0, 0)"
    )
    conn.commit()
    conn.close()
    foreign = "ag_0000000000aaaaaaaaaaaaaaaa"
    before = counts(machine_app.config.db_path)
    runs = machine_app.runs
    with pytest.raises(InvalidId) as bad_id:
        await runs.prompt("ag_../../etc", "hi")
    assert bad_id.value.field == "agent_id"
    with pytest.raises(InvalidArgument, match="prompt: must not be empty"):
        await runs.prompt(agent, "   ")
    with pytest.raises(TooLarge) as big:
        await runs.prompt(agent, "x" * 4097)
    assert big.value.field == "prompt"
    with pytest.raises(InvalidState, match="archived"):
        await runs.prompt(archived, "hi")
    with pytest.raises(InvalidState, match="origin is machine"):
        await runs.prompt(foreign, "hi")
    with pytest.raises(InvalidState, match="origin is machine"):
        await machine_app.agents.unarchive(foreign)
    with pytest.raises(NotFound):
        await runs.prompt("ag_0000000000cccccccccccccccc", "hi")
    with pytest.raises(NotFound):
        await runs.prompt(agent, "hi", ["0" * 64])
    with pytest.raises(InvalidArgument) as bad_runtime:
        await machine_app.agents.create(name="n", folder=str(tmp_path), runtime="nope")
    assert bad_runtime.value.field == "runtime"
    with pytest.raises(InvalidArgument) as bad_settings:
        await machine_app.agents.create(name="n", folder=str(tmp_path), settings_json="[1]")
    assert bad_settings.value.field == "settings_json"
    with pytest.raises(InvalidArgument) as bad_folder:
        await machine_app.agents.create(name="n", folder="relative/path")
    assert bad_folder.value.field == "folder"
    with pytest.raises(InvalidArgument) as bad_name:
        await machine_app.agents.create(name=" \t", folder=str(tmp_path))
    assert bad_name.value.field == "name"
    with pytest.raises(InvalidId):
        await runs.answer("run_nope", "call-1", "allow_once")
    assert counts(machine_app.config.db_path) == before


async def test_replay_after_seq_and_follow(machine_app: Machine, tmp_path: Path) -> None:
    agent = await new_agent(machine_app, tmp_path)
    first = await collect(await machine_app.runs.prompt(agent, "one"))
    tail = await collect(await machine_app.runs.replay(agent, first[1].seq))
    assert [e.seq for e in tail] == [e.seq for e in first[2:]]
    follow = await machine_app.runs.replay(agent, first[-1].seq, follow=True)
    await machine_app.runs.submit(agent, "two")
    second = await read_until(follow, EventKind.RUN_FINISHED)
    assert second[0].kind is EventKind.RUN_STARTED and second[0].seq == first[-1].seq + 1
    with pytest.raises(InvalidArgument):
        await machine_app.runs.replay(agent, -1)


async def test_search_covers_archived_agents(machine_app: Machine, tmp_path: Path) -> None:
    agent = await new_agent(machine_app, tmp_path)
    await collect(await machine_app.runs.prompt(agent, "zebra crossing"))
    await machine_app.agents.archive(agent)
    # Quotes and operators are words, not FTS syntax: no error.
    assert await machine_app.agents.search('NEAR( "giraffe') == []
    hits = await machine_app.agents.search("zebra")
    assert hits and all(h.archived and h.agent_id == agent for h in hits)
    assert {h.source for h in hits} >= {"prompt", "reply", "summary"}
    unarchived = await machine_app.agents.unarchive(agent)
    assert unarchived.state.value == "active"


async def test_machine_log_is_pruned_after_retention(machine_app: Machine) -> None:
    import time

    now = time.time()
    await machine_app.db.write(
        lambda c: c.executemany(
            "INSERT INTO machine_log (time, kind, detail) VALUES (?, 'test', '')",
            [(now - 8 * 86400,), (now - 6 * 86400,)],
        )
    )
    assert await machine_app.prune() == 1
    left = await machine_app.db.read(
        lambda c: c.execute("SELECT COUNT(*) FROM machine_log WHERE kind = 'test'").fetchone()[0]
    )
    assert left == 1


async def test_a_folder_is_stored_normalised_and_exported_by_any_spelling(
    machine_app: Machine, tmp_path: Path
) -> None:
    """``/p/../p/.`` and ``/p/`` are ``/p``: an export by folder finds the agent
    by whichever spelling (before, one made with ``..`` was left out)."""
    project = tmp_path / "proj"
    project.mkdir()
    odd = f"{tmp_path}/proj/../proj/."
    made = await machine_app.agents.create(name="n", folder=odd)
    assert made.folder == str(project)
    handoff = machine_app.require_handoff()
    for spelling in (str(project), f"{project}/", odd):
        path, manifest = await handoff.export([], spelling)
        assert [a.agent_id for a in manifest.agents] == [made.id], spelling
        path.unlink()


async def test_a_folder_with_dotdot_after_a_symlink_is_refused(
    machine_app: Machine, tmp_path: Path
) -> None:
    """``a/link/..`` is the folder above the link's target: collapsed by its
    spelling it would name ``a``, a folder nobody checked."""
    (tmp_path / "srv" / "x").mkdir(parents=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "link").symlink_to("../srv/x")
    with pytest.raises(InvalidArgument, match="after a symbolic link") as err:
        await machine_app.agents.create(name="n", folder=f"{tmp_path}/a/link/..")
    assert err.value.field == "folder"
    assert await machine_app.agents.list(include_archived=True) == []
