"""Store queries the engine and the heartbeat use: agent count, session id,
permission rows and remembered rules."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

from machine.app import Machine
from machine.models import EventKind, PendingPermission, StoredEvent
from machine.storage import tables
from machine.storage.tables.rows import present

DEADLINE = 10.0


async def test_agent_count_counts_active_and_archived(machine_app: Machine, tmp_path: Path) -> None:
    assert await machine_app.agent_count() == 0
    first = await machine_app.agents.create(name="one", folder=str(tmp_path))
    await machine_app.agents.create(name="two", folder=str(tmp_path))
    await machine_app.agents.archive(first.id)
    st = await machine_app.status()
    assert await machine_app.agent_count() == 2 == st.active_agents + st.archived_agents
    assert await machine_app.db.read(tables.count_agents) == 2


async def test_set_session_id_and_rule_for(machine_app: Machine, tmp_path: Path) -> None:
    agent = await machine_app.agents.create(name="a", folder=str(tmp_path))
    await machine_app.db.write(lambda c: tables.set_session_id(c, agent.id, "sess-1"))
    assert (await machine_app.agents.get(agent.id)).session_id == "sess-1"

    assert await machine_app.db.read(lambda c: tables.rule_for(c, agent.id, "Write")) is None

    def add_rule(conn: sqlite3.Connection) -> None:
        conn.execute(
            "INSERT INTO permission_rules (agent_id, tool, decision, created_at)"
            " VALUES (?, 'Write', 'reject', 0)",
            (agent.id,),
        )

    await machine_app.db.write(add_rule)
    assert await machine_app.db.read(lambda c: tables.rule_for(c, agent.id, "Write")) == "reject"
    assert await machine_app.db.read(lambda c: tables.rule_for(c, agent.id, "Read")) is None


async def test_insert_permission_round_trips(machine_app: Machine, tmp_path: Path) -> None:
    agent = await machine_app.agents.create(name="a", folder=str(tmp_path))
    stream = await machine_app.runs.prompt(agent.id, "hello")
    events = await asyncio.wait_for(_collect(stream), DEADLINE)
    run_id = events[0].run_id
    assert events[-1].kind is EventKind.RUN_FINISHED
    perm = PendingPermission(
        run_id=run_id,
        request_id="req-1",
        agent_id=agent.id,
        call_id="call-1",
        title="Write",
        options=(("allow_once", "Allow", "allow_once"), ("reject_once", "No", "reject_once")),
        seq=events[-1].seq,
        state="answered",
        option_id="allow_once",
    )

    def write(conn: sqlite3.Connection) -> tuple[float, float | None]:
        tables.insert_permission(conn, perm, requested_at=5.0, answered_at=6.0)
        row = conn.execute(
            "SELECT requested_at, answered_at FROM permissions WHERE request_id = 'req-1'"
        ).fetchone()
        return row[0], row[1]

    assert await machine_app.db.write(write) == (5.0, 6.0)
    got = await machine_app.db.read(lambda c: tables.get_permission(c, run_id, "req-1"))
    assert got == perm


async def _collect(stream: AsyncIterator[StoredEvent]) -> list[StoredEvent]:
    return [ev async for ev in stream]


def test_present_asks_in_chunks_and_finds_each_id() -> None:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (id TEXT PRIMARY KEY)")
    stored = [f"id{n:04d}" for n in range(0, 1300, 2)]
    conn.executemany("INSERT INTO t VALUES (?)", [(i,) for i in stored])
    asked = [f"id{n:04d}" for n in range(1300)]  # over two chunks of the IN list
    assert present(conn, "t", "id", iter(asked)) == set(stored)
    assert present(conn, "t", "id", []) == set()
    conn.close()
