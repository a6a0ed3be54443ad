"""The attachments table and the references from agents and runs to it."""

from __future__ import annotations

import sqlite3

__all__ = ["add_attachment_ref", "attachment_referenced", "record_attachment"]


def record_attachment(conn: sqlite3.Connection, sha256: str, size: int, now: float) -> None:
    """Record an attachment's content (kept if already recorded)."""
    conn.execute(
        "INSERT INTO attachments (sha256, size, created_at) VALUES (?,?,?) "
        "ON CONFLICT (sha256) DO NOTHING",
        (sha256, size, now),
    )


def add_attachment_ref(
    conn: sqlite3.Connection,
    sha256: str,
    agent_id: str,
    *,
    run_id: str = "",
    file_name: str = "",
    media_type: str = "",
    now: float,
) -> None:
    """Reference an attachment from an agent (an upload, with its file name and
    media type) or a run (a prompt)."""
    conn.execute(
        "INSERT INTO attachment_refs"
        " (sha256, agent_id, run_id, file_name, media_type, created_at)"
        " VALUES (?,?,?,?,?,?) ON CONFLICT DO NOTHING",
        (sha256, agent_id, run_id, file_name, media_type, now),
    )


def attachment_referenced(conn: sqlite3.Connection, sha256: str, agent_id: str) -> bool:
    """Whether the attachment was uploaded for (or used by) the agent."""
    row = conn.execute(
        "SELECT 1 FROM attachment_refs WHERE sha256 = ? AND agent_id = ? LIMIT 1",
        (sha256, agent_id),
    ).fetchone()
    return row is not None
