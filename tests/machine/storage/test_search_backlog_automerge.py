"""The restore's bulk indexing merges no FTS5 segments and leaves automerge as it was."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from machine.storage.db import Database
from machine.storage.tables import search_backlog


@pytest.fixture
async def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    await (await Database.open(tmp_path / "machine.db")).close()  # the schema
    c = sqlite3.connect(tmp_path / "machine.db", isolation_level=None)
    for n, agent in enumerate(("agent_a", "agent_b")):
        c.execute(
            "INSERT INTO agents (id, name, folder, runtime, state, origin_machine, created_at,"
            " updated_at) VALUES (?, ?, '/srv', 'echo', 'archived', 'm', 0, 0)",
            (agent, agent),
        )
        events = [
            ("RUN_STARTED", {"prompt": f"prompt{n} words"}),
            ("TEXT_DELTA", {"text": f"reply{n} "}),
            ("TEXT_DELTA", {"text": 'caf\u00e9 "quoted"\n'}),
            ("RUN_FINISHED", {}),
        ]
        c.executemany(
            "INSERT INTO events (agent_id, seq, run_id, kind, payload_json, time)"
            " VALUES (?,?,?,?,?,0)",
            [
                (agent, seq, f"run_{n}", kind, json.dumps(p, sort_keys=True))
                for seq, (kind, p) in enumerate(events, 1)
            ],
        )
        search_backlog.queue_for_index(c, agent, float(n))
    yield c
    c.close()


def _automerge(c: sqlite3.Connection) -> list[tuple[str, int]]:
    return c.execute("SELECT k, v FROM search_config WHERE k = 'automerge'").fetchall()


def _index(c: sqlite3.Connection) -> list[str]:
    c.execute("BEGIN IMMEDIATE")
    done = search_backlog.index_next(c)
    c.execute("COMMIT")
    return done


@pytest.mark.parametrize("before", [None, 8])
def test_index_next_restores_automerge(
    conn: sqlite3.Connection, before: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if before is not None:
        conn.execute("INSERT INTO search (search, rank) VALUES ('automerge', ?)", (before,))
    real = search_backlog.index_agent
    during: list[object] = []

    def index_agent(c: sqlite3.Connection, agent_id: str) -> int:
        during.append(_automerge(c))
        return real(c, agent_id)

    monkeypatch.setattr(search_backlog, "index_agent", index_agent)
    assert _index(conn) == ["agent_a", "agent_b"]
    assert during == [[("automerge", 0)]] * 2  # no merging while the restore's text goes in
    assert _automerge(conn) == [("automerge", 4 if before is None else before)]
    rows = conn.execute(
        "SELECT agent_id, source, text FROM search ORDER BY agent_id, source"
    ).fetchall()
    assert rows == [
        ("agent_a", "prompt", "prompt0 words"),
        ("agent_a", "reply", 'reply0 caf\u00e9 "quoted"\n'),
        ("agent_b", "prompt", "prompt1 words"),
        ("agent_b", "reply", 'reply1 caf\u00e9 "quoted"\n'),
    ]
    hits = conn.execute("SELECT agent_id FROM search WHERE search MATCH 'reply1'").fetchall()
    assert hits == [("agent_b",)]
    conn.execute("INSERT INTO search (search) VALUES ('integrity-check')")
    assert _index(conn) == []  # nothing queued: no change either
    assert _automerge(conn) == [("automerge", 4 if before is None else before)]


def test_failed_index_keeps_automerge(
    conn: sqlite3.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = search_backlog.index_agent

    def fail_second(c: sqlite3.Connection, agent_id: str) -> int:
        if agent_id == "agent_b":
            raise sqlite3.OperationalError("disk I/O error")
        return real(c, agent_id)

    monkeypatch.setattr(search_backlog, "index_agent", fail_second)
    conn.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.OperationalError):
        search_backlog.index_next(conn)
    # Kept before the rollback too, were the caller to commit what went in.
    assert _automerge(conn) == [("automerge", 4)]
    conn.execute("ROLLBACK")
    assert _automerge(conn) == []
    assert conn.execute("SELECT COUNT(*) FROM search").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM search_backlog").fetchone()[0] == 2
