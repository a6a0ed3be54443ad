"""The indexer reads a text delta's text with the JSON string scanner: the same
search rows as json.loads of every payload, whatever the payloads hold."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from machine.storage.db import Database
from machine.storage.tables import search_backlog

# Stored payloads of text deltas: as appends store them, and others a damaged or
# hand-made row could hold (each must index as json.loads reads it, or not at all).
_TEXTS = [
    json.dumps({"text": "plain words "}),
    json.dumps({"text": 'caf\u00e9 "quoted" back\\slash\n\ttab '}),
    json.dumps({"text": "emoji \U0001f600 and \u4e2d\u6587 "}),
    json.dumps({"text": "controls \x01\x1f\x7f "}),
    json.dumps({"text": "big " + "lorem ipsum " * 20_000}),
    json.dumps({"text": "   "}),  # whitespace alone
    json.dumps({"text": "with more", "x": 1}, sort_keys=True),
    '{"text": "a", "text": "duplicate key: the last one wins"}',
    '{"text": 5}',
    '{"text": "trailing space"} ',
    '{"text":"no space"}',
    '{"text": "raw control \x01 refused"}',
    '{"text": "escaped quote at the end\\"}',
    '{"text": "unterminated',
    '{"text": "\\u0041\\/ escapes json.dumps does not write"}',
    "[1, 2]",
    "not json",
]


@pytest.fixture
async def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    await (await Database.open(tmp_path / "machine.db")).close()  # the schema
    c = sqlite3.connect(tmp_path / "machine.db", isolation_level=None)
    c.execute(
        "INSERT INTO agents (id, name, folder, runtime, state, origin_machine, created_at,"
        " updated_at) VALUES ('agent_a', 'a', '/srv', 'echo', 'archived', 'm', 0, 0)"
    )
    rows: list[tuple[str, str, str]] = []
    for n, payload in enumerate(_TEXTS):
        run = f"run_{n}"
        rows.append((run, "RUN_STARTED", json.dumps({"prompt": f"prompt {n}"})))
        rows.append((run, "TEXT_DELTA", payload))
        rows.append((run, "TEXT_DELTA", json.dumps({"text": f" and {n}"})))
        rows.append((run, "RUN_FINISHED", "{}"))
    # Two runs interleaved, and one that never ends (its reply is not indexed).
    rows += [
        ("run_x", "TEXT_DELTA", json.dumps({"text": "x1 "})),
        ("run_y", "TEXT_DELTA", json.dumps({"text": "y1 "})),
        ("run_x", "TEXT_DELTA", json.dumps({"text": "x2"})),
        ("run_x", "RUN_ERROR", json.dumps({"code": "E"})),
        ("run_y", "TEXT_DELTA", json.dumps({"text": "y2 never ends"})),
    ]
    c.executemany(
        "INSERT INTO events (agent_id, seq, run_id, kind, payload_json, time)"
        " VALUES ('agent_a', ?, ?, ?, ?, 0)",
        [(seq, *row) for seq, row in enumerate(rows, 1)],
    )
    yield c
    c.close()


def _indexed(c: sqlite3.Connection) -> list[tuple[object, ...]]:
    c.execute("BEGIN")
    try:
        search_backlog.index_agent(c, "agent_a")
        return c.execute("SELECT rowid, * FROM search ORDER BY rowid").fetchall()
    finally:
        c.execute("ROLLBACK")


def test_rows_are_those_of_json_loads(
    conn: sqlite3.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    scanned = _indexed(conn)
    monkeypatch.setattr(search_backlog, "_TEXT_OPEN", "\x00 never")  # json.loads for all
    loaded = _indexed(conn)
    assert scanned == loaded
    replies = {row[3]: row[1] for row in loaded if row[5] == "reply"}
    assert replies["run_0"] == "plain words  and 0"
    assert replies["run_7"] == "duplicate key: the last one wins and 7"
    assert replies["run_8"] == "5 and 8"
    assert replies["run_11"] == " and 11"  # its raw control character is not JSON
    assert replies["run_x"] == "x1 x2"
    assert "run_y" not in replies
    assert len(replies["run_4"]) > 200_000


def test_the_scanner_takes_the_common_payloads(
    conn: sqlite3.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = json.loads

    def loads(s: str, **kw: object) -> object:
        calls.append(s)
        return real(s, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(search_backlog.json, "loads", loads)
    _indexed(conn)
    assert json.dumps({"text": "plain words "}) not in calls
    assert json.dumps({"text": "x1 "}) not in calls
    assert '{"text": 5}' in calls  # not a string: as before
