"""SQL that dumps agents to the export format and loads them back (store layer).

Dumping writes an agent's four export files (docs/formats/export.md) into a
folder from one read transaction, row by row, so memory stays flat whatever
the conversation's length. Loading inserts an agent and everything it holds
(conversation, search rows, summaries, tool log, attachment references, runs)
inside the caller's transaction: a restore or import of many agents commits
them all at once or none.

Never dumped: the agent's settings (they may name MCP servers and carry
secrets), its runtime session id, tokens, remembered permission rules.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Final

from machine.export_format import encode_jsonl, read_jsonl
from machine.models import AgentState, EventKind
from machine.store.events import _index
from machine.store.runs import RUN_FIELDS
from machine.store.schedules import dump_schedules, load_schedules
from shared.errors import InvalidArgument
from shared.ids import is_valid_id

__all__ = [
    "AgentDump",
    "agent_markers",
    "agents_in_folder",
    "attachments_named",
    "dump_agent",
    "existing_agents",
    "load_agent",
    "set_attachment_size",
    "usage_rows",
]

logger = logging.getLogger(__name__)

_RUN_FIELDS: Final = RUN_FIELDS
_TERMINAL_STATE: Final = {"RUN_FINISHED": "finished", "RUN_ERROR": "failed"}


def agent_markers(conn: sqlite3.Connection) -> list[tuple[str, str]]:
    """(agent id, change marker) of every agent; the marker moves with any change."""
    rows = conn.execute(
        "SELECT id, last_seq, updated_at, name, state, (SELECT COUNT(*) || ':' ||"
        " COALESCE(MAX(s.updated_at), 0) || ':' || COALESCE(MAX(s.last_fire), 0)"
        " FROM schedules s WHERE s.agent_id = agents.id) AS schedules"
        " FROM agents ORDER BY id"
    )
    return [
        (
            r["id"],
            f"{r['last_seq']}:{r['updated_at']!r}:{r['state']}:{r['name']}"
            # Schedules are in the agent's segment: a change to them is a change.
            + ("" if r["schedules"] == "0:0:0" else f":{r['schedules']}"),
        )
        for r in rows
    ]


def existing_agents(conn: sqlite3.Connection, ids: Iterable[str]) -> set[str]:
    """Which of ``ids`` are agents on this machine already."""
    wanted = list(ids)
    found: set[str] = set()
    for i in range(0, len(wanted), 500):
        part = wanted[i : i + 500]
        marks = ",".join("?" * len(part))
        found |= {r[0] for r in conn.execute(f"SELECT id FROM agents WHERE id IN ({marks})", part)}
    return found


def agents_in_folder(conn: sqlite3.Connection, folder: str) -> list[str]:
    """Ids of every agent (active or archived) working in ``folder``."""
    return [
        r[0] for r in conn.execute("SELECT id FROM agents WHERE folder = ? ORDER BY id", (folder,))
    ]


def attachments_named(conn: sqlite3.Connection) -> list[str]:
    """sha256 of every attachment some agent's conversation names."""
    return [r[0] for r in conn.execute("SELECT DISTINCT sha256 FROM attachment_refs ORDER BY 1")]


