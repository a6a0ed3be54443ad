"""The runs table."""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Sequence
from typing import Any, Final

from machine.models import RunErrorCode, RunRecord, RunState
from shared.errors import NotFound

logger = logging.getLogger(__name__)

RUN_FIELDS: Final = (
    "id",
    "agent_id",
    "state",
    "prompt",
    "attachments_json",
    "created_at",
    # From here on, the columns set_run_state may change.
    "started_at",
    "finished_at",
    "input_tokens",
    "output_tokens",
    "duration_ms",
    "stop_reason",
    "error_code",
)
_FIRST_SETTABLE: Final = RUN_FIELDS.index("started_at")


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
        prompt_id=row["prompt_id"],
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
    allowed = {*RUN_FIELDS[_FIRST_SETTABLE:], "usage_reported"}
    cols = ["state = ?"]
    values: list[Any] = [state.value]
    for key, value in fields.items():
        if key not in allowed:
            raise ValueError(f"set_run_state: unknown column {key}")
        cols.append(f"{key} = ?")
        values.append(value)
    values.append(run_id)
    conn.execute(f"UPDATE runs SET {', '.join(cols)} WHERE id = ?", values)


def insert_run(
    conn: sqlite3.Connection,
    run_id: str,
    agent_id: str,
    prompt: str,
    attachments: Sequence[str],
    now: float,
    prompt_id: str | None = None,
) -> None:
    """Store a new queued run (usage not reported yet); ``prompt_id`` names the
    control-plane delivery it came from (unique)."""
    conn.execute(
        "INSERT INTO runs (id, agent_id, state, prompt, attachments_json, created_at,"
        " usage_reported, prompt_id) VALUES (?,?,?,?,?,?,0,?)",
        (
            run_id,
            agent_id,
            RunState.QUEUED.value,
            prompt,
            json.dumps(list(attachments)),
            now,
            prompt_id,
        ),
    )


def run_for_prompt(conn: sqlite3.Connection, prompt_id: str) -> RunRecord | None:
    """The run made from a delivered prompt, or None."""
    row = conn.execute("SELECT * FROM runs WHERE prompt_id = ?", (prompt_id,)).fetchone()
    return None if row is None else _row_to_run(row)


def count_open_runs(conn: sqlite3.Connection, agent_id: str) -> int:
    """How many of an agent's runs are queued, running or waiting."""
    open_states = tuple(s.value for s in RunState if s.open)
    marks = ",".join("?" for _ in open_states)
    row = conn.execute(
        f"SELECT COUNT(*) FROM runs WHERE agent_id = ? AND state IN ({marks})",
        (agent_id, *open_states),
    ).fetchone()
    return int(row[0])


def last_event_time(conn: sqlite3.Connection, run_id: str) -> float | None:
    """When the run stored its last event, or None if it stored none."""
    row = conn.execute("SELECT MAX(time) FROM events WHERE run_id = ?", (run_id,)).fetchone()
    return None if row[0] is None else float(row[0])
