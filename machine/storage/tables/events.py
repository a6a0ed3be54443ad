"""Events, and what follows each one in the same transaction: the tool log,
the search index and the turn summaries."""

from __future__ import annotations

import json
import logging
import sqlite3
from typing import Any

from machine.models import EventKind, SearchHit, StoredEvent
from shared.errors import IntegrityError, NotFound

logger = logging.getLogger(__name__)


_SUMMARY_CHARS = 280


def _row_to_event(row: sqlite3.Row) -> StoredEvent:
    try:
        kind = EventKind(row["kind"])
        payload = json.loads(row["payload_json"])
    except ValueError:
        # Only damage writes such a row: name it rather than fail with INTERNAL.
        raise IntegrityError(
            f"read event {row['seq']} of agent {row['agent_id']}",
            "its stored kind or payload is unreadable (the database is damaged)",
        ) from None
    return StoredEvent(
        agent_id=row["agent_id"],
        seq=row["seq"],
        run_id=row["run_id"],
        kind=kind,
        payload=payload,
        time=row["time"],
    )


def read_events(
    conn: sqlite3.Connection,
    agent_id: str,
    after_seq: int,
    limit: int = 1000,
    max_bytes: int | None = None,
) -> list[StoredEvent]:
    """Events of an agent with seq > after_seq, in order: at most ``limit``, and
    stopping once their payloads reach ``max_bytes`` (at least one event)."""
    rows = conn.execute(
        "SELECT * FROM events WHERE agent_id = ? AND seq > ? ORDER BY seq LIMIT ?",
        (agent_id, after_seq, limit),
    )
    out: list[StoredEvent] = []
    size = 0
    for row in rows:
        out.append(_row_to_event(row))
        size += len(row["payload_json"])
        if max_bytes is not None and size >= max_bytes:
            break
    return out


def run_events(conn: sqlite3.Connection, run_id: str) -> list[StoredEvent]:
    """Every event of one run, in order."""
    rows = conn.execute("SELECT * FROM events WHERE run_id = ? ORDER BY seq", (run_id,))
    return [_row_to_event(r) for r in rows]


def _index(
    conn: sqlite3.Connection, text: str, agent_id: str, run_id: str, seq: int, source: str
) -> None:
    if text.strip():
        conn.execute(
            "INSERT INTO search (text, agent_id, run_id, seq, source) VALUES (?,?,?,?,?)",
            (text, agent_id, run_id, seq, source),
        )


def _on_run_end(conn: sqlite3.Connection, agent_id: str, run_id: str, now: float) -> None:
    """Index the run's reply text and write its turn summary (same transaction)."""
    rows = conn.execute(
        "SELECT seq, payload_json FROM events WHERE run_id = ? AND kind = 'TEXT_DELTA' "
        "ORDER BY seq",
        (run_id,),
    ).fetchall()
    reply = "".join(json.loads(r["payload_json"]).get("text", "") for r in rows)
    if rows:
        _index(conn, reply, agent_id, run_id, rows[0]["seq"], "reply")
    prompt_row = conn.execute("SELECT prompt FROM runs WHERE id = ?", (run_id,)).fetchone()
    prompt = prompt_row["prompt"] if prompt_row else ""
    summary = _summarise(prompt, reply)
    had = conn.execute("SELECT 1 FROM summaries WHERE run_id = ?", (run_id,)).fetchone()
    conn.execute(
        "INSERT INTO summaries (run_id, agent_id, text, created_at) VALUES (?,?,?,?) "
        "ON CONFLICT (run_id) DO UPDATE SET text = excluded.text",
        (run_id, agent_id, summary, now),
    )
    first = rows[0]["seq"] if rows else 0
    if had is not None:
        # A filter on FTS5's unindexed columns scans the whole search table (about
        # 15 ms per 50,000 rows, inside the writer's transaction): only a run whose
        # end is stored again has an old summary row to replace.
        conn.execute("DELETE FROM search WHERE run_id = ? AND source = 'summary'", (run_id,))
    _index(conn, summary, agent_id, run_id, first, "summary")


