"""Permission requests of runs and the rules remembered from their answers."""

from __future__ import annotations

import json
import logging
import sqlite3

from machine.models import PendingPermission
from shared.errors import NotFound

logger = logging.getLogger(__name__)


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


def answer_permission(
    conn: sqlite3.Connection,
    run_id: str,
    request_id: str,
    option_id: str,
    *,
    remember: bool,
    now: float,
) -> None:
    """Record the answer to a pending permission request."""
    conn.execute(
        "UPDATE permissions SET state = 'answered', option_id = ?, remember = ?,"
        " answered_at = ? WHERE run_id = ? AND request_id = ?",
        (option_id, int(remember), now, run_id, request_id),
    )


def remember_rule(
    conn: sqlite3.Connection, agent_id: str, tool: str, decision: str, now: float
) -> None:
    """Remember ``decision`` (allow/reject) for the agent's future requests of ``tool``."""
    conn.execute(
        "INSERT INTO permission_rules (agent_id, tool, decision, created_at)"
        " VALUES (?,?,?,?) ON CONFLICT (agent_id, tool) DO UPDATE SET"
        " decision = excluded.decision, created_at = excluded.created_at",
        (agent_id, tool, decision, now),
    )


def cancel_pending_permissions(conn: sqlite3.Connection, run_id: str) -> None:
    """Mark the run's unanswered requests cancelled (the run has ended)."""
    conn.execute(
        "UPDATE permissions SET state = 'cancelled' WHERE run_id = ? AND state = 'pending'",
        (run_id,),
    )
