"""Erasure's SQL: an agent's rows deleted, the erased list, receipts and the queue.

:func:`delete_agent_rows` removes every row that holds an agent's data; the
caller runs it in the same transaction that adds the agent to the erased list
and writes its receipt (:func:`add_erased`, :func:`insert_receipt`), so an
agent is either whole or erased and listed. :func:`optimize_search` and
:func:`checkpoint_truncate` then make the deleted bytes go from the files.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from machine.storage.tables.rows import from_row, present
from machine.storage.tables.schedules import delete_agent_schedules

__all__ = [
    "ERASED_MAX",
    "LAYER_STATES",
    "QueuedErasure",
    "Receipt",
    "add_erased",
    "checkpoint_truncate",
    "delete_agent_rows",
    "erased_among",
    "erased_rows",
    "finish_scrub",
    "insert_receipt",
    "list_receipts",
    "optimize_search",
    "unscrubbed_receipts",
    "prune_erased",
    "queue_length",
    "queued",
    "record_attempt",
    "unreferenced_attachments",
]

logger = logging.getLogger(__name__)

#: The erased list holds at most this many ids (the oldest go first).
ERASED_MAX = 10_000
#: What each layer of a receipt may read.
LAYER_STATES = ("done", "unsupported", "failed", "pending")

# Tables holding an agent's data, children first (foreign keys also cascade
# from agents; deleting explicitly keeps this list the one place to look).
_AGENT_TABLES = (
    "search",
    "attachment_refs",
    "permission_rules",
    "permissions",
    "summaries",
    "tool_log",
    "events",
    "runs",
)


@dataclass(frozen=True)
class Receipt:
    """What erasing one agent did, per layer (done, unsupported, failed, pending)."""

    agent_id: str
    erased_at: float
    runtime: str
    attempts: int
    last_attempt_at: float | None
    machine_data: str
    attachments: str
    runtime_copy: str
    detail: str


@dataclass(frozen=True)
class QueuedErasure:
    """A runtime erasure waiting in the queue: what it needs to start the runtime."""

    agent_id: str
    erased_at: float
    runtime: str
    folder: str
    settings: dict[str, Any]
    session_id: str | None
    attempts: int


def delete_agent_rows(conn: sqlite3.Connection, agent_id: str) -> list[str]:
    """Delete every row of ``agent_id`` (its search index rows included) and the
    attachment records no other agent names; return those attachments' sha256."""
    mine = [
        r[0]
        for r in conn.execute(
            "SELECT DISTINCT sha256 FROM attachment_refs WHERE agent_id = ?", (agent_id,)
        )
    ]
    for table in _AGENT_TABLES:
        conn.execute(f"DELETE FROM {table} WHERE agent_id = ?", (agent_id,))
    # Its schedules and their fire records, in this same transaction (the
    # foreign keys would cascade too; said here so it does not rest on a pragma).
    delete_agent_schedules(conn, agent_id)
    conn.execute("DELETE FROM agents WHERE id = ?", (agent_id,))
    orphans: list[str] = []
    for sha in mine:
        named = conn.execute(
            "SELECT 1 FROM attachment_refs WHERE sha256 = ? LIMIT 1", (sha,)
        ).fetchone()
        if named is None:
            conn.execute("DELETE FROM attachments WHERE sha256 = ?", (sha,))
            orphans.append(sha)
    return orphans


def add_erased(conn: sqlite3.Connection, agent_id: str, erased_at: float) -> None:
    """Put an agent on the erased list (keeping the earlier time if listed), then
    drop the oldest entries beyond :data:`ERASED_MAX`."""
    conn.execute(
        "INSERT INTO erased (agent_id, erased_at) VALUES (?, ?) "
        "ON CONFLICT (agent_id) DO UPDATE SET erased_at = MIN(erased_at, excluded.erased_at)",
        (agent_id, erased_at),
    )
    conn.execute(
        "DELETE FROM erased WHERE agent_id IN (SELECT agent_id FROM erased"
        " ORDER BY erased_at DESC, agent_id DESC LIMIT -1 OFFSET ?)",
        (ERASED_MAX,),
    )


def erased_among(conn: sqlite3.Connection, ids: Iterable[str]) -> set[str]:
    """Which of ``ids`` are on the erased list."""
    return present(conn, "erased", "agent_id", ids)


