"""SQL for machine.db: small synchronous functions run inside :class:`Database` jobs.

Each function takes the connection of the job it runs in, so a caller can put
several of them in one transaction (an event, its run state change and its
search index rows commit together or not at all).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Set as AbstractSet
from typing import Any

from machine.models import (
    AgentRecord,
    AgentState,
    EventKind,
    PendingPermission,
    RunErrorCode,
    RunRecord,
    RunState,
    SearchHit,
    StoredEvent,
)
from shared.errors import IntegrityError, NotFound

__all__ = [
    "OwnIds",
    "append_event",
    "count_agents",
    "count_rows",
    "get_agent",
    "get_run",
    "get_setting",
    "insert_permission",
    "insert_agent",
    "list_agents",
    "list_runs",
    "read_events",
    "row_to_agent",
    "rule_for",
    "search",
    "set_session_id",
    "set_setting",
]

logger = logging.getLogger(__name__)

_SUMMARY_CHARS = 280


def get_setting(conn: sqlite3.Connection, key: str) -> str | None:
    """A value of the settings table, or None."""
    row = conn.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
    return None if row is None else str(row[0])


def set_setting(conn: sqlite3.Connection, key: str, value: str) -> None:
    """Insert or replace a setting."""
    conn.execute(
        "INSERT INTO settings (key, value) VALUES (?, ?) "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (key, value),
    )


OwnIds = AbstractSet[str] | str
"""This machine's own ids (a single id is accepted for callers that know only one)."""


def _is_own(origin: str, own: OwnIds) -> bool:
    # A bare str is one id, not a set of characters.
    return origin == own if isinstance(own, str) else origin in own


def row_to_agent(row: sqlite3.Row, own: OwnIds) -> AgentRecord:
    """Build an AgentRecord; ``local`` is whether its origin is one of ``own``."""
    return AgentRecord(
        id=row["id"],
        name=row["name"],
        folder=row["folder"],
        runtime=row["runtime"],
        settings=json.loads(row["settings_json"]),
        state=AgentState(row["state"]),
        origin_machine=row["origin_machine"],
        local=_is_own(row["origin_machine"], own),
        session_id=row["session_id"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        last_seq=row["last_seq"],
    )


def insert_agent(conn: sqlite3.Connection, agent: AgentRecord) -> None:
    """Insert a new agent row."""
    conn.execute(
        "INSERT INTO agents (id, name, folder, runtime, settings_json, state, origin_machine,"
        " session_id, created_at, updated_at, last_seq) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        (
            agent.id,
            agent.name,
            agent.folder,
            agent.runtime,
            json.dumps(agent.settings, sort_keys=True),
            agent.state.value,
            agent.origin_machine,
            agent.session_id,
            agent.created_at,
            agent.updated_at,
            agent.last_seq,
        ),
    )


def set_session_id(conn: sqlite3.Connection, agent_id: str, session_id: str) -> None:
    """Record the runtime session an agent continues in its next run."""
    conn.execute("UPDATE agents SET session_id = ? WHERE id = ?", (session_id, agent_id))


def get_agent(conn: sqlite3.Connection, agent_id: str, own: OwnIds) -> AgentRecord:
    """One agent; NotFound when missing. ``own``: this machine's ids (see row_to_agent)."""
    row = conn.execute("SELECT * FROM agents WHERE id = ?", (agent_id,)).fetchone()
    if row is None:
        raise NotFound("agent", agent_id)
    return row_to_agent(row, own)


def list_agents(
    conn: sqlite3.Connection, own: OwnIds, *, include_archived: bool
) -> list[AgentRecord]:
    """Agents, newest first."""
    sql = "SELECT * FROM agents"
    if not include_archived:
        sql += " WHERE state = 'active'"
    sql += " ORDER BY created_at DESC, id DESC"
    return [row_to_agent(r, own) for r in conn.execute(sql)]


