"""machine.store.export.load_agent_files: the fast event loop still names what is wrong."""

from __future__ import annotations

import io
import json
import sqlite3

import pytest

from machine.schema import migrate
from machine.store.export import load_agent_files
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
