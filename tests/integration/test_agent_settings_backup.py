"""An acp agent (the fake ACP agent, kind claude) through `backup now` and a restore
on real daemon processes: its secret env values stay behind and are named, its
session files come back, `agent configure` sets the values again and it resumes."""

from __future__ import annotations

import contextlib
import gzip
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.machine_proc import MachineProc, run_cli

pytestmark = pytest.mark.integration

FAKE_AGENT = Path(__file__).resolve().parents[1] / "helpers" / "fake_acp_agent.py"
SECRET = "s3cr3t-value"


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result.stdout


def _fake_events(state: Path) -> list[dict[str, object]]:
    lines = (state / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_a_restored_acp_agent_gets_its_env_back_and_resumes_its_session(
    tmp_path: Path,
) -> None:
    data, claude, fake = tmp_path / "data", tmp_path / "claude", tmp_path / "fake"
    settings = {
        "command": [sys.executable, str(FAKE_AGENT), "--state-dir", str(fake)],
        "env": {"SECRET_X": SECRET, "FAKE_AGENT_TOKEN": SECRET},
        "kind": "claude",
    }
    proc = MachineProc(data, env={"CLAUDE_CONFIG_DIR": str(claude)})
    try:
        with proc:
            agent = _ok(
                run_cli(data, "agent", "create", "a", "--folder", str(tmp_path), "--runtime",
                        "acp", "--settings", json.dumps(settings))
            ).strip()  # fmt: skip
            _ok(run_cli(data, "agent", "prompt", agent, "first words"))
            sid = json.loads(_ok(run_cli(data, "--json", "agent", "show", agent)))["session_id"]
            # Where Claude Code keeps the transcript (the fake agent keeps its own).
            transcript = claude / "projects" / "-work" / f"{sid}.jsonl"
            transcript.parent.mkdir(parents=True)
            transcript.write_bytes(b'{"turn":1}\n')
            (claude / "session-env" / sid).mkdir(parents=True)
            (claude / "session-env" / sid / "env").write_text(f"SECRET_X={SECRET}")
            _ok(run_cli(data, "backup", "now"))
            export = tmp_path / "a.tar.gz"
            _ok(run_cli(data, "export", agent, "-o", str(export)))
        plain = gzip.decompress(export.read_bytes())
        assert SECRET.encode() not in plain and b'{"turn":1}' in plain
        # The machine loses the agent (not an erasure: nothing on the erased list)
        # and the CLI's files; its keys and backups stay.
        with contextlib.closing(sqlite3.connect(data / "machine.db")) as conn, conn:
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute("DELETE FROM search WHERE agent_id = ?", (agent,))
            conn.execute("DELETE FROM agents WHERE id = ?", (agent,))
        for path in sorted(claude.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        with proc:
            restored = _ok(run_cli(data, "backup", "restore"))
            (line,) = [x for x in restored.splitlines() if x.startswith(f"{agent}:")]
            assert line.startswith(
                f"{agent}: env FAKE_AGENT_TOKEN, env SECRET_X withheld; set them with `"
            )
            assert line.endswith(f" agent configure {agent} --settings …`")
            assert transcript.read_bytes() == b'{"turn":1}\n'
            assert not (claude / "session-env").exists()
            shown = json.loads(_ok(run_cli(data, "--json", "agent", "show", agent)))
            assert shown["session_id"] == sid
            assert json.loads(shown["settings_json"])["env"] == {}
            _ok(run_cli(data, "agent", "configure", agent, "--settings", "-",
                        stdin=json.dumps(settings)))  # fmt: skip
            _ok(run_cli(data, "agent", "unarchive", agent))
            out = _ok(run_cli(data, "agent", "prompt", agent, "second words"))
            assert "fake: second words" in out
            log = proc.log()
    finally:
        proc.kill()
    assert SECRET not in log
    events = _fake_events(fake)
    starts = [e for e in events if e["event"] == "initialize"]
    assert [e["has_token"] for e in starts] == [True, True]
    assert any(e["event"] == "load_session" and e["session_id"] == sid for e in events)
