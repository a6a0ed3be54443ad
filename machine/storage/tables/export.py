"""SQL that dumps agents to the export format and loads them back (store layer).

Dumping writes an agent's four export files (docs/formats/export.md) into a
folder from one read transaction, row by row, so memory stays flat whatever
the conversation's length. Loading inserts an agent and everything it holds
(conversation, search rows, summaries, tool log, attachment references, runs)
inside the caller's transaction: a restore or import of many agents commits
them all at once or none.

The record carries the agent's runtime settings only as its runtime made
them portable (the caller's ``portable`` hook, :data:`Portable`: an acp
agent's ``command`` and ``kind``, never its ``env`` values, whose names go in
``settings_withheld``) and its runtime session id. A load gives them back only
through the caller's ``settings_of`` hook (:data:`RecordSettings`), which
checks them with the runtime; without it (and for a record written before
they were kept) the agent loads with no settings and no session.

Never dumped: settings a runtime withholds, tokens, remembered permission rules.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from pathlib import Path
from typing import IO, Any, Final

from machine.formats.export import (
    MAX_LINE,
    SESSIONS,
    encode_jsonl,
    load_json,
    parse_jsonl_line,
    read_jsonl,
)
from machine.formats.media_types import check_media_type
from machine.models import AgentState, EventKind
from machine.storage.tables import search_backlog
from machine.storage.tables.rows import archive_field, archive_time, present
from machine.storage.tables.runs import RUN_FIELDS
from machine.storage.tables.schedules import dump_schedules, load_schedules
from shared.errors import InvalidArgument, NotFound
from shared.ids import is_valid_id
from shared.timestamps import MAX_SECONDS

__all__ = [
    "MAX_RECORD",
    "AgentDump",
    "Portable",
    "RecordSettings",
    "SessionFiles",
    "agent_markers",
    "agents_in_folder",
    "attachments_named",
    "attachments_of",
    "dump_agent",
    "dump_agent_to",
    "existing_agents",
    "AgentFiles",
    "OptionalFiles",
    "load_agent",
    "load_agent_files",
    "load_history",
    "marker_seq",
    "usage_rows_since",
    "insert_record",
    "parse_record",
    "set_attachment_size",
    "usage_by_run",
    "usage_rows",
]

logger = logging.getLogger(__name__)

_RUN_FIELDS: Final = RUN_FIELDS
_TERMINAL_STATE: Final = {"RUN_FINISHED": "finished", "RUN_ERROR": "failed"}
_EVENT_FIELDS: Final[tuple[tuple[str, type | tuple[type, ...]], ...]] = (
    ("seq", int),
    ("run_id", str),
    ("kind", str),
    ("payload", dict),
    ("time", (int, float)),
)
_INSERT_EVENT: Final = (
    "INSERT INTO events (agent_id, seq, run_id, kind, payload_json, time) VALUES (?,?,?,?,?,?)"
)
#: Events inserted per executemany.
_BATCH: Final = 500
#: A record.json is a few hundred bytes plus its attachment list.
MAX_RECORD: Final = 16 * 1024 * 1024
#: The largest sequence number SQLite stores (a signed 64-bit integer).
MAX_SEQ: Final = 2**63 - 1
# The payload as live appends store it (json.dumps(payload, sort_keys=True)); one
# encoder for all, since json.dumps builds a new one per call when given an option.
_PAYLOAD: Final = json.JSONEncoder(sort_keys=True)
# The body of a JSON string exactly as json.dumps (ensure_ascii) writes it: printable
# ASCII but the quote and backslash, their escapes and the short ones, and \u escapes
# only where json.dumps uses them (other control characters, DEL and non-ASCII),
# lowercase. Whatever it accepts decodes and encodes back to the same bytes.
_CANONICAL_STRING: Final = (
    rb'(?:[\x20\x21\x23-\x5b\x5d-\x7e]++|\\["\\bfnrt]'
    rb"|\\u(?:00(?:0[0-7bef]|1[0-9a-f]|7f|[89a-f][0-9a-f])|0[1-9a-f][0-9a-f]{2}|[1-9a-f][0-9a-f]{3}))*+"
)
# A text delta's conversation line as a dump writes it (most lines of a backup):
# its payload is taken as the bytes between the braces, already as a live append
# stores it, with no JSON decoding and encoding of the text. Any other line (and
# one this does not match: an id with escapes, a NaN time) goes the JSON way.
_TEXT_LINE: Final = re.compile(
    rb'\{"kind":"TEXT_DELTA","payload":(\{"text": "' + _CANONICAL_STRING + rb'"\}),'
    rb'"run_id":"([A-Za-z0-9_]{1,200})","seq":([1-9][0-9]{0,17}),'
    rb'"time":(-?(?:0|[1-9][0-9]{0,30})(\.[0-9]{1,30})?([eE][+-]?[0-9]{1,3})?)\}\n?'
)


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


def marker_seq(marker: str) -> int:
    """The last seq an :func:`agent_markers` marker was taken at (its first field)."""
    head = marker.partition(":")[0]
    return int(head) if head.isdigit() else 0


def existing_agents(conn: sqlite3.Connection, ids: Iterable[str]) -> set[str]:
    """Which of ``ids`` are agents on this machine already."""
    return present(conn, "agents", "id", ids)


def agents_in_folder(conn: sqlite3.Connection, folder: str) -> list[str]:
    """Ids of every agent (active or archived) working in ``folder``."""
    return [
        r[0] for r in conn.execute("SELECT id FROM agents WHERE folder = ? ORDER BY id", (folder,))
    ]


def attachments_named(conn: sqlite3.Connection) -> list[str]:
    """sha256 of every attachment some agent's conversation names."""
    return [r[0] for r in conn.execute("SELECT DISTINCT sha256 FROM attachment_refs ORDER BY 1")]


