"""The agents table."""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Set as AbstractSet
from typing import Any

from machine.models import AgentRecord, AgentState
from shared.errors import NotFound

logger = logging.getLogger(__name__)


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


def count_agents(conn: sqlite3.Connection) -> int:
    """How many agents there are, active or archived."""
    return int(conn.execute("SELECT COUNT(*) FROM agents").fetchone()[0])


def rename_agent(conn: sqlite3.Connection, agent_id: str, name: str, now: float) -> None:
    """Set an agent's display name."""
    conn.execute("UPDATE agents SET name = ?, updated_at = ? WHERE id = ?", (name, now, agent_id))


def set_agent_settings(
    conn: sqlite3.Connection, agent_id: str, settings: dict[str, Any], now: float
) -> None:
    """Replace an agent's (checked) runtime settings."""
    conn.execute(
        "UPDATE agents SET settings_json = ?, updated_at = ? WHERE id = ?",
        (json.dumps(settings, sort_keys=True), now, agent_id),
    )


def set_agent_state(conn: sqlite3.Connection, agent_id: str, state: AgentState, now: float) -> None:
    """Archive or unarchive an agent."""
    conn.execute(
        "UPDATE agents SET state = ?, updated_at = ? WHERE id = ?", (state.value, now, agent_id)
    )
