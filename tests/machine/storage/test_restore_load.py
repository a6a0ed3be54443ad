"""machine.storage.tables.export.load_agent_files: the fast event loop still names what is wrong."""

from __future__ import annotations

import io
import json
import sqlite3

import pytest

from machine.storage.schema import migrate
from machine.storage.tables.export import load_agent_files
from shared.errors import InvalidArgument
from shared.ids import new_id


def _files(conversation: bytes) -> dict[str, bytes]:
    record = {
        "agent_id": new_id("agent"),
        "name": "a",
        "folder": "/srv",
        "runtime": "echo",
        "state": "archived",
        "origin_machine": new_id("machine"),
        "created_at": 1.0,
        "updated_at": 1.0,
        "last_seq": 1,
        "attachments": [],
    }
    return {
        "record.json": json.dumps(record).encode(),
        "conversation.jsonl": conversation,
        "summaries.jsonl": b"",
        "tools.jsonl": b"",
    }


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (b'{"kind":"TEXT_DELTA","payload":{},"run_id":"r","seq":"1","time":1.0}', "seq missing"),
        (b'{"kind":"TEXT_DELTA","payload":{},"run_id":"r","seq":true,"time":1.0}', "seq missing"),
        (b'{"kind":"TEXT_DELTA","payload":[],"run_id":"r","seq":1,"time":1.0}', "payload missing"),
        (b'{"kind":"TEXT_DELTA","payload":{},"run_id":"r","seq":1}', "time missing"),
        (b'{"kind":"NOPE","payload":{},"run_id":"r","seq":1,"time":1.0}', "bad kind"),
        (b'{"kind":"TEXT_DELTA","payload":{},"run_id":"r","seq":1,"time":1', "not valid JSON"),
        # Python's json reads these tokens; JSON has none of them (a NaN time reached
        # the NOT NULL column as a raw sqlite3.IntegrityError).
        (b'{"kind":"TEXT_DELTA","payload":{},"run_id":"r","seq":1,"time":NaN}', "not valid JSON"),
        (b'{"kind":"TEXT_DELTA","payload":{},"run_id":"r","seq":1,"time":-Infinity}', "not valid"),
        (b'{"kind":"TEXT_DELTA","payload":{"x":Infinity},"run_id":"r","seq":1,"time":1}', "not"),
        # Numbers that read as infinity, or past the year 9999, or before 1970: no
        # listing or replay could show them (a Timestamp carries none of them).
        (
            b'{"kind":"TEXT_DELTA","payload":{"text": "x"},"run_id":"r","seq":1,"time":1.0e400}',
            "time is not a time",
        ),
        (
            b'{"kind":"TEXT_DELTA","payload":{"text": "x"},"run_id":"r","seq":1,"time":1e12}',
            "time is not a time",
        ),
        (
            b'{"kind":"TEXT_DELTA","payload":{"text": "x"},"run_id":"r","seq":1,"time":-1}',
            "time is not a time",
        ),
        (
            b'{"kind":"RUN_STARTED","payload":{"prompt":"p"},"run_id":"r","seq":1,"time":1e400}',
            "time is not a time",
        ),
        (
            b'{"kind":"TEXT_DELTA","payload":' + b"[" * 100_000 + b"]" * 100_000 + b',"seq":1}',
            "nested too deeply",
        ),
    ],
)
def test_a_malformed_event_line_is_refused_naming_it(line: bytes, problem: str) -> None:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    migrate(conn)
    files = _files(line + b"\n")
    conn.execute("BEGIN")
    with pytest.raises(InvalidArgument, match=f"conversation.jsonl line 1: {problem}"):
        load_agent_files(conn, "ag", lambda n: io.BytesIO(files[n]), runs={})
    conn.execute("ROLLBACK")
    assert conn.execute("SELECT COUNT(*) FROM agents").fetchone()[0] == 0


def _load(conversation: bytes) -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    migrate(conn)
    files = _files(conversation)
    conn.execute("BEGIN")
    load_agent_files(conn, "ag", lambda n: io.BytesIO(files[n]), runs={})
    conn.execute("COMMIT")
    return conn


