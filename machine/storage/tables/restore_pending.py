"""Restored agents whose history is still packed, not loaded yet (store layer).

A restore commits each agent's record with one ``restore_pending`` row naming
where its authenticated segment lies in a pack file (``machine/storage/restored.py``);
the conversation, runs, summaries, tool log and schedules are loaded from there
later, one agent per write transaction: the rows and the removal of the
pending row commit together (the commit point), so a daemon killed at any
moment resumes where it was and never loads an agent twice.

A history that does not load (a malformed line in a segment that authenticated:
only a backup writer's bug or someone holding the keys makes one) keeps its row
with ``failed`` set, and the agent its record alone.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

from machine.storage.tables import export as store_export

__all__ = [
    "Pending",
    "failed_count",
    "failed_history",
    "failed_reason",
    "loadable_count",
    "load",
    "mark_failed",
    "next_pending",
    "pack_in_use",
    "packs_in_use",
    "pending_count",
    "queue",
    "retry_failed",
]


@dataclass(frozen=True)
class Pending:
    """One agent's packed history: where it lies."""

    agent_id: str
    pack: str
    offset: int
    length: int


def queue(
    conn: sqlite3.Connection,
    agent_id: str,
    pack: str,
    offset: int,
    length: int,
    usage: Iterable[dict[str, Any]],
    now: float,
) -> None:
    """Leave ``agent_id``'s history for the loader (in the caller's transaction);
    ``usage`` are the backup's usage rows of its runs."""
    conn.execute(
        "INSERT INTO restore_pending (agent_id, pack, pack_offset, pack_length, usage_json,"
        " queued_at) VALUES (?,?,?,?,?,?)",
        (agent_id, pack, offset, length, json.dumps(list(usage)), now),
    )


def pending_count(conn: sqlite3.Connection) -> int:
    """How many agents' histories are still to load (failed ones included)."""
    return int(conn.execute("SELECT COUNT(*) FROM restore_pending").fetchone()[0])


def loadable_count(conn: sqlite3.Connection) -> int:
    """How many agents' histories are still to load, those that did not load left out."""
    row = conn.execute("SELECT COUNT(*) FROM restore_pending WHERE failed IS NULL")
    return int(row.fetchone()[0])


def next_pending(
    conn: sqlite3.Connection,
    agent_id: str | None = None,
    *,
    max_agents: int = 1,
    max_bytes: int = 0,
) -> list[Pending]:
    """``agent_id``'s packed history, or (None) the first queued ones: at most
    ``max_agents``, and no more once ``max_bytes`` of packed bytes are in; never a
    failed one."""
    if agent_id is None:
        rows = conn.execute(
            "SELECT agent_id, pack, pack_offset, pack_length FROM restore_pending"
            " WHERE failed IS NULL ORDER BY queued_at, agent_id LIMIT ?",
            (max(1, max_agents),),
        )
    else:
        rows = conn.execute(
            "SELECT agent_id, pack, pack_offset, pack_length FROM restore_pending"
            " WHERE agent_id = ? AND failed IS NULL",
            (agent_id,),
        )
    out: list[Pending] = []
    size = 0
    for row in rows:
        if out and max_bytes and size >= max_bytes:
            break
        out.append(Pending(str(row[0]), str(row[1]), int(row[2]), int(row[3])))
        size += int(row[3])
    return out


def failed_count(conn: sqlite3.Connection) -> int:
    """How many histories did not load."""
    row = conn.execute("SELECT COUNT(*) FROM restore_pending WHERE failed IS NOT NULL")
    return int(row.fetchone()[0])


def failed_reason(conn: sqlite3.Connection, agent_id: str) -> str | None:
    """Why ``agent_id``'s history did not load, or None."""
    row = conn.execute(
        "SELECT failed FROM restore_pending WHERE agent_id = ? AND failed IS NOT NULL",
        (agent_id,),
    ).fetchone()
    return None if row is None else str(row[0])


def load(
    conn: sqlite3.Connection,
    batch: Iterable[Pending],
    open_segment: Callable[[Pending], Any],
) -> set[str]:
    """Load each history of ``batch`` and take it off the list, in the caller's
    transaction; return the packs that hold no agent's history now.

    ``open_segment(pending)`` is a context manager giving the agent's
    :class:`~machine.formats.segment_files.SegmentFiles`. Raises what a load raises
    (the caller's transaction rolls back; see :func:`mark_failed`).
    """
    packs = set()
    for pending in batch:
        if _load_one(conn, pending, open_segment):
            packs.add(pending.pack)
    return {p for p in packs if not pack_in_use(conn, p)}


def _load_one(
    conn: sqlite3.Connection, pending: Pending, open_segment: Callable[[Pending], Any]
) -> bool:
    row = conn.execute(
        "SELECT usage_json FROM restore_pending WHERE agent_id = ? AND failed IS NULL",
        (pending.agent_id,),
    ).fetchone()
    if row is None:
        return False  # loaded (or failed) meanwhile
    runs = store_export.usage_by_run(json.loads(row[0]))
    with open_segment(pending) as files:
        opened: Callable[[str], Any] = files.open
        with opened("record.json") as record:
            _skip(record)  # inserted by the restore
        store_export.load_history(
            conn,
            pending.agent_id,
            pending.agent_id,
            files.open,
            optional=files.open_optional,
            runs=runs,
            index=False,  # its search backlog row is the restore's
        )
    conn.execute("DELETE FROM restore_pending WHERE agent_id = ?", (pending.agent_id,))
    return True


def _skip(f: IO[bytes]) -> None:
    while f.read(1024 * 1024):
        pass


def mark_failed(
    conn: sqlite3.Connection, agent_id: str, reason: str, pack: str, length: int
) -> None:
    """Keep ``agent_id``'s row, now naming its history alone in ``pack`` (of
    ``length`` bytes), and the agent its record alone, with why it failed."""
    conn.execute(
        "UPDATE restore_pending SET failed = ?, pack = ?, pack_offset = 0, pack_length = ?"
        " WHERE agent_id = ?",
        (reason[:2000], pack, length, agent_id),
    )


def failed_history(conn: sqlite3.Connection, agent_id: str) -> Pending | None:
    """Where ``agent_id``'s history lies when it did not load, or None."""
    row = conn.execute(
        "SELECT agent_id, pack, pack_offset, pack_length FROM restore_pending"
        " WHERE agent_id = ? AND failed IS NOT NULL",
        (agent_id,),
    ).fetchone()
    return None if row is None else Pending(str(row[0]), str(row[1]), int(row[2]), int(row[3]))


def retry_failed(conn: sqlite3.Connection) -> int:
    """Let every history that did not load be tried again; return how many."""
    cur = conn.execute("UPDATE restore_pending SET failed = NULL WHERE failed IS NOT NULL")
    return cur.rowcount


def pack_in_use(conn: sqlite3.Connection, pack: str) -> bool:
    """Whether any agent's history is still in ``pack``."""
    row = conn.execute("SELECT 1 FROM restore_pending WHERE pack = ? LIMIT 1", (pack,))
    return row.fetchone() is not None


def packs_in_use(conn: sqlite3.Connection) -> set[str]:
    """The packs any agent's history is still in."""
    return {str(r[0]) for r in conn.execute("SELECT DISTINCT pack FROM restore_pending")}