def _summarise(prompt: str, reply: str) -> str:
    # A deterministic extract until runtimes can summarise: first line of each side.
    ask = " ".join(prompt.split())[: _SUMMARY_CHARS // 2]
    answer = " ".join(reply.split())[: _SUMMARY_CHARS // 2]
    return f"{ask} -> {answer}" if answer else ask


def append_event(
    conn: sqlite3.Connection,
    agent_id: str,
    run_id: str,
    kind: EventKind,
    payload: dict[str, Any],
    now: float,
) -> StoredEvent:
    """Give the event the conversation's next seq, store it and keep the tool log and
    the search index in step (all in the caller's transaction)."""
    row = conn.execute(
        "UPDATE agents SET last_seq = last_seq + 1 WHERE id = ? RETURNING last_seq", (agent_id,)
    ).fetchone()
    if row is None:
        raise NotFound("agent", agent_id)
    seq = int(row[0])
    conn.execute(
        "INSERT INTO events (agent_id, seq, run_id, kind, payload_json, time) VALUES (?,?,?,?,?,?)",
        (agent_id, seq, run_id, kind.value, json.dumps(payload, sort_keys=True), now),
    )
    if kind is EventKind.RUN_STARTED:
        _index(conn, str(payload.get("prompt", "")), agent_id, run_id, seq, "prompt")
    elif kind is EventKind.TOOL_CALL:
        conn.execute(
            "INSERT INTO tool_log (agent_id, run_id, call_id, title, tool_kind, input_json,"
            " started_at) VALUES (?,?,?,?,?,?,?) ON CONFLICT (run_id, call_id) DO NOTHING",
            (
                agent_id,
                run_id,
                payload.get("call_id", ""),
                payload.get("title", ""),
                payload.get("tool_kind", "other"),
                payload.get("input_json", "{}"),
                now,
            ),
        )
        text = f"{payload.get('title', '')} {payload.get('input_json', '')}"
        _index(conn, text, agent_id, run_id, seq, "tool")
    elif kind is EventKind.TOOL_RESULT:
        conn.execute(
            "UPDATE tool_log SET status = ?, output = ?, ended_at = ? "
            "WHERE run_id = ? AND call_id = ?",
            (payload.get("status"), payload.get("output", ""), now, run_id, payload.get("call_id")),
        )
        _index(conn, str(payload.get("output", "")), agent_id, run_id, seq, "tool")
    elif kind in (EventKind.RUN_FINISHED, EventKind.RUN_ERROR):
        _on_run_end(conn, agent_id, run_id, now)
    return StoredEvent(agent_id, seq, run_id, kind, payload, now)


#: Kinds whose storing is one row in ``events`` and nothing else.
_PLAIN: frozenset[EventKind] = frozenset({EventKind.TEXT_DELTA})


def append_events(
    conn: sqlite3.Connection,
    agent_id: str,
    run_id: str,
    items: list[tuple[EventKind, dict[str, Any], float]],
) -> list[StoredEvent]:
    """:func:`append_event` for each of ``items`` (kind, payload, time), in order;
    a run of plain events (text deltas) takes one seq update and one insert."""
    out: list[StoredEvent] = []
    i = 0
    while i < len(items):
        kind, payload, now = items[i]
        if kind not in _PLAIN:
            out.append(append_event(conn, agent_id, run_id, kind, payload, now))
            i += 1
            continue
        j = i
        while j < len(items) and items[j][0] in _PLAIN:
            j += 1
        plain = items[i:j]
        row = conn.execute(
            "UPDATE agents SET last_seq = last_seq + ? WHERE id = ? RETURNING last_seq",
            (len(plain), agent_id),
        ).fetchone()
        if row is None:
            raise NotFound("agent", agent_id)
        first = int(row[0]) - len(plain) + 1
        rows = [
            (agent_id, first + n, run_id, k.value, json.dumps(p, sort_keys=True), t)
            for n, (k, p, t) in enumerate(plain)
        ]
        conn.executemany(
            "INSERT INTO events (agent_id, seq, run_id, kind, payload_json, time)"
            " VALUES (?,?,?,?,?,?)",
            rows,
        )
        out.extend(
            StoredEvent(agent_id, first + n, run_id, k, p, t) for n, (k, p, t) in enumerate(plain)
        )
        i = j
    return out


def search(
    conn: sqlite3.Connection, query: str, agent_id: str | None, limit: int
) -> list[SearchHit]:
    """Full-text search; ``query`` is a list of words, each quoted (no FTS syntax)."""
    words = query.split()
    match = " ".join('"' + w.replace('"', '""') + '"' for w in words)
    sql = (
        "SELECT s.agent_id, a.name, a.state, s.run_id, s.seq, s.source,"
        " snippet(search, 0, '[', ']', '...', 12) AS snip"
        " FROM search s JOIN agents a ON a.id = s.agent_id WHERE search MATCH ?"
    )
    args: list[Any] = [match]
    if agent_id:
        sql += " AND s.agent_id = ?"
        args.append(agent_id)
    sql += " ORDER BY rank LIMIT ?"
    args.append(limit)
    return [
        SearchHit(
            agent_id=r[0],
            agent_name=r[1],
            archived=r[2] == "archived",
            run_id=r[3],
            seq=int(r[4]),
            source=r[5],
            snippet=r[6],
        )
        for r in conn.execute(sql, args)
    ]
