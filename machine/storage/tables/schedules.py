"""The schedules and schedule_runs tables."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable
from typing import Any, Final

from machine.formats.cron import readable_cron, validate_zone
from machine.models import ScheduleRecord, ScheduleRunRecord
from machine.storage.tables.rows import archive_field, archive_time, from_row
from shared.errors import InvalidArgument, NotFound
from shared.ids import is_valid_id

logger = logging.getLogger(__name__)

_ENABLED: Final = "enabled"
_PAUSED: Final = "paused"


def _row_to_schedule(row: sqlite3.Row) -> ScheduleRecord:
    return ScheduleRecord(
        id=row["id"],
        agent_id=row["agent_id"],
        cron=row["cron"],
        time_zone=row["time_zone"],
        prompt=row["prompt"],
        enabled=row["state"] == _ENABLED,
        missed=row["missed"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        last_fire=row["last_fire"],
    )


def insert_schedule(conn: sqlite3.Connection, s: ScheduleRecord) -> None:
    """Store a new schedule (or one brought back by a restore or an import)."""
    conn.execute(
        "INSERT INTO schedules (id, agent_id, cron, time_zone, prompt, state, missed,"
        " created_at, updated_at, last_fire) VALUES (?,?,?,?,?,?,?,?,?,?)",
        (
            s.id,
            s.agent_id,
            s.cron,
            s.time_zone,
            s.prompt,
            _ENABLED if s.enabled else _PAUSED,
            s.missed,
            s.created_at,
            s.updated_at,
            s.last_fire,
        ),
    )


def get_schedule(conn: sqlite3.Connection, schedule_id: str) -> ScheduleRecord:
    """One schedule; NotFound when missing."""
    row = conn.execute("SELECT * FROM schedules WHERE id = ?", (schedule_id,)).fetchone()
    if row is None:
        raise NotFound("schedule", schedule_id)
    return _row_to_schedule(row)


def list_schedules(conn: sqlite3.Connection, agent_id: str | None = None) -> list[ScheduleRecord]:
    """Schedules (of one agent, or all), oldest first."""
    if agent_id is None:
        rows = conn.execute("SELECT * FROM schedules ORDER BY created_at, id")
    else:
        rows = conn.execute(
            "SELECT * FROM schedules WHERE agent_id = ? ORDER BY created_at, id", (agent_id,)
        )
    return [_row_to_schedule(r) for r in rows]


def enabled_schedules(conn: sqlite3.Connection) -> list[ScheduleRecord]:
    """Enabled schedules of active agents: the ones that fire."""
    rows = conn.execute(
        "SELECT s.* FROM schedules s JOIN agents a ON a.id = s.agent_id"
        " WHERE s.state = ? AND a.state = 'active' ORDER BY s.created_at, s.id",
        (_ENABLED,),
    )
    return [_row_to_schedule(r) for r in rows]


def set_schedule_enabled(
    conn: sqlite3.Connection, schedule_id: str, enabled: bool, now: float, last_fire: float | None
) -> None:
    """Pause or resume; ``last_fire`` (when given) moves the schedule's planning point."""
    conn.execute(
        "UPDATE schedules SET state = ?, updated_at = ?, last_fire = COALESCE(?, last_fire)"
        " WHERE id = ?",
        (_ENABLED if enabled else _PAUSED, now, last_fire, schedule_id),
    )


def pause_agent_schedules(conn: sqlite3.Connection, agent_id: str, now: float) -> int:
    """Pause every enabled schedule of an agent (it is being archived); return how many."""
    cur = conn.execute(
        "UPDATE schedules SET state = ?, updated_at = ? WHERE agent_id = ? AND state = ?",
        (_PAUSED, now, agent_id, _ENABLED),
    )
    return cur.rowcount


def set_last_fire(conn: sqlite3.Connection, schedule_id: str, fire_time: float) -> None:
    """Record that fire times up to ``fire_time`` are handled (never moves back)."""
    conn.execute(
        "UPDATE schedules SET last_fire = MAX(COALESCE(last_fire, ?), ?) WHERE id = ?",
        (fire_time, fire_time, schedule_id),
    )


def delete_schedule(conn: sqlite3.Connection, schedule_id: str) -> None:
    """Delete a schedule and its schedule runs (their runs stay in the conversation)."""
    conn.execute("DELETE FROM schedule_runs WHERE schedule_id = ?", (schedule_id,))
    conn.execute("DELETE FROM schedules WHERE id = ?", (schedule_id,))


def delete_agent_schedules(conn: sqlite3.Connection, agent_id: str) -> int:
    """Delete an agent's schedules and their schedule runs; return how many schedules.

    For agent erasure: runs inside the caller's transaction, with the rest of
    the agent's rows (explicit, not left to ON DELETE CASCADE, so it holds
    even on a connection without foreign keys)."""
    conn.execute(
        "DELETE FROM schedule_runs WHERE schedule_id IN"
        " (SELECT id FROM schedules WHERE agent_id = ?)",
        (agent_id,),
    )
    return conn.execute("DELETE FROM schedules WHERE agent_id = ?", (agent_id,)).rowcount


def insert_schedule_run(conn: sqlite3.Connection, r: ScheduleRunRecord) -> None:
    """Record one fire; IntegrityError if that fire time is recorded already."""
    conn.execute(
        "INSERT INTO schedule_runs (schedule_id, fire_time, run_id, result, detail, recorded_at)"
        " VALUES (?,?,?,?,?,?)",
        (r.schedule_id, r.fire_time, r.run_id, r.result, r.detail, r.recorded_at),
    )


