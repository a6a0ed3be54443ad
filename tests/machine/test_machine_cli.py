"""CLI behaviour that needs no daemon: usage errors and a stopped daemon."""

from __future__ import annotations

from pathlib import Path

import pytest

from machine.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_missing_command_is_usage(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "--data-dir", str(tmp_path))
    assert code == 2
    assert err.splitlines()[0] == "agents-machine: missing command"
    assert err.splitlines()[1].startswith("Try: ")


def test_unknown_verb_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "--data-dir", str(tmp_path), "agent", "explode")
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 2 and "invalid choice" in lines[0] and lines[1].startswith("Try:")


def test_daemon_not_running(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "--data-dir", str(tmp_path), "agent", "list")
    assert code == 1
    assert "the machine daemon is not running" in err.splitlines()[0]


def test_bad_config_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "--data-dir", str(tmp_path), "serve", "--tcp", "0.0.0.0:1")
    assert code == 2
    assert err.splitlines()[0].startswith("agents-machine: config tcp_address:")
