"""The machine under faults: failed reads, damaged databases, full disks."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from machine.app import open_machine
from machine.config import MachineConfig
from machine.db import Database
from machine.models import EventKind
from shared.errors import IntegrityError

# ------------------------------------------------------------------ failed reads


async def test_read_that_raises_mid_iteration_leaves_no_stale_snapshot(tmp_path: Path) -> None:
    db = await Database.open(tmp_path / "m.db")
    try:
        await db.write(lambda c: c.execute("CREATE TABLE t (x TEXT)"))
        await db.write(
            lambda c: c.executemany("INSERT INTO t VALUES (?)", [(f"v{i}",) for i in range(10)])
        )
        await db.write(lambda c: c.execute("INSERT INTO t VALUES (CAST(X'FF' AS TEXT))"))
        await db.write(lambda c: c.execute("INSERT INTO t VALUES ('after')"))

        def read_all(conn: sqlite3.Connection) -> list[str]:
            cur = conn.execute("SELECT x FROM t ORDER BY rowid")
            return [row[0] for row in cur]

        # Keeping the exception keeps its traceback, and so the reader's half-read
        # cursor, alive: exactly what a logged or re-raised failure does.
        with pytest.raises(IntegrityError, match="not valid UTF-8") as failed:
            await db.read(read_all)
        await db.write(lambda c: c.execute("INSERT INTO t VALUES ('new')"))
        count = await db.read(lambda c: c.execute("SELECT COUNT(*) FROM t").fetchone()[0])
        assert count == 13
        assert failed.value is not None
    finally:
        await db.close()


async def test_undecodable_event_does_not_break_later_prompts_and_replays(
    machine_config: MachineConfig, tmp_path: Path
) -> None:
    async with open_machine(machine_config) as m:
        damaged = await m.agents.create(name="a", folder=str(tmp_path), runtime="echo")
        [ev async for ev in await m.runs.prompt(damaged.id, "one two three")]
        [ev async for ev in await m.runs.prompt(damaged.id, "four five six")]
    conn = sqlite3.connect(machine_config.db_path)
    with conn:
        conn.execute(
            "UPDATE events SET payload_json = CAST(X'7B2274657874223A2022FF227D' AS TEXT)"
            " WHERE agent_id = ? AND seq = 3",
            (damaged.id,),
        )
    conn.close()
    # Reopened: the feeds are empty, so replay reads the database.
    async with open_machine(machine_config) as m:
        with pytest.raises(IntegrityError, match=f"replay agent {damaged.id}") as failed:
            [ev async for ev in await m.runs.replay(damaged.id)]
        other = await m.agents.create(name="b", folder=str(tmp_path), runtime="echo")
        events = [ev async for ev in await m.runs.prompt(other.id, "hello")]
        assert events[-1].kind is EventKind.RUN_FINISHED
        more = [ev async for ev in await m.runs.prompt(damaged.id, "again")]
        assert more[-1].kind is EventKind.RUN_FINISHED
        after = [ev async for ev in await m.runs.replay(damaged.id, 3)]
        assert [ev.seq for ev in after] == list(range(4, more[-1].seq + 1))
        assert failed.value is not None