def erased_rows(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """The erased list, oldest first, as backups carry it."""
    rows = conn.execute("SELECT agent_id, erased_at FROM erased ORDER BY erased_at, agent_id")
    return [{"agent_id": r[0], "erased_at": r[1]} for r in rows]


def prune_erased(conn: sqlite3.Connection, cutoff: float) -> int:
    """Drop erased-list entries older than ``cutoff`` and their finished receipts;
    return how many entries went."""
    gone = conn.execute("DELETE FROM erased WHERE erased_at < ?", (cutoff,)).rowcount
    conn.execute(
        "DELETE FROM erasures WHERE runtime_copy != 'pending'"
        " AND agent_id NOT IN (SELECT agent_id FROM erased)"
    )
    return int(gone)


def queue_length(conn: sqlite3.Connection) -> int:
    """Runtime erasures waiting."""
    row = conn.execute("SELECT COUNT(*) FROM erasures WHERE runtime_copy = 'pending'").fetchone()
    return int(row[0])


def insert_receipt(
    conn: sqlite3.Connection,
    *,
    agent_id: str,
    erased_at: float,
    runtime: str,
    folder: str,
    settings: dict[str, Any],
    session_id: str | None,
    attachments: str,
    runtime_copy: str,
    detail: str = "",
) -> None:
    """Write an erased agent's receipt; ``runtime_copy='pending'`` queues its
    runtime erasure (the settings are kept only then). Its machine data reads
    pending until the deleted bytes have left the files (:func:`finish_scrub`)."""
    keep = runtime_copy == "pending"
    conn.execute(
        "INSERT OR REPLACE INTO erasures (agent_id, erased_at, runtime, folder, settings_json,"
        " session_id, attempts, machine_data, attachments, runtime_copy, detail)"
        " VALUES (?,?,?,?,?,?,0,'pending',?,?,?)",
        (
            agent_id,
            erased_at,
            runtime,
            folder if keep else "",
            json.dumps(settings, sort_keys=True) if keep else "{}",
            session_id if keep else None,
            attachments,
            runtime_copy,
            detail,
        ),
    )


def list_receipts(conn: sqlite3.Connection) -> tuple[list[Receipt], list[tuple[str, float]]]:
    """Receipts (queued first, then newest first) and erased-list entries with no
    receipt here (brought by a restore), newest first."""
    receipts = [
        from_row(Receipt, r)
        for r in conn.execute(
            "SELECT * FROM erasures ORDER BY runtime_copy != 'pending', erased_at DESC, agent_id"
        )
    ]
    listed = [
        (r[0], r[1])
        for r in conn.execute(
            "SELECT agent_id, erased_at FROM erased WHERE agent_id NOT IN"
            " (SELECT agent_id FROM erasures) ORDER BY erased_at DESC, agent_id"
        )
    ]
    return receipts, listed


def queued(conn: sqlite3.Connection) -> list[QueuedErasure]:
    """The runtime erasure queue, oldest first."""
    rows = conn.execute(
        "SELECT * FROM erasures WHERE runtime_copy = 'pending' ORDER BY erased_at, agent_id"
    )
    return [
        QueuedErasure(
            agent_id=r["agent_id"],
            erased_at=r["erased_at"],
            runtime=r["runtime"],
            folder=r["folder"],
            settings=json.loads(r["settings_json"]),
            session_id=r["session_id"],
            attempts=r["attempts"],
        )
        for r in rows
    ]


def record_attempt(
    conn: sqlite3.Connection,
    agent_id: str,
    *,
    result: str,
    detail: str,
    now: float,
    tried: bool = True,
) -> None:
    """Record a runtime erasure's result (counting a try when ``tried``); a final
    result drops what the erasure needed (settings may hold credentials)."""
    conn.execute(
        "UPDATE erasures SET attempts = attempts + ?, last_attempt_at = ?, runtime_copy = ?,"
        " detail = ? WHERE agent_id = ?",
        (int(tried), now, result, detail, agent_id),
    )
    if result != "pending":
        conn.execute(
            "UPDATE erasures SET settings_json = '{}', folder = '', session_id = NULL"
            " WHERE agent_id = ?",
            (agent_id,),
        )


def unscrubbed_receipts(conn: sqlite3.Connection) -> list[str]:
    """Agents whose deleted bytes may still be in the files (a crash after the commit)."""
    rows = conn.execute(
        "SELECT agent_id FROM erasures WHERE machine_data = 'pending' OR attachments = 'pending'"
    )
    return [r[0] for r in rows]


def finish_scrub(conn: sqlite3.Connection, agent_ids: Iterable[str], attachments: str) -> None:
    """The deleted bytes left the database files: machine data done, and the
    attachments layer ``attachments`` (done, or failed)."""
    conn.executemany(
        "UPDATE erasures SET machine_data = 'done', attachments = ? WHERE agent_id = ?",
        [(attachments, a) for a in agent_ids],
    )


def unreferenced_attachments(conn: sqlite3.Connection, shas: Iterable[str]) -> list[str]:
    """Which of ``shas`` no agent names (neither a reference nor a record)."""
    out = []
    for sha in shas:
        row = conn.execute(
            "SELECT 1 FROM attachment_refs WHERE sha256 = ? UNION ALL"
            " SELECT 1 FROM attachments WHERE sha256 = ? LIMIT 1",
            (sha, sha),
        ).fetchone()
        if row is None:
            out.append(sha)
    return out


def optimize_search(conn: sqlite3.Connection) -> None:
    """Merge the search index into one segment: deleted rows' terms leave the
    index's pages (FTS5 otherwise keeps them, marked deleted, until a merge)."""
    conn.execute("INSERT INTO search (search) VALUES ('optimize')")


def checkpoint_truncate(conn: sqlite3.Connection) -> tuple[int, int, int]:
    """Copy the WAL into the database and truncate it to 0 bytes (outside any
    transaction); return SQLite's (busy, wal frames, frames checkpointed)."""
    row = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    return int(row[0]), int(row[1]), int(row[2])