def _row_to_run(row: sqlite3.Row) -> RunRecord:
    return RunRecord(
        id=row["id"],
        agent_id=row["agent_id"],
        state=RunState(row["state"]),
        prompt=row["prompt"],
        attachments=tuple(json.loads(row["attachments_json"])),
        created_at=row["created_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        input_tokens=row["input_tokens"] if row["usage_reported"] else None,
        output_tokens=row["output_tokens"] if row["usage_reported"] else None,
        duration_ms=row["duration_ms"],
        stop_reason=row["stop_reason"],
        error_code=RunErrorCode(row["error_code"]) if row["error_code"] else None,
    )


def get_run(conn: sqlite3.Connection, run_id: str) -> RunRecord:
    """One run; NotFound when missing."""
    row = conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
    if row is None:
        raise NotFound("run", run_id)
    return _row_to_run(row)


def list_runs(conn: sqlite3.Connection, agent_id: str, limit: int) -> list[RunRecord]:
    """An agent's runs, newest first."""
    rows = conn.execute(
        "SELECT * FROM runs WHERE agent_id = ? ORDER BY created_at DESC, id DESC LIMIT ?",
        (agent_id, limit),
    )
    return [_row_to_run(r) for r in rows]


def runs_in_states(conn: sqlite3.Connection, states: tuple[RunState, ...]) -> list[RunRecord]:
    """Runs whose state is one of ``states``, oldest first."""
    marks = ",".join("?" for _ in states)
    rows = conn.execute(
        f"SELECT * FROM runs WHERE state IN ({marks}) ORDER BY created_at, id",
        tuple(s.value for s in states),
    )
    return [_row_to_run(r) for r in rows]


def set_run_state(conn: sqlite3.Connection, run_id: str, state: RunState, **fields: Any) -> None:
    """Change a run's state and any of its other columns.

    ``input_tokens``/``output_tokens`` of None mean "not reported": they are
    stored as 0 with ``usage_reported`` 0."""
    if "input_tokens" in fields or "output_tokens" in fields:
        known = fields.get("input_tokens") is not None or fields.get("output_tokens") is not None
        fields["usage_reported"] = int(known)
        fields["input_tokens"] = fields.get("input_tokens") or 0
        fields["output_tokens"] = fields.get("output_tokens") or 0
    allowed = {
        "started_at",
        "finished_at",
        "input_tokens",
        "output_tokens",
        "duration_ms",
        "stop_reason",
        "error_code",
        "usage_reported",
    }
    cols = ["state = ?"]
    values: list[Any] = [state.value]
    for key, value in fields.items():
        if key not in allowed:
            raise ValueError(f"set_run_state: unknown column {key}")
        cols.append(f"{key} = ?")
        values.append(value)
    values.append(run_id)
    conn.execute(f"UPDATE runs SET {', '.join(cols)} WHERE id = ?", values)


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
    conn.execute(
        "INSERT INTO summaries (run_id, agent_id, text, created_at) VALUES (?,?,?,?) "
        "ON CONFLICT (run_id) DO UPDATE SET text = excluded.text",
        (run_id, agent_id, summary, now),
    )
    first = rows[0]["seq"] if rows else 0
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


def get_permission(conn: sqlite3.Connection, run_id: str, request_id: str) -> PendingPermission:
    """A stored permission request; NotFound when missing."""
    row = conn.execute(
        "SELECT * FROM permissions WHERE run_id = ? AND request_id = ?", (run_id, request_id)
    ).fetchone()
    if row is None:
        raise NotFound("permission request", request_id)
    return _row_to_permission(row)


def insert_permission(
    conn: sqlite3.Connection,
    perm: PendingPermission,
    *,
    requested_at: float,
    answered_at: float | None = None,
) -> None:
    """Store a new permission request (already answered when a rule decided it)."""
    conn.execute(
        "INSERT INTO permissions (run_id, request_id, agent_id, call_id, title,"
        " options_json, seq, state, option_id, remember, requested_at, answered_at)"
        " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            perm.run_id,
            perm.request_id,
            perm.agent_id,
            perm.call_id,
            perm.title,
            json.dumps([list(o) for o in perm.options]),
            perm.seq,
            perm.state,
            perm.option_id,
            int(perm.remember),
            requested_at,
            answered_at,
        ),
    )


def rule_for(conn: sqlite3.Connection, agent_id: str, tool: str) -> str | None:
    """The remembered decision (``allow``/``reject``) for a tool of an agent, or None."""
    row = conn.execute(
        "SELECT decision FROM permission_rules WHERE agent_id = ? AND tool = ?",
        (agent_id, tool),
    ).fetchone()
    return None if row is None else str(row[0])


def _row_to_permission(row: sqlite3.Row) -> PendingPermission:
    return PendingPermission(
        run_id=row["run_id"],
        request_id=row["request_id"],
        agent_id=row["agent_id"],
        call_id=row["call_id"],
        title=row["title"],
        options=tuple(tuple(o) for o in json.loads(row["options_json"])),
        seq=row["seq"],
        state=row["state"],
        option_id=row["option_id"],
        remember=bool(row["remember"]),
    )


def run_permissions(conn: sqlite3.Connection, run_id: str) -> list[PendingPermission]:
    """Every permission request of a run, in order."""
    rows = conn.execute("SELECT * FROM permissions WHERE run_id = ? ORDER BY seq", (run_id,))
    return [_row_to_permission(r) for r in rows]


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


def count_agents(conn: sqlite3.Connection) -> int:
    """How many agents there are, active or archived."""
    return int(conn.execute("SELECT COUNT(*) FROM agents").fetchone()[0])


def count_rows(conn: sqlite3.Connection, table: str) -> int:
    """Row count of a table (tests and status)."""
    if not table.isidentifier():
        raise ValueError(f"bad table name {table!r}")
    return int(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])
