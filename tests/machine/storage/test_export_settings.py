"""An agent's runtime settings and session in its record.json: kept without secrets
by a dump, given back through the runtime by a load, old records load as before."""

from __future__ import annotations

import contextlib
import io
import json
import sqlite3
from typing import IO, Any

import pytest

from machine.core.agents import ArrivingSettings, SettingsNote, portable_settings
from machine.models import AgentRecord, AgentState
from machine.storage.schema import migrate
from machine.storage.tables import insert_agent
from machine.storage.tables.export import dump_agent_to, load_agent_files
from shared.ids import new_id

UUID = "0b7c4a52-5a7e-4a38-9c3e-2f1d7e0f9a11"
SECRET = "s3cr3t-value"


def _db() -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    conn.row_factory = sqlite3.Row
    migrate(conn)
    return conn


def _agent(
    conn: sqlite3.Connection, runtime: str, settings: dict[str, Any], session: str | None
) -> str:
    agent = AgentRecord(
        id=new_id("agent"),
        name="a",
        folder="/srv",
        runtime=runtime,
        settings=settings,
        state=AgentState.ACTIVE,
        origin_machine=new_id("machine"),
        local=True,
        session_id=session,
        created_at=1.0,
        updated_at=1.0,
        last_seq=0,
    )
    insert_agent(conn, agent)
    return agent.id


def _dump(conn: sqlite3.Connection, agent_id: str) -> dict[str, bytes]:
    out: dict[str, io.BytesIO] = {}

    def open_file(name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        out[name] = io.BytesIO()
        return contextlib.nullcontext(out[name])

    dump_agent_to(conn, agent_id, open_file, portable=portable_settings)
    return {name: f.getvalue() for name, f in out.items()}


def _load(files: dict[str, bytes], arriving: ArrivingSettings) -> sqlite3.Row:
    conn = _db()
    conn.execute("BEGIN")
    agent_id = load_agent_files(
        conn, "ag", lambda n: io.BytesIO(files[n]), runs={}, settings_of=arriving
    )
    conn.execute("COMMIT")
    return conn.execute("SELECT * FROM agents WHERE id = ?", (agent_id,)).fetchone()


ACP = {"command": ["fake-acp", "--x"], "env": {"SECRET_X": SECRET, "OTHER": "v"}, "kind": "claude"}


def test_an_acp_agent_round_trips_without_its_env_values() -> None:
    conn = _db()
    agent_id = _agent(conn, "acp", ACP, UUID)
    files = _dump(conn, agent_id)
    assert not any(SECRET.encode() in data for data in files.values())
    record = json.loads(files["record.json"])
    assert record["runtime_settings"] == {"command": ["fake-acp", "--x"], "kind": "claude"}
    assert record["settings_withheld"] == ["env.OTHER", "env.SECRET_X"]
    assert record["session_id"] == UUID

    arriving = ArrivingSettings()
    row = _load(files, arriving)
    assert json.loads(row["settings_json"]) == {
        "command": ["fake-acp", "--x"],
        "env": {},
        "kind": "claude",
    }
    assert row["session_id"] == UUID
    assert row["state"] == "archived"
    assert arriving.notes([agent_id]) == (SettingsNote(agent_id, ("env.OTHER", "env.SECRET_X")),)


def test_an_echo_agent_round_trips_whole_with_no_note() -> None:
    conn = _db()
    agent_id = _agent(conn, "echo", {"delay_ms": 5}, f"echo-{'x' * 10}")
    arriving = ArrivingSettings()
    row = _load(_dump(conn, agent_id), arriving)
    assert json.loads(row["settings_json"]) == {"delay_ms": 5}
    assert row["session_id"] == f"echo-{'x' * 10}"
    assert arriving.notes([agent_id]) == ()


def _edited(runtime: str, **fields: Any) -> tuple[str, dict[str, bytes]]:
    conn = _db()
    agent_id = _agent(conn, runtime, ACP if runtime == "acp" else {}, None)
    files = _dump(conn, agent_id)
    record = json.loads(files["record.json"])
    record["runtime"] = runtime
    for key, value in fields.items():
        if value is ...:
            record.pop(key)
        else:
            record[key] = value
    return agent_id, {**files, "record.json": json.dumps(record).encode()}


@pytest.mark.parametrize("runtime", ["echo", "acp"])
def test_a_record_written_before_settings_travelled_loads_as_before(runtime: str) -> None:
    agent_id, files = _edited(runtime, runtime_settings=..., settings_withheld=..., session_id=...)
    arriving = ArrivingSettings()
    row = _load(files, arriving)
    assert json.loads(row["settings_json"]) == {}
    assert row["session_id"] is None
    notes = arriving.notes([agent_id])
    if runtime == "echo":
        assert notes == ()  # it runs without settings: nothing to say
    else:
        assert notes == (SettingsNote(agent_id, (), "its archive keeps no settings"),)


@pytest.mark.parametrize(
    ("runtime", "kept", "reason"),
    [
        ("acp", {"command": 5}, "command"),
        ("acp", {"command": ["x"], "env": {"K": "v"}, "kind": "claude", "extra": 1}, "extra"),
        ("acp", ["not", "a", "map"], "not a JSON object"),
        ("echo", {"delay_ms": "slow"}, "delay_ms"),
        ("martian", {}, "unknown runtime 'martian'"),
    ],
)
def test_settings_the_runtime_refuses_load_as_none_and_are_named(
    runtime: str, kept: Any, reason: str
) -> None:
    agent_id, files = _edited(runtime, runtime_settings=kept)
    arriving = ArrivingSettings()
    row = _load(files, arriving)  # the agent still comes in
    assert json.loads(row["settings_json"]) == {}
    (note,) = arriving.notes([agent_id])
    assert note.problem.startswith("its settings were not restored")
    assert reason in note.problem


@pytest.mark.parametrize("session", ["../../x", "not-a-uuid", 12, "a" * 300])
def test_a_session_id_the_runtime_could_not_hold_is_dropped(session: Any) -> None:
    _, files = _edited("acp", session_id=session)
    row = _load(files, ArrivingSettings())
    assert row["session_id"] is None
    assert json.loads(row["settings_json"])["command"] == ["fake-acp", "--x"]


def test_withheld_names_that_are_not_names_are_left_out() -> None:
    agent_id, files = _edited("acp", settings_withheld=["env.A", 5, "x\n", "env.A", "z" * 300])
    arriving = ArrivingSettings()
    _load(files, arriving)
    assert arriving.notes([agent_id])[0].withheld == ("env.A",)
