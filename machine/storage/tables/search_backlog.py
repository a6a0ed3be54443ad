"""The search backlog: restored agents whose conversations are not indexed yet (store layer).

A restore commits an agent's rows and one ``search_backlog`` row in the same
transaction, and leaves the full-text index to :func:`index_next`, run by a
background task one agent per transaction: the agent's search rows and the
removal of its backlog row commit together (the commit point), so a daemon
killed at any moment resumes where it was, and never indexes an agent twice.
Until then search reports how many agents are still being indexed.

The rows an agent gets are the ones a live run makes (``events.py``): the
prompt, the reply text of each finished run, each tool call and result, and
each turn summary.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
from typing import Any, Final

__all__ = [
    "backlog_count",
    "index_agent",
    "index_next",
    "queue_for_index",
]

logger = logging.getLogger(__name__)

_INSERT: Final = "INSERT INTO search (text, agent_id, run_id, seq, source) VALUES (?,?,?,?,?)"
_BATCH: Final = 500
_TERMINAL: Final = ("RUN_FINISHED", "RUN_ERROR")
_NEXT: Final = (
    "SELECT agent_id FROM search_backlog WHERE agent_id NOT IN"
    " (SELECT agent_id FROM restore_pending) ORDER BY queued_at, agent_id LIMIT 1"
)
# A text delta's payload as appends and loads store it (json.dumps of
# {"text": ...}): its text is read with the JSON decoder's own string scanner,
# the same decoding as json.loads for a fraction of its cost per call (most of
# a conversation's events are these). Any other payload goes through json.loads.
_TEXT_OPEN: Final = '{"text": "'
_scan_string: Final = json.decoder.scanstring  # type: ignore[attr-defined]
#: FTS5's own default for ``automerge`` (the schema does not set it).
_AUTOMERGE: Final = 4


def queue_for_index(conn: sqlite3.Connection, agent_id: str, now: float) -> None:
    """Leave ``agent_id``'s conversation for the indexer (in the caller's transaction)."""
    conn.execute(
        "INSERT INTO search_backlog (agent_id, queued_at) VALUES (?, ?)"
        " ON CONFLICT (agent_id) DO NOTHING",
        (agent_id, now),
    )


def backlog_count(conn: sqlite3.Connection) -> int:
    """How many agents are waiting to be indexed: not those whose restored history
    did not load (``restore_pending.failed``), which wait for no indexer; they are
    counted as failed histories, and queued still in case a later start loads them."""
    row = conn.execute(
        "SELECT COUNT(*) FROM search_backlog WHERE agent_id NOT IN"
        " (SELECT agent_id FROM restore_pending WHERE failed IS NOT NULL)"
    ).fetchone()
    return int(row[0])


def index_agent(conn: sqlite3.Connection, agent_id: str) -> int:
    """Add ``agent_id``'s search rows from its stored events and summaries; return
    the characters of text indexed.

    Runs inside the caller's transaction; the agent must have no search rows yet.
    """
    rows: list[tuple[str, str, str, int, str]] = []
    added = 0

    def add(text: str, run_id: str, seq: int, source: str) -> None:
        nonlocal added
        if text.strip():
            rows.append((text, agent_id, run_id, seq, source))
            added += len(text)
            if len(rows) >= _BATCH:
                conn.executemany(_INSERT, rows)
                rows.clear()

    # Reply text per open run, indexed when the run ends (runs follow one another
    # in a conversation, so this holds about one run's text at a time).
    replies: dict[str, tuple[int, list[str]]] = {}
    first_reply: dict[str, int] = {}
    events = conn.execute(
        "SELECT seq, run_id, kind, payload_json FROM events WHERE agent_id = ?"
        " AND kind IN ('RUN_STARTED', 'TEXT_DELTA', 'TOOL_CALL', 'TOOL_RESULT',"
        " 'RUN_FINISHED', 'RUN_ERROR') ORDER BY seq",
        (agent_id,),
    )
    for seq, run_id, kind, payload_json in events:
        if (
            kind == "TEXT_DELTA"
            and payload_json.startswith(_TEXT_OPEN)
            and payload_json.endswith('"}')
        ):
            try:
                text, end = _scan_string(payload_json, len(_TEXT_OPEN))
            except ValueError:
                pass  # json.loads says the same, below
            else:
                if end == len(payload_json) - 1:  # the closing brace follows
                    replies.setdefault(run_id, (seq, []))[1].append(text)
                    continue
        if kind in _TERMINAL:
            first, parts = replies.pop(run_id, (0, []))
            if parts:
                add("".join(parts), run_id, first, "reply")
                first_reply[run_id] = first
            continue
        try:
            payload: dict[str, Any] = json.loads(payload_json)
        except ValueError:
            # Only damage makes such a row (reads of it name it); its text is not
            # indexed, and the rest of the backlog is not held up by it.
            logger.warning("search index: event %d of agent %s is unreadable", seq, agent_id)
            continue
        if not isinstance(payload, dict):
            continue
        if kind == "TEXT_DELTA":
            replies.setdefault(run_id, (seq, []))[1].append(str(payload.get("text", "")))
        elif kind == "RUN_STARTED":
            add(str(payload.get("prompt", "")), run_id, seq, "prompt")
        elif kind == "TOOL_CALL":
            add(f"{payload.get('title', '')} {payload.get('input_json', '')}", run_id, seq, "tool")
        else:  # TOOL_RESULT
            add(str(payload.get("output", "")), run_id, seq, "tool")
    summaries = conn.execute(
        "SELECT run_id, text FROM summaries WHERE agent_id = ? ORDER BY run_id", (agent_id,)
    )
    for run_id, text in summaries.fetchall():
        add(str(text), run_id, first_reply.get(run_id, 0), "summary")
    if rows:
        conn.executemany(_INSERT, rows)
    return added


def index_next(conn: sqlite3.Connection, budget: int = 4 * 1024 * 1024) -> list[str]:
    """Index queued agents, first queued first, until about ``budget`` characters of
    text went in or the backlog is empty; take each off the backlog; return their ids.

    Call it in one write transaction: the search rows and the backlog rows'
    removal commit together (the commit point).
    """
    # An agent whose history is still packed is indexed once it is loaded.
    row = conn.execute(_NEXT).fetchone()
    if row is None:
        return []
    # FTS5 merges its index's segments as rows go in (automerge): for a bulk of
    # restored text that is about 30 % of the index's cost (bench/backup.py:
    # 200 MB indexed in 3.8 s of CPU without, 5.4 s with). The restore's
    # segments are left as written (crisismerge still bounds them per level:
    # searches measured as fast) and the setting is back before the commit, so
    # live writes merge as before; a rollback takes both changes back.
    automerge = _automerge(conn)
    _set_automerge(conn, 0)
    try:
        done = _index_from(conn, str(row[0]), budget)
    except BaseException:
        with contextlib.suppress(sqlite3.Error):  # rolled back with the rest
            _set_automerge(conn, automerge)
        raise
    _set_automerge(conn, automerge)
    return done


def _index_from(conn: sqlite3.Connection, agent_id: str, budget: int) -> list[str]:
    done: list[str] = []
    chars = 0
    while True:
        chars += index_agent(conn, agent_id)
        conn.execute("DELETE FROM search_backlog WHERE agent_id = ?", (agent_id,))
        done.append(agent_id)
        if chars >= budget:
            return done
        row = conn.execute(_NEXT).fetchone()
        if row is None:
            return done
        agent_id = str(row[0])


def _automerge(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT v FROM search_config WHERE k = 'automerge'").fetchone()
    return _AUTOMERGE if row is None else int(row[0])


def _set_automerge(conn: sqlite3.Connection, value: int) -> None:
    conn.execute("INSERT INTO search (search, rank) VALUES ('automerge', ?)", (value,))