def attachments_of(conn: sqlite3.Connection, agent_ids: Iterable[str]) -> set[str]:
    """sha256 of every attachment the conversations of ``agent_ids`` name."""
    out: set[str] = set()
    for agent_id in agent_ids:
        rows = conn.execute("SELECT sha256 FROM attachment_refs WHERE agent_id = ?", (agent_id,))
        out.update(r[0] for r in rows)
    return out


def usage_rows(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """The usage and time history: one row per run (prompts are in the conversations)."""
    fields = [f for f in _RUN_FIELDS if f not in ("prompt", "attachments_json")]
    rows = conn.execute(f"SELECT {', '.join(fields)} FROM runs ORDER BY created_at, id")
    return [dict(zip(fields, tuple(r), strict=True)) for r in rows]


def usage_rows_since(
    conn: sqlite3.Connection, agent_id: str, since_seq: int
) -> list[dict[str, Any]]:
    """The usage rows (:func:`usage_rows`) of the runs of ``agent_id``'s events
    after ``since_seq``: those of a delta dumped from there."""
    fields = [f for f in _RUN_FIELDS if f not in ("prompt", "attachments_json")]
    rows = conn.execute(
        f"SELECT {', '.join(fields)} FROM runs WHERE id IN"
        " (SELECT DISTINCT run_id FROM events WHERE agent_id = ? AND seq > ?)"
        " ORDER BY created_at, id",
        (agent_id, since_seq),
    )
    return [dict(zip(fields, tuple(r), strict=True)) for r in rows]


AgentDump = dict[str, Any]
"""An agent's record.json as a dict."""

Portable = Callable[[str, Mapping[str, Any]], tuple[dict[str, Any], list[str]]]
"""``(runtime, settings) -> (kept, withheld)``: what of an agent's settings a
dump writes (``runtime_settings``) and the names of what it leaves out
(``settings_withheld``); the runtime registry's split, passed in by the caller."""

SessionFiles = Callable[[str, bytes], None]
"""``(agent_id, sessions.tar bytes)``: puts an agent's CLI session files back (the
caller's: they go under the runtimes' homes, not into machine.db)."""

RecordSettings = Callable[[Mapping[str, Any]], tuple[dict[str, Any], str | None]]
"""``record -> (settings, session_id)``: the settings and the runtime session an
agent loaded from its (checked) record gets, checked by the caller with its
runtime; it never raises for them (a bad one loads as ``({}, None)``)."""


def _lines(f: IO[bytes], rows: Iterator[dict[str, Any]]) -> None:
    batch: list[dict[str, Any]] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= 500:
            f.write(encode_jsonl(batch))
            batch.clear()
    f.write(encode_jsonl(batch))


def _conversation(f: IO[bytes], events: Iterable[Sequence[Any]]) -> None:
    """The conversation lines of ``events`` (seq, run_id, kind, payload_json, time rows):
    one line each, keys sorted, with the payload as stored.

    The stored payload is already JSON (json.dumps with sorted keys, as
    load_agent stores it again), so it is embedded as it is rather than
    decoded and encoded once more: the same bytes for half the work. Each run
    id and kind is encoded once: a backup writes a whole machine's
    conversations, and this is most of its Python work.
    """
    quoted: dict[str, str] = {}
    batch: list[bytes] = []
    for seq, run_id, kind, payload_json, time in events:
        qkind = quoted.get(kind) or quoted.setdefault(kind, json.dumps(kind))
        qrun = quoted.get(run_id) or quoted.setdefault(run_id, json.dumps(run_id))
        # json.dumps of a finite float is its repr; anything else goes through json.
        qtime = repr(time) if type(time) is float and math.isfinite(time) else json.dumps(time)
        batch.append(
            f'{{"kind":{qkind},"payload":{payload_json},'
            f'"run_id":{qrun},"seq":{int(seq)},"time":{qtime}}}\n'.encode()
        )
        if len(batch) >= _BATCH:
            f.write(b"".join(batch))
            batch.clear()
    f.write(b"".join(batch))


def dump_agent(
    conn: sqlite3.Connection, agent_id: str, folder: Path, *, portable: Portable
) -> AgentDump:
    """Write ``agent_id``'s export files into ``folder``; return its record.

    Call it inside one read job: every file then comes from one snapshot.
    """

    def open_file(name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return open(folder / name, "wb")

    return dump_agent_to(conn, agent_id, open_file, portable=portable)


def dump_agent_to(
    conn: sqlite3.Connection,
    agent_id: str,
    files: AgentFiles,
    *,
    portable: Portable,
    since_seq: int = 0,
) -> AgentDump:
    """Write ``agent_id``'s export files to ``files(name)`` (opened for writing, in
    :data:`AGENT_FILES` order); return its record. Call it inside one read job.

    With ``since_seq`` the files are a *delta* (a continuous backup's increment,
    docs/backups.md): the conversation holds only the events after that seq, and
    the summaries and tool log only the rows of the runs those events belong to,
    whole (a tool call started before and ended after is one row, its newest).
    The record and the schedules are whole: they are small, and a delta merged
    onto the agent's earlier files (:mod:`machine.formats.backup_delta`) then
    gives exactly what a whole dump at the same time gives. ``portable`` splits
    the agent's settings (:data:`Portable`): only the kept part is written.
    """
    if since_seq < 0:
        raise ValueError("since_seq is a sequence number: 0 or more")
    row = conn.execute("SELECT * FROM agents WHERE id = ?", (agent_id,)).fetchone()
    if row is None:
        raise NotFound("agent", agent_id)
    refs = conn.execute(
        "SELECT sha256, run_id, file_name, media_type, created_at FROM attachment_refs "
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
    kept, withheld = portable(row["runtime"], json.loads(row["settings_json"]))
    record["runtime_settings"] = kept
    record["settings_withheld"] = sorted(withheld)
    record["session_id"] = row["session_id"]
    with files("record.json") as f:
        f.write(
            json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        )
    events = conn.execute(
        "SELECT seq, run_id, kind, payload_json, time FROM events WHERE agent_id = ?"
        " AND seq > ? ORDER BY seq",
        (agent_id, since_seq),
    )
    with files("conversation.jsonl") as f:
        _conversation(f, events)
    # A delta's rows: those of the runs its events belong to (summaries and the
    # tool log are written in the transactions that append those events).
    runs = (
        " AND run_id IN (SELECT DISTINCT run_id FROM events WHERE agent_id = ? AND seq > ?)"
        if since_seq
        else ""
    )
    run_args: tuple[Any, ...] = (agent_id, since_seq) if since_seq else ()
    summaries = conn.execute(
        "SELECT run_id, text, created_at FROM summaries WHERE agent_id = ?"
        + runs
        + " ORDER BY run_id",
        (agent_id, *run_args),
    )
    with files("summaries.jsonl") as f:
        _lines(f, (dict(s) for s in summaries))
    tools = conn.execute(
        "SELECT run_id, call_id, title, tool_kind, input_json, status, output, started_at,"
        " ended_at FROM tool_log WHERE agent_id = ?" + runs + " ORDER BY id",
        (agent_id, *run_args),
    )
    with files("tools.jsonl") as f:
        _lines(f, (dict(t) for t in tools))
    schedules = dump_schedules(conn, agent_id)
    if schedules:  # optional file: an agent without schedules reads as before
        with files("schedules.jsonl") as f:
            _lines(f, iter(schedules))
    return record


def _check_record(record: dict[str, Any], where: str) -> None:
    agent_id = archive_field(record, "agent_id", str, where)
    if not is_valid_id("agent", agent_id):
        raise InvalidArgument("archive", f"{where}: agent_id malformed")
    for key in ("name", "folder", "runtime", "origin_machine"):
        archive_field(record, key, str, where)
    if not is_valid_id("machine", record["origin_machine"]):
        raise InvalidArgument("archive", f"{where}: origin_machine malformed")
    for key in ("created_at", "updated_at"):
        archive_time(record, key, where)
    if not 0 <= archive_field(record, "last_seq", int, where) <= MAX_SEQ:
        raise InvalidArgument("archive", f"{where}: last_seq out of range")
    if not isinstance(record.get("attachments", []), list):
        raise InvalidArgument("archive", f"{where}: attachments must be a list")


AgentFiles = Callable[[str], contextlib.AbstractContextManager[IO[bytes]]]
#: Opens an optional file (:data:`OPTIONAL_AGENT_FILES`) by name: None when absent.
OptionalFiles = Callable[[str], contextlib.AbstractContextManager[IO[bytes] | None]]
"""Opens one of an agent's export files by name, for reading (a load) or writing (a
dump) as the caller made it; called in :data:`AGENT_FILES` order."""


def usage_by_run(rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A backup's usage rows by run id (built once for a whole restore)."""
    return {str(u.get("id")): u for u in rows}


def _stored_payload(payload: dict[str, Any]) -> str:
    """The payload as a live append stores it: json.dumps(payload, sort_keys=True).

    Most events are text deltas, ``{"text": ...}``: those are written out
    directly (the same bytes), without an encoder's setup for each of them.
    """
    if len(payload) == 1:
        text = payload.get("text")
        if type(text) is str:
            return '{"text": ' + json.dumps(text) + "}"
    return _PAYLOAD.encode(payload)


_Event = tuple[str, int, str, str, str, float]


def load_agent(
    conn: sqlite3.Connection,
    folder: Path,
    *,
    runs: Mapping[str, dict[str, Any]] | Iterable[dict[str, Any]] = (),
    index: bool = True,
    not_from: frozenset[str] = frozenset(),
    settings_of: RecordSettings | None = None,
    sessions: SessionFiles | None = None,
) -> str:
    """Insert the agent dumped in ``folder`` (archived), in the caller's transaction.

    See :func:`load_agent_files`; returns the agent id.
    """

    def open_file(name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return open(folder / name, "rb")

    def open_optional(name: str) -> contextlib.AbstractContextManager[IO[bytes] | None]:
        path = folder / name
        return open(path, "rb") if path.is_file() else contextlib.nullcontext()

    if not isinstance(runs, Mapping):
        runs = usage_by_run(runs)
    return load_agent_files(
        conn,
        folder.name,
        open_file,
        optional=open_optional,
        runs=runs,
        index=index,
        not_from=not_from,
        settings_of=settings_of,
        sessions=sessions,
    )


def load_agent_files(
    conn: sqlite3.Connection,
    label: str,
    files: AgentFiles,
    *,
    runs: Mapping[str, dict[str, Any]],
    optional: OptionalFiles | None = None,
    index: bool = True,
    now: float = 0.0,
    not_from: frozenset[str] = frozenset(),
    settings_of: RecordSettings | None = None,
    sessions: SessionFiles | None = None,
) -> str:
    """Insert one agent's export files (archived), in the caller's transaction.

    ``files`` opens each file by name, in :data:`AGENT_FILES` order (a tar is
    read front to back), then ``optional`` each optional one (schedules,
    loaded paused); ``label`` names the agent in errors. ``runs`` are the
    backup's usage rows by run id; without them (an import) each run is rebuilt
    from its events with unknown usage. With ``index`` the conversation goes
    into the search index in this transaction; without, the agent is queued
    for the background indexer (:mod:`.search_backlog`), queued at ``now``.
    Anything malformed raises InvalidArgument naming the file and line, and
    the caller's transaction rolls back: nothing of the agent is kept. An agent
    whose origin is in ``not_from`` is refused (an import: an agent claiming to
    be this machine's own would run here once unarchived). ``settings_of``
    gives the agent its settings and session back (see :func:`insert_record`),
    ``sessions`` its CLI session files (without it they are read and dropped).
    """
    with files("record.json") as f:
        raw = f.read(MAX_RECORD + 1)
    record = parse_record(raw, label, not_from=not_from)
    agent_id = insert_record(conn, record, label, settings_of=settings_of)
    load_history(
        conn,
        agent_id,
        label,
        files,
        runs=runs,
        optional=optional,
        index=index,
        now=now,
        sessions=sessions,
    )
    return agent_id


def parse_record(
    raw: bytes, label: str, *, not_from: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """An agent's ``record.json`` read and checked (see :func:`load_agent_files`)."""
    where = f"{label}/record.json"
    if len(raw) > MAX_RECORD:
        raise InvalidArgument("archive", f"{where}: longer than {MAX_RECORD} bytes")
    record = load_json(raw, where)
    if not isinstance(record, dict):
        raise InvalidArgument("archive", f"{where}: not a JSON object")
    _check_record(record, where)
    if record["origin_machine"] in not_from:
        raise InvalidArgument(
            "archive",
            f"{where}: its origin is this machine; an import brings other machines' agents"
            " (restore a backup to bring this machine's own back)",
        )
    for ref in record.get("attachments", []):
        _check_attachment_ref(ref, where)
    return record


def insert_record(
    conn: sqlite3.Connection,
    record: dict[str, Any],
    label: str,
    *,
    settings_of: RecordSettings | None = None,
) -> str:
    """Insert an agent (archived) and its attachment references from its checked
    record (:func:`parse_record`), in the caller's transaction; return its id.

    ``last_seq`` is the record's until :func:`load_history` loads the conversation.
    Its settings and runtime session are what ``settings_of`` makes of the
    record (:data:`RecordSettings`); without it, none.
    """
    agent_id = str(record["agent_id"])
    settings, session_id = settings_of(record) if settings_of is not None else ({}, None)
    conn.execute(
        "INSERT INTO agents (id, name, folder, runtime, settings_json, state, origin_machine,"
        " session_id, created_at, updated_at, last_seq) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        (
            agent_id,
            record["name"],
            record["folder"],
            record["runtime"],
            json.dumps(settings, sort_keys=True),
            AgentState.ARCHIVED.value,
            record["origin_machine"],
            session_id,
            record["created_at"],
            record["updated_at"],
            record["last_seq"],
        ),
    )
    for ref in record.get("attachments", []):
        _insert_attachment_ref(conn, agent_id, ref, f"{label}/record.json")
    return agent_id


def load_history(
    conn: sqlite3.Connection,
    agent_id: str,
    label: str,
    files: AgentFiles,
    *,
    runs: Mapping[str, dict[str, Any]],
    optional: OptionalFiles | None = None,
    index: bool = True,
    now: float = 0.0,
    sessions: SessionFiles | None = None,
) -> None:
    """Insert the conversation, runs, summaries, tool log and schedules of
    ``agent_id`` (inserted by :func:`insert_record`) from its export files after
    ``record.json``, in the caller's transaction (see :func:`load_agent_files`);
    its ``sessions.tar`` goes to ``sessions`` (None: read and dropped)."""
    started: dict[str, dict[str, Any]] = {}
    ended: dict[str, tuple[str, dict[str, Any], float]] = {}
    last_seq = 0
    conv = f"{label}/conversation.jsonl"
    batch: list[_Event] = []
    kinds = EventKind.__members__
    with files("conversation.jsonl") as lines:
        for n, line in enumerate(iter(lambda: lines.readline(MAX_LINE + 1), b""), 1):
            text = _TEXT_LINE.fullmatch(line)
            if text is not None:
                payload_json, qrun, qseq, qtime, frac, exp = text.groups()
                text_seq = int(qseq)
                if text_seq <= last_seq or text_seq > MAX_SEQ:
                    raise InvalidArgument(
                        "archive", f"{conv} line {n}: bad kind or seq out of order"
                    )
                last_seq = text_seq
                # As json.loads reads the number: an int without fraction or exponent.
                text_time = float(qtime) if frac or exp else int(qtime)
                if not 0 <= text_time <= MAX_SECONDS:
                    archive_time({"time": text_time}, "time", f"{conv} line {n}")
                batch.append(
                    (
                        agent_id,
                        text_seq,
                        qrun.decode(),
                        "TEXT_DELTA",
                        payload_json.decode(),
                        text_time,
                    )
                )
                if len(batch) >= _BATCH:
                    conn.executemany(_INSERT_EVENT, batch)
                    batch.clear()
                continue
            ev = parse_jsonl_line(line, conv, n)
            seq: Any = ev.get("seq")
            run_id: Any = ev.get("run_id")
            kind: Any = ev.get("kind")
            payload: Any = ev.get("payload")
            time: Any = ev.get("time")
            # The checks of _need, inline (this loop runs once per event of the
            # whole backup); _need names the first bad field when one fails.
            if not (
                type(seq) is int
                and type(run_id) is str
                and type(kind) is str
                and type(payload) is dict
                and type(time) in (int, float)
                and 0 <= time <= MAX_SECONDS
            ):
                where = f"{conv} line {n}"
                for key, kinds_of in _EVENT_FIELDS:
                    archive_field(ev, key, kinds_of, where)
                archive_time(ev, "time", where)
            if kind not in kinds or seq <= last_seq or seq > MAX_SEQ:
                raise InvalidArgument("archive", f"{conv} line {n}: bad kind or seq out of order")
            last_seq = seq
            batch.append((agent_id, seq, run_id, kind, _stored_payload(payload), time))
            if len(batch) >= _BATCH:
                conn.executemany(_INSERT_EVENT, batch)
                batch.clear()
            if kind == "RUN_STARTED":
                started[run_id] = {**payload, "time": time}
            elif kind in _TERMINAL_STATE:
                ended[run_id] = (kind, payload, time)
    if batch:
        conn.executemany(_INSERT_EVENT, batch)
    conn.execute("UPDATE agents SET last_seq = ? WHERE id = ?", (last_seq, agent_id))
    _load_runs(conn, agent_id, started, ended, runs)
    # A summary or tool call names one of the agent's own runs (those its
    # conversation started or ended: a queued run cancelled before it started
    # has only its end): a run id of another agent would write into that
    # agent's rows (a summary replaces the run's).
    own = started.keys() | ended.keys()
    with files("summaries.jsonl") as f:
        for n, row in enumerate(read_jsonl(f, f"{label}/summaries"), 1):
            where = f"{label}/summaries.jsonl line {n}"
            _own_run(row, own, where)
            _insert_summary(conn, agent_id, row, where)
    with files("tools.jsonl") as f:
        what = f"{label}/tools.jsonl"
        for n, row in enumerate(read_jsonl(f, what), 1):
            _own_run(row, own, f"{what} line {n}")
            _insert_tool(conn, agent_id, row, f"{what} line {n}")
    if optional is not None:
        with optional("schedules.jsonl") as found:
            if found is not None:
                what = f"{label}/schedules.jsonl"
                load_schedules(conn, agent_id, read_jsonl(found, what), what)
        with optional(SESSIONS) as found:
            if found is not None:
                data = found.read()
                if sessions is not None:
                    sessions(agent_id, data)
    if index:
        search_backlog.index_agent(conn, agent_id)
    else:
        search_backlog.queue_for_index(conn, agent_id, now)


def _load_runs(
    conn: sqlite3.Connection,
    agent_id: str,
    started: dict[str, dict[str, Any]],
    ended: dict[str, tuple[str, dict[str, Any], float]],
    usage: Mapping[str, dict[str, Any]],
) -> None:
    # Runs the conversation started, then those it only ended (a queued run
    # cancelled before it started: no prompt in the conversation, never started).
    never_started = [r for r in ended if r not in started]
    for run_id in [*started, *never_started]:
        u = usage.get(run_id) or {}
        if u.get("agent_id") != agent_id:
            u = {}  # a usage row is another agent's: not this run's
        kind, end, finished = ended.get(run_id, ("RUN_ERROR", {}, None))
        start = started.get(run_id, {"time": finished})
        began = start["time"] if run_id in started else None
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
                u.get("started_at", began),
                u.get("finished_at", finished),
                int(u.get("input_tokens") or 0),
                int(u.get("output_tokens") or 0),
                int(u.get("duration_ms") or 0),
                u.get("stop_reason", end.get("stop_reason")),
                u.get("error_code", end.get("code")),
            ),
        )


def _own_run(row: dict[str, Any], own: Set[str], where: str) -> None:
    if archive_field(row, "run_id", str, where) not in own:
        raise InvalidArgument("archive", f"{where}: names a run its conversation does not start")


def _insert_summary(
    conn: sqlite3.Connection, agent_id: str, row: dict[str, Any], where: str
) -> None:
    conn.execute(
        "INSERT INTO summaries (run_id, agent_id, text, created_at) VALUES (?,?,?,?)"
        " ON CONFLICT (run_id) DO UPDATE SET text = excluded.text",
        (
            archive_field(row, "run_id", str, where),
            agent_id,
            archive_field(row, "text", str, where),
            archive_time(row, "created_at", where),
        ),
    )


def _insert_tool(conn: sqlite3.Connection, agent_id: str, row: dict[str, Any], where: str) -> None:
    conn.execute(
        "INSERT INTO tool_log (agent_id, run_id, call_id, title, tool_kind, input_json, status,"
        " output, started_at, ended_at) VALUES (?,?,?,?,?,?,?,?,?,?)"
        " ON CONFLICT (run_id, call_id) DO NOTHING",
        (
            agent_id,
            archive_field(row, "run_id", str, where),
            archive_field(row, "call_id", str, where),
            archive_field(row, "title", str, where),
            archive_field(row, "tool_kind", str, where),
            archive_field(row, "input_json", str, where),
            row.get("status"),
            row.get("output"),
            archive_time(row, "started_at", where),
            archive_time(row, "ended_at", where, optional=True),
        ),
    )


def _check_attachment_ref(ref: object, where: str) -> None:
    if not isinstance(ref, dict):
        raise InvalidArgument("archive", f"{where}: an attachment entry is not an object")
    sha = archive_field(ref, "sha256", str, where)
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise InvalidArgument("archive", f"{where}: attachment sha256 malformed")
    archive_time(ref, "created_at", where)


def _insert_attachment_ref(
    conn: sqlite3.Connection, agent_id: str, ref: dict[str, Any], where: str
) -> None:
    _check_attachment_ref(ref, where)
    sha = str(ref["sha256"])
    created = archive_time(ref, "created_at", where)
    conn.execute(
        "INSERT INTO attachments (sha256, size, created_at) VALUES (?, 0, ?)"
        " ON CONFLICT (sha256) DO NOTHING",
        (sha, created),
    )
    # Archives written before media types were kept have none: ''.
    media_type = ref.get("media_type", "")
    if media_type:
        check_media_type(str(media_type), "archive")
    conn.execute(
        "INSERT INTO attachment_refs"
        " (sha256, agent_id, run_id, file_name, media_type, created_at)"
        " VALUES (?,?,?,?,?,?) ON CONFLICT DO NOTHING",
        (
            sha,
            agent_id,
            str(ref.get("run_id", "")),
            str(ref.get("file_name", "")),
            str(media_type),
            created,
        ),
    )


def set_attachment_size(conn: sqlite3.Connection, sha256: str, size: int) -> None:
    """Record the size of an attachment file placed by a restore or an import."""
    conn.execute("UPDATE attachments SET size = ? WHERE sha256 = ?", (size, sha256))
