"""``backup restore --at TIME`` and increment ids on the command line (no daemon)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from machine.cli.common import parse_when
from machine.cli.main import main
from shared.cli import UsageError
from shared.ids import new_id


def test_times_in_rfc_3339_or_as_listings_show_them() -> None:
    assert parse_when("2026-12-05T09:41:20Z") == 1796463680.0
    assert parse_when("2026-12-05T10:41:20+01:00") == 1796463680.0
    local = dt.datetime(2026, 12, 5, 9, 41).astimezone().timestamp()
    assert parse_when("2026-12-05 09:41") == local
    with pytest.raises(UsageError, match="--at: 'yesterday' is not a time"):
        parse_when("yesterday")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("backup", "restore", "--at", "soon"), "--at: 'soon' is not a time"),
        (
            ("backup", "restore", new_id("increment"), "--at", "2026-12-05T09:41:20Z"),
            "give a backup ID or --at TIME, not both",
        ),
        (("backup", "verify", "bki_../x"), "invalid backup id"),
    ],
)
def test_usage_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: tuple[str, ...], says: str
) -> None:
    code = main(["--data-dir", str(tmp_path), *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and says in err.splitlines()[0], err
    assert "Traceback" not in err


def test_an_increment_id_passes_the_check(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Past the id check, the daemon is dialled: not running here.
    code = main(["--data-dir", str(tmp_path), "backup", "verify", new_id("increment")])
    _, err = capsys.readouterr()
    assert code == 1 and "daemon is not running" in err
