"""The settings table, the machine log and row counts."""

from __future__ import annotations

import logging
import sqlite3

logger = logging.getLogger(__name__)


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


def count_rows(conn: sqlite3.Connection, table: str) -> int:
    """Row count of a table (tests and status)."""
    if not table.isidentifier():
        raise ValueError(f"bad table name {table!r}")
    return int(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


def log(conn: sqlite3.Connection, now: float, kind: str, detail: str) -> None:
    """Add an entry to the machine log."""
    conn.execute(
        "INSERT INTO machine_log (time, kind, detail) VALUES (?, ?, ?)", (now, kind, detail)
    )


def prune_log(conn: sqlite3.Connection, cutoff: float) -> int:
    """Delete machine log entries older than ``cutoff``; return how many."""
    return int(conn.execute("DELETE FROM machine_log WHERE time < ?", (cutoff,)).rowcount)


def state_counts(conn: sqlite3.Connection, table: str) -> dict[str, int]:
    """How many rows of ``table`` (agents or runs) are in each state."""
    if table not in ("agents", "runs"):
        raise ValueError(f"bad table name {table!r}")
    return {
        str(state): int(n)
        for state, n in conn.execute(f"SELECT state, COUNT(*) FROM {table} GROUP BY state")
    }
