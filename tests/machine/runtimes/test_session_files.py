"""machine.runtimes.session_files: which CLI session files travel, and how they
come back (paths checked, atomically, never over a file changed since)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from machine.runtimes import session_files
from machine.runtimes.session_files import (
    SessionHomes,
    capture_session_files,
    read_session_tar,
    restore_session_tar,
)
from shared.errors import InvalidArgument

SID = "0b7c4a52-5a7e-4a38-9c3e-2f1d7e0f9a11"
OTHER = "11111111-2222-4333-8444-555555555555"
CLAUDE = {"command": ["claude-code-acp"], "kind": "claude"}


def _claude_home(root: Path) -> Path:
    home = root / "claude"
    project = home / "projects" / "-srv-demo"
    (project / SID / "subagents").mkdir(parents=True)
    (project / f"{SID}.jsonl").write_bytes(b'{"n":1}\n{"n":2}\n{"half')
    (project / SID / "subagents" / "agent-a.jsonl").write_bytes(b'{"sub":1}\n')
    (project / f"{OTHER}.jsonl").write_bytes(b"another session\n")
    (home / "todos").mkdir()
    (home / "todos" / f"{SID}-agent-{SID}.json").write_bytes(b"[]")
    (home / "session-env" / SID).mkdir(parents=True)
    (home / "session-env" / SID / "env").write_bytes(b"ANTHROPIC_API_KEY=s3cr3t-value")
    (home / "debug").mkdir()
    (home / "debug" / f"{SID}.txt").write_bytes(b"debug log")
    outside = root / "outside.txt"
    outside.write_bytes(b"not the session's")
    (project / SID / "link.jsonl").symlink_to(outside)
    return home


def _capture(home: Path, **kw: object) -> tuple[bytes, session_files.SessionCapture]:
    out = io.BytesIO()
    got = capture_session_files(SessionHomes(claude=home), CLAUDE, SID, out, **kw)  # type: ignore[arg-type]
    return out.getvalue(), got


def test_only_the_sessions_own_regular_files_travel(tmp_path: Path) -> None:
    data, got = _capture(_claude_home(tmp_path))
    files = {name: body for name, body, _ in read_session_tar(data, "t")}
    assert sorted(files) == [
        f"claude/projects/-srv-demo/{SID}.jsonl",
        f"claude/projects/-srv-demo/{SID}/subagents/agent-a.jsonl",
        f"claude/todos/{SID}-agent-{SID}.json",
    ]
    # Cut after the last complete line: a run may be writing it.
    assert files[f"claude/projects/-srv-demo/{SID}.jsonl"] == b'{"n":1}\n{"n":2}\n'
    assert b"s3cr3t-value" not in data and b"debug log" not in data
    assert b"not the session's" not in data and b"another session" not in data
    assert got.files == 3 and set(got.hashes) == set(files)


def test_no_file_for_other_runtimes_or_without_a_session(tmp_path: Path) -> None:
    home = _claude_home(tmp_path)
    homes = SessionHomes(claude=home)
    for settings, sid in [({"delay_ms": 1}, SID), ({"kind": "generic"}, SID), (CLAUDE, None)]:
        out = io.BytesIO()
        capture_session_files(homes, settings, sid, out)
        assert out.getvalue() == b""
    out = io.BytesIO()
    capture_session_files(homes, CLAUDE, "../../etc", out)  # never put into a glob
    assert out.getvalue() == b""


def test_an_increment_carries_only_changed_files(tmp_path: Path) -> None:
    home = _claude_home(tmp_path)
    _, first = _capture(home)
    transcript = home / "projects" / "-srv-demo" / f"{SID}.jsonl"
    transcript.write_bytes(b'{"n":1}\n{"n":2}\n{"n":3}\n')
    data, second = _capture(home, known=first.hashes)
    assert [n for n, _, _ in read_session_tar(data, "t")] == [
        f"claude/projects/-srv-demo/{SID}.jsonl"
    ]
    assert second.files == 1 and len(second.hashes) == 3
    unchanged, _ = _capture(home, known=second.hashes)
    assert unchanged == b""


def test_over_the_cap_nothing_travels_and_it_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(session_files, "MAX_SESSION_BYTES", 10)
    data, got = _capture(_claude_home(tmp_path), label="ag_x")
    assert data == b"" and "over the 10-byte limit" in got.skipped
    assert [r.getMessage() for r in caplog.records if "ag_x" in r.getMessage()] == [
        f"agent ag_x: {got.skipped}"
    ]


def test_files_come_back_byte_equal_under_another_home(tmp_path: Path) -> None:
    data, _ = _capture(_claude_home(tmp_path / "old"))
    new = tmp_path / "new-claude"
    done = restore_session_tar(SessionHomes(claude=new), data, SID, "agent ag_x/sessions.tar")
    assert len(done.written) == 3 and not done.kept_newer
    for name, body, mtime in read_session_tar(data, "t"):
        path = new / name.removeprefix("claude/")
        assert path.read_bytes() == body
        assert path.stat().st_mtime == mtime
        assert path.stat().st_mode & 0o777 == 0o600
    again = restore_session_tar(SessionHomes(claude=new), data, SID, "t")
    assert again.written == () and len(again.unchanged) == 3


def test_a_file_changed_here_since_is_kept_and_named(tmp_path: Path) -> None:
    data, _ = _capture(_claude_home(tmp_path / "old"))
    new = tmp_path / "new"
    restore_session_tar(SessionHomes(claude=new), data, SID, "t")
    newer = new / "projects" / "-srv-demo" / f"{SID}.jsonl"
    newer.write_bytes(b"changed here after\n")
    older = new / "todos" / f"{SID}-agent-{SID}.json"
    older.write_bytes(b"older")
    os.utime(older, (1, 1))
    done = restore_session_tar(SessionHomes(claude=new), data, SID, "t")
    assert done.kept_newer == (f"claude/projects/-srv-demo/{SID}.jsonl",)
    assert newer.read_bytes() == b"changed here after\n"
    assert older.read_bytes() == b"[]"  # older than the copy: replaced


def _tar(*entries: tuple[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, body in entries:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


@pytest.mark.parametrize(
    "bad",
    [
        "claude/../../escape.txt",
        "claude/projects/../../../escape.txt",
        "/etc/escape.txt",
        "elsewhere/escape.txt",
        "claude/session-env/x/env",
        "claude/debug/x.txt",
        # Inside the home, but not a file of this session: never the CLI's own
        # settings (hooks run commands), nor another session's transcript.
        "claude/settings.json",
        f"claude/projects/p/{OTHER}.jsonl",
        f"claude/todos/{OTHER}-agent-x.json",
        "codex/config.toml",
    ],
)
def test_a_path_leaving_the_home_is_refused_naming_it_before_any_write(
    tmp_path: Path, bad: str
) -> None:
    home = tmp_path / "home" / "claude"
    data = _tar((f"claude/projects/p/{SID}.jsonl", b"ok\n"), (bad, b"x"))
    with pytest.raises(InvalidArgument) as err:
        restore_session_tar(SessionHomes(claude=home), data, SID, "agent ag_x/sessions.tar")
    assert "agent ag_x/sessions.tar" in str(err.value) and bad[:40] in str(err.value)
    assert not home.exists()
    assert not list(tmp_path.rglob("escape.txt"))


def test_a_link_on_the_way_is_never_followed(tmp_path: Path) -> None:
    home = tmp_path / "claude"
    home.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (home / "projects").symlink_to(elsewhere)
    data = _tar((f"claude/projects/p/{SID}.jsonl", b"x\n"))
    with pytest.raises(InvalidArgument, match="would go through a link"):
        restore_session_tar(SessionHomes(claude=home), data, SID, "t")
    assert list(elsewhere.iterdir()) == []
    (home / "projects").unlink()
    (home / "projects" / "p").mkdir(parents=True)
    (home / "projects" / "p" / f"{SID}.jsonl").symlink_to(elsewhere / "target")
    with pytest.raises(InvalidArgument, match="is a link or a folder here"):
        restore_session_tar(SessionHomes(claude=home), data, SID, "t")
    assert not (elsewhere / "target").exists()


def test_without_a_session_id_no_file_comes_back(tmp_path: Path) -> None:
    data = _tar((f"claude/projects/p/{SID}.jsonl", b"x\n"))
    for sid in (None, "not-a-uuid"):
        with pytest.raises(InvalidArgument, match="not a file of the agent's session"):
            restore_session_tar(SessionHomes(claude=tmp_path / "c"), data, sid, "t")
    assert not (tmp_path / "c").exists()


def test_a_cli_this_machine_has_no_home_for_is_skipped(tmp_path: Path) -> None:
    data = _tar((f"codex/sessions/2026/01/01/rollout-x-{SID}.jsonl", b"x\n"))
    done = restore_session_tar(SessionHomes(claude=tmp_path / "c"), data, SID, "t")
    assert done.written == ()