def usage_rows(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """The usage and time history: one row per run (prompts are in the conversations)."""
    fields = [f for f in _RUN_FIELDS if f not in ("prompt", "attachments_json")]
    rows = conn.execute(f"SELECT {', '.join(fields)} FROM runs ORDER BY created_at, id")
    return [dict(zip(fields, tuple(r), strict=True)) for r in rows]


AgentDump = dict[str, Any]
"""An agent's record.json as a dict."""


def _lines(path: Path, rows: Iterator[dict[str, Any]]) -> None:
    with open(path, "wb") as f:
        batch: list[dict[str, Any]] = []
        for row in rows:
            batch.append(row)
            if len(batch) >= 500:
                f.write(encode_jsonl(batch))
                batch.clear()
        f.write(encode_jsonl(batch))


def _event_line(seq: int, run_id: str, kind: str, payload_json: str, time: float) -> bytes:
    """One conversation line, keys sorted, with the payload as stored.

    The stored payload is already JSON (json.dumps with sorted keys, as
    load_agent stores it again), so it is embedded as it is rather than
    decoded and encoded once more: the same bytes for half the work.
    """
    return (
        f'{{"kind":{json.dumps(kind)},"payload":{payload_json},'
        f'"run_id":{json.dumps(run_id)},"seq":{int(seq)},"time":{json.dumps(time)}}}\n'
    ).encode()


def dump_agent(conn: sqlite3.Connection, agent_id: str, folder: Path) -> AgentDump:
    """Write ``agent_id``'s export files into ``folder``; return its record.

    Call it inside one read job: every file then comes from one snapshot.
    """
    row = conn.execute("SELECT * FROM agents WHERE id = ?", (agent_id,)).fetchone()
    if row is None:
        raise InvalidArgument("agent_id", f"agent {agent_id} not found")
    refs = conn.execute(
        "SELECT sha256, run_id, file_name, created_at FROM attachment_refs "
        "WHERE agent_id = ? ORDER BY sha256, run_id",
        (agent_id,),
    )
    record: AgentDump = {
        "agent_id": row["id"],
        "name": row["name"],
        "folder": row["folder"],
        "runtime": row["runtime"],
        "state": row["state"],
        "origin_machine": row["origin_machine"],
        "created_at": row["created_at"],
        "updated_at": row["updated_at"],
        "last_seq": row["last_seq"],
        "attachments": [dict(r) for r in refs],
    }
    (folder / "record.json").write_bytes(
        json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    )
    events = conn.execute(
        "SELECT seq, run_id, kind, payload_json, time FROM events WHERE agent_id = ? ORDER BY seq",
        (agent_id,),
    )
    with open(folder / "conversation.jsonl", "wb") as f:
        for e in events:
            f.write(_event_line(e["seq"], e["run_id"], e["kind"], e["payload_json"], e["time"]))
    summaries = conn.execute(
        "SELECT run_id, text, created_at FROM summaries WHERE agent_id = ? ORDER BY run_id",
        (agent_id,),
    )
    _lines(folder / "summaries.jsonl", (dict(s) for s in summaries))
    tools = conn.execute(
        "SELECT run_id, call_id, title, tool_kind, input_json, status, output, started_at,"
        " ended_at FROM tool_log WHERE agent_id = ? ORDER BY id",
        (agent_id,),
    )
    _lines(folder / "tools.jsonl", (dict(t) for t in tools))
    schedules = dump_schedules(conn, agent_id)
    if schedules:  # optional file: an agent without schedules reads as before
        _lines(folder / "schedules.jsonl", iter(schedules))
    return record


def _need(row: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = row.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InvalidArgument("archive", f"{where}: {key} missing or of the wrong type")
    return value


def _check_record(record: dict[str, Any], where: str) -> None:
    agent_id = _need(record, "agent_id", str, where)
    if not is_valid_id("agent", agent_id):
        raise InvalidArgument("archive", f"{where}: agent_id malformed")
    for key in ("name", "folder", "runtime", "origin_machine"):
        _need(record, key, str, where)
    if not is_valid_id("machine", record["origin_machine"]):
        raise InvalidArgument("archive", f"{where}: origin_machine malformed")
    for key in ("created_at", "updated_at"):
        _need(record, key, (int, float), where)
    _need(record, "last_seq", int, where)
    if not isinstance(record.get("attachments", []), list):
        raise InvalidArgument("archive", f"{where}: attachments must be a list")


def load_agent(
    conn: sqlite3.Connection,
    folder: Path,
    *,
    runs: Iterable[dict[str, Any]] = (),
) -> str:
    """Insert the agent dumped in ``folder`` (archived), in the caller's transaction.

    ``runs`` are its usage rows from a backup; without them (an import) each
    run is rebuilt from its events with unknown usage. Returns the agent id.
    Anything malformed raises InvalidArgument naming the file and line, and
    the caller's transaction rolls back: nothing of the agent is kept.
    """
    where = f"{folder.name}/record.json"
    try:
        record = json.loads((folder / "record.json").read_bytes())
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgument("archive", f"{where}: not valid JSON") from None
    if not isinstance(record, dict):
        raise InvalidArgument("archive", f"{where}: not a JSON object")
    _check_record(record, where)
    agent_id = str(record["agent_id"])
    conn.execute(
        "INSERT INTO agents (id, name, folder, runtime, settings_json, state, origin_machine,"
        " session_id, created_at, updated_at, last_seq) VALUES (?,?,?,?,'{}',?,?,NULL,?,?,0)",
        (
            agent_id,
            record["name"],
            record["folder"],
            record["runtime"],
            AgentState.ARCHIVED.value,
            record["origin_machine"],
            record["created_at"],
            record["updated_at"],
        ),
    )
    started: dict[str, dict[str, Any]] = {}
    ended: dict[str, tuple[str, dict[str, Any], float]] = {}
    # Reply text per open run, indexed when the run ends (runs follow one another
    # in a conversation, so this holds about one run's text at a time).
    replies: dict[str, tuple[int, list[str]]] = {}
    first_reply: dict[str, int] = {}
    last_seq = 0
    conv = f"{folder.name}/conversation.jsonl"
    for n, ev in enumerate(read_jsonl(folder / "conversation.jsonl", conv), 1):
        seq = _need(ev, "seq", int, f"{conv} line {n}")
        run_id = _need(ev, "run_id", str, f"{conv} line {n}")
        kind = _need(ev, "kind", str, f"{conv} line {n}")
        payload = _need(ev, "payload", dict, f"{conv} line {n}")
        time = _need(ev, "time", (int, float), f"{conv} line {n}")
        if kind not in EventKind.__members__ or seq <= last_seq:
            raise InvalidArgument("archive", f"{conv} line {n}: bad kind or seq out of order")
        last_seq = seq
        conn.execute(
            "INSERT INTO events (agent_id, seq, run_id, kind, payload_json, time)"
            " VALUES (?,?,?,?,?,?)",
            (agent_id, seq, run_id, kind, json.dumps(payload, sort_keys=True), time),
        )
        if kind == "RUN_STARTED":
            started[run_id] = {**payload, "time": time}
            _index(conn, str(payload.get("prompt", "")), agent_id, run_id, seq, "prompt")
        elif kind == "TEXT_DELTA":
            replies.setdefault(run_id, (seq, []))[1].append(str(payload.get("text", "")))
        elif kind == "TOOL_CALL":
            text = f"{payload.get('title', '')} {payload.get('input_json', '')}"
            _index(conn, text, agent_id, run_id, seq, "tool")
        elif kind == "TOOL_RESULT":
            _index(conn, str(payload.get("output", "")), agent_id, run_id, seq, "tool")
        elif kind in _TERMINAL_STATE:
            ended[run_id] = (kind, payload, time)
            # The reply's search row, as the run's end made it on the first machine.
            first, parts = replies.pop(run_id, (0, []))
            if parts:
                _index(conn, "".join(parts), agent_id, run_id, first, "reply")
                first_reply[run_id] = first
    conn.execute("UPDATE agents SET last_seq = ? WHERE id = ?", (last_seq, agent_id))
    _load_runs(conn, agent_id, started, ended, list(runs))
    for n, row in enumerate(read_jsonl(folder / "summaries.jsonl", f"{folder.name}/summaries"), 1):
        where = f"{folder.name}/summaries.jsonl line {n}"
        _insert_summary(conn, agent_id, row, where)
        run_id = str(row["run_id"])
        _index(conn, str(row["text"]), agent_id, run_id, first_reply.get(run_id, 0), "summary")
    _load_rows(conn, agent_id, folder, "tools.jsonl", _insert_tool)
    for ref in record.get("attachments", []):
        _insert_attachment_ref(conn, agent_id, ref, where)
    if (folder / "schedules.jsonl").is_file():
        what = f"{folder.name}/schedules.jsonl"
        load_schedules(conn, agent_id, read_jsonl(folder / "schedules.jsonl", what), what)
    return agent_id


def _load_runs(
    conn: sqlite3.Connection,
    agent_id: str,
    started: dict[str, dict[str, Any]],
    ended: dict[str, tuple[str, dict[str, Any], float]],
    usage: list[dict[str, Any]],
) -> None:
    by_id = {u.get("id"): u for u in usage if u.get("agent_id") == agent_id}
    for run_id, start in started.items():
        u = by_id.get(run_id, {})
        kind, end, finished = ended.get(run_id, ("RUN_ERROR", {}, None))
        state = u.get("state") or _TERMINAL_STATE.get(kind, "interrupted")
        if state in ("queued", "running", "waiting_permission"):
            state = "interrupted"  # a restored run never resumes
        conn.execute(
            "INSERT INTO runs (id, agent_id, state, prompt, attachments_json, created_at,"
            " started_at, finished_at, input_tokens, output_tokens, duration_ms, stop_reason,"
            " error_code) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                run_id,
                agent_id,
                state,
                str(start.get("prompt", "")),
                json.dumps(start.get("attachments", [])),
                u.get("created_at", start["time"]),
                u.get("started_at", start["time"]),
                u.get("finished_at", finished),
                int(u.get("input_tokens") or 0),
                int(u.get("output_tokens") or 0),
                int(u.get("duration_ms") or 0),
                u.get("stop_reason", end.get("stop_reason")),
                u.get("error_code", end.get("code")),
            ),
        )


def _load_rows(
    conn: sqlite3.Connection,
    agent_id: str,
    folder: Path,
    name: str,
    insert: Any,
) -> None:
    what = f"{folder.name}/{name}"
    for n, row in enumerate(read_jsonl(folder / name, what), 1):
        insert(conn, agent_id, row, f"{what} line {n}")


def _insert_summary(
    conn: sqlite3.Connection, agent_id: str, row: dict[str, Any], where: str
) -> None:
    conn.execute(
        "INSERT INTO summaries (run_id, agent_id, text, created_at) VALUES (?,?,?,?)"
        " ON CONFLICT (run_id) DO UPDATE SET text = excluded.text",
        (
            _need(row, "run_id", str, where),
            agent_id,
            _need(row, "text", str, where),
            _need(row, "created_at", (int, float), where),
        ),
    )


def _insert_tool(conn: sqlite3.Connection, agent_id: str, row: dict[str, Any], where: str) -> None:
    conn.execute(
        "INSERT INTO tool_log (agent_id, run_id, call_id, title, tool_kind, input_json, status,"
        " output, started_at, ended_at) VALUES (?,?,?,?,?,?,?,?,?,?)"
        " ON CONFLICT (run_id, call_id) DO NOTHING",
        (
            agent_id,
            _need(row, "run_id", str, where),
            _need(row, "call_id", str, where),
            _need(row, "title", str, where),
            _need(row, "tool_kind", str, where),
            _need(row, "input_json", str, where),
            row.get("status"),
            row.get("output"),
            _need(row, "started_at", (int, float), where),
            row.get("ended_at"),
        ),
    )


def _insert_attachment_ref(
    conn: sqlite3.Connection, agent_id: str, ref: object, where: str
) -> None:
    if not isinstance(ref, dict):
        raise InvalidArgument("archive", f"{where}: an attachment entry is not an object")
    sha = _need(ref, "sha256", str, where)
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise InvalidArgument("archive", f"{where}: attachment sha256 malformed")
    created = _need(ref, "created_at", (int, float), where)
    conn.execute(
        "INSERT INTO attachments (sha256, size, created_at) VALUES (?, 0, ?)"
        " ON CONFLICT (sha256) DO NOTHING",
        (sha, created),
    )
    conn.execute(
        "INSERT INTO attachment_refs (sha256, agent_id, run_id, file_name, created_at)"
        " VALUES (?,?,?,?,?) ON CONFLICT DO NOTHING",
        (sha, agent_id, str(ref.get("run_id", "")), str(ref.get("file_name", "")), created),
    )


def set_attachment_size(conn: sqlite3.Connection, sha256: str, size: int) -> None:
    """Record the size of an attachment file placed by a restore or an import."""
    conn.execute("UPDATE attachments SET size = ? WHERE sha256 = ?", (size, sha256))