def schedule_run_at(
    conn: sqlite3.Connection, schedule_id: str, fire_time: float
) -> ScheduleRunRecord | None:
    """The fire recorded for ``fire_time``, or None."""
    row = conn.execute(
        "SELECT * FROM schedule_runs WHERE schedule_id = ? AND fire_time = ?",
        (schedule_id, fire_time),
    ).fetchone()
    return None if row is None else from_row(ScheduleRunRecord, row)


def list_schedule_runs(
    conn: sqlite3.Connection, schedule_id: str, limit: int
) -> list[ScheduleRunRecord]:
    """A schedule's fires, newest first."""
    rows = conn.execute(
        "SELECT * FROM schedule_runs WHERE schedule_id = ? ORDER BY fire_time DESC LIMIT ?",
        (schedule_id, limit),
    )
    return [from_row(ScheduleRunRecord, r) for r in rows]


def is_scheduled_run(conn: sqlite3.Connection, run_id: str) -> bool:
    """Whether ``run_id`` was made by a schedule's fire."""
    row = conn.execute("SELECT 1 FROM schedule_runs WHERE run_id = ?", (run_id,)).fetchone()
    return row is not None


def agent_schedule_rows(
    conn: sqlite3.Connection, agent_id: str
) -> tuple[list[ScheduleRecord], list[ScheduleRunRecord]]:
    """An agent's schedules and every one of their fires (for exports and backups)."""
    schedules = list_schedules(conn, agent_id)
    rows = conn.execute(
        "SELECT r.* FROM schedule_runs r JOIN schedules s ON s.id = r.schedule_id"
        " WHERE s.agent_id = ? ORDER BY r.schedule_id, r.fire_time",
        (agent_id,),
    )
    return schedules, [from_row(ScheduleRunRecord, r) for r in rows]


# -- exports and backups ------------------------------------------------------

_RESULTS: Final = ("fired", "caught_up", "refused")


def dump_schedules(conn: sqlite3.Connection, agent_id: str) -> list[dict[str, Any]]:
    """An agent's schedules as schedules.jsonl rows, each with its fires (oldest first)."""
    schedules, fires = agent_schedule_rows(conn, agent_id)
    by_schedule: dict[str, list[dict[str, Any]]] = {}
    for f in fires:
        by_schedule.setdefault(f.schedule_id, []).append(
            {
                "fire_time": f.fire_time,
                "run_id": f.run_id,
                "result": f.result,
                "detail": f.detail,
                "recorded_at": f.recorded_at,
            }
        )
    return [
        {
            "id": s.id,
            "cron": s.cron,
            "time_zone": s.time_zone,
            "prompt": s.prompt,
            "missed": s.missed,
            "enabled": s.enabled,
            "created_at": s.created_at,
            "updated_at": s.updated_at,
            "last_fire": s.last_fire,
            "runs": by_schedule.get(s.id, []),
        }
        for s in schedules
    ]


def load_schedules(
    conn: sqlite3.Connection, agent_id: str, rows: Iterable[dict[str, Any]], what: str
) -> int:
    """Insert schedules.jsonl rows for ``agent_id``, paused, in the caller's transaction
    (a restored or imported agent is archived, and never fires until a person resumes
    it). A schedule id already on this machine is skipped. Returns how many were loaded."""
    loaded = 0
    for n, row in enumerate(rows, 1):
        where = f"{what} line {n}"
        schedule_id = archive_field(row, "id", str, where)
        if not is_valid_id("schedule", schedule_id):
            raise InvalidArgument("archive", f"{where}: id malformed")
        try:
            # An older version's rule is kept (it comes back paused): see readable_cron.
            cron = readable_cron(archive_field(row, "cron", str, where))
            zone = archive_field(row, "time_zone", str, where)
            validate_zone(zone)
        except InvalidArgument as e:
            raise InvalidArgument("archive", f"{where}: {e.reason}") from None
        prompt = archive_field(row, "prompt", str, where)
        missed = archive_field(row, "missed", str, where)
        if missed not in ("skip", "once"):
            raise InvalidArgument("archive", f"{where}: missed must be skip or once")
        last_fire = row.get("last_fire")
        if last_fire is not None:
            last_fire = float(archive_time(row, "last_fire", where))
        runs = archive_field(row, "runs", list, where)
        if conn.execute("SELECT 1 FROM schedules WHERE id = ?", (schedule_id,)).fetchone():
            logger.info("%s: schedule %s is on this machine already; skipped", where, schedule_id)
            continue
        insert_schedule(
            conn,
            ScheduleRecord(
                id=schedule_id,
                agent_id=agent_id,
                cron=cron,
                time_zone=zone,
                prompt=prompt,
                enabled=False,
                missed=missed,
                created_at=float(archive_time(row, "created_at", where)),
                updated_at=float(archive_time(row, "updated_at", where)),
                last_fire=last_fire,
            ),
        )
        for i, fire in enumerate(runs):
            at = f"{where} runs[{i}]"
            if not isinstance(fire, dict):
                raise InvalidArgument("archive", f"{at}: not an object")
            run_id = archive_field(fire, "run_id", str, at)
            result = archive_field(fire, "result", str, at)
            if (run_id and not is_valid_id("run", run_id)) or result not in _RESULTS:
                raise InvalidArgument("archive", f"{at}: run_id or result malformed")
            try:
                insert_schedule_run(
                    conn,
                    ScheduleRunRecord(
                        schedule_id=schedule_id,
                        fire_time=float(archive_time(fire, "fire_time", at)),
                        run_id=run_id,
                        result=result,
                        detail=archive_field(fire, "detail", str, at),
                        recorded_at=float(archive_time(fire, "recorded_at", at)),
                    ),
                )
            except sqlite3.IntegrityError:
                raise InvalidArgument("archive", f"{at}: that fire time is listed twice") from None
        loaded += 1
    return loaded
