"""``agents-control serve --log-level/--log-format``: a bad value is a usage error."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.cli.main import main


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--log-format", "xml"], "argument --log-format: invalid choice: 'xml'"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    ],
)
def test_a_bad_flag_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], said: str
) -> None:
    assert main(["serve", "--home", str(tmp_path), *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert said in err.splitlines()[0] and "Traceback" not in err


def test_a_bad_environment_value_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTS_CONTROL_LOG_FORMAT", "xml")
    assert main(["serve", "--home", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "log_format: bad value from $AGENTS_CONTROL_LOG_FORMAT" in err
    assert "Traceback" not in err