# Texts whose canonical encoding uses every kind of escape json.dumps writes.
_TEXTS = [
    "plain words",
    "",
    'quote " backslash \\ slash /',
    "line\nfeed\ttab\rreturn\bback\fform",
    "\x00\x01\x0b\x1f\x7f control",
    "é ü ß \u0100 \u0fff \u1234 \uffff",
    "astral 😀 𝄞",
    "lone \ud800 surrogate",
]
# Lines a dump does not write (non-canonical escapes, odd numbers): the loader must
# store exactly what decoding and encoding them gives, as before.
_ODD_LINES = [
    b'{"kind":"TEXT_DELTA","payload":{"text": "\\u0041"},"run_id":"r","seq":1,"time":1}',
    b'{"kind":"TEXT_DELTA","payload":{"text": "a\\/b"},"run_id":"r","seq":1,"time":1}',
    b'{"kind":"TEXT_DELTA","payload":{"text": "\\u00E9"},"run_id":"r","seq":1,"time":1e3}',
    b'{"kind":"TEXT_DELTA","payload":{"text": "\\u000a"},"run_id":"r","seq":1,"time":-0}',
    b'{"kind":"TEXT_DELTA","payload":{"text":"compact"},"run_id":"r","seq":1,"time":2.5}',
    b'{"kind":"TEXT_DELTA","payload":{"text": "x", "more": 1},"run_id":"r","seq":1,"time":1}',
    b'{"kind":"TEXT_DELTA","payload":{"text": "x"},"run_id":"r\\u0031","seq":1,"time":1}',
    b'{"kind":"TEXT_DELTA","payload":{"text": "\xc3\xa9 raw utf-8"},"run_id":"r","seq":1,"time":1}',
]


def _expected(line: bytes) -> tuple[str, str, int, float]:
    ev = json.loads(line)
    return json.dumps(ev["payload"], sort_keys=True), ev["run_id"], ev["seq"], float(ev["time"])


@pytest.mark.parametrize(
    "line",
    [
        *(
            b'{"kind":"TEXT_DELTA","payload":'
            + json.dumps({"text": text}, sort_keys=True).encode()
            + b',"run_id":"run_1","seq":7,"time":'
            + when.encode()
            + b"}"
            for text in _TEXTS
            for when in ("1764616000.125", "17", "1e+9", "2.5E-3")
        ),
        *_ODD_LINES,
    ],
)
def test_a_text_line_is_stored_as_decoding_and_encoding_it_would(line: bytes) -> None:
    # Text deltas skip JSON decoding when they are as a dump writes them: whatever
    # the line, the stored row must be the one the JSON way gives.
    conn = _load(line + b"\n")
    row = conn.execute("SELECT payload_json, run_id, seq, time FROM events").fetchone()
    payload, run_id, seq, when = _expected(line)
    assert tuple(row) == (payload, run_id, seq, when)


def test_text_lines_out_of_order_are_refused() -> None:
    line = b'{"kind":"TEXT_DELTA","payload":{"text": "x"},"run_id":"r","seq":%d,"time":1.5}\n'
    with pytest.raises(InvalidArgument, match="conversation.jsonl line 2: bad kind or seq out"):
        _load(line % 2 + line % 2)
    with pytest.raises(InvalidArgument, match="conversation.jsonl line 2: bad kind or seq out"):
        _load(line % 3 + line % 1)


@pytest.mark.parametrize(
    ("name", "body", "problem"),
    [
        ("record.json", b'{"created_at": 1e400}', "created_at is not a time"),
        ("record.json", b'{"updated_at": 1e12}', "updated_at is not a time"),
        ("record.json", b"[" * 100_000 + b"]" * 100_000, "record.json: nested too deeply"),
        ("summaries.jsonl", b'{"run_id":"r","text":"s","created_at":1e400}\n', "created_at is not"),
        ("tools.jsonl", b'{"started_at":1e400}\n', "started_at is not a time"),
        (
            "tools.jsonl",
            b'{"started_at":1,"ended_at":"soon"}\n',
            "ended_at missing or of the wrong",
        ),
        ("tools.jsonl", b'{"started_at":1,"ended_at":1e400}\n', "ended_at is not a time"),
        ("tools.jsonl", b'{"a":' + b"[" * 50_000 + b"]" * 50_000 + b"}\n", "nested too deeply"),
    ],
)
def test_times_out_of_range_and_deep_nesting_are_refused_naming_them(
    name: str, body: bytes, problem: str
) -> None:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    migrate(conn)
    line = b'{"kind":"RUN_STARTED","payload":{"prompt":"p"},"run_id":"r","seq":1,"time":1}\n'
    files = _files(line)
    # Merged as text: json.loads would read 1e400 as infinity, which json.dumps
    # writes as Infinity (refused as not JSON before the time is looked at).
    if name == "record.json" and body.startswith(b"{"):
        files[name] = files[name][:-1] + b", " + body[1:]
    elif name == "tools.jsonl" and body.startswith(b'{"started'):
        tool = {"run_id": "r", "call_id": "c", "title": "t", "tool_kind": "k", "input_json": "{}"}
        files[name] = json.dumps(tool).encode()[:-1] + b", " + body[1:]
    else:
        files[name] = body
    conn.execute("BEGIN")
    with pytest.raises(InvalidArgument, match=problem):
        load_agent_files(conn, "ag", lambda n: io.BytesIO(files[n]), runs={})
    conn.execute("ROLLBACK")
    assert conn.execute("SELECT COUNT(*) FROM agents").fetchone()[0] == 0
