"""The systemd unit written by ``join --install-service`` (into a temp folder only)."""

from __future__ import annotations

import shlex
import stat
import sys
from pathlib import Path

import pytest

from machine.cli.service_unit import UNIT_NAME, install_service, render_unit
from machine.config import SERVICE_METRICS_ADDRESS
from shared.errors import InvalidArgument, InvalidState


def test_unit_is_written_and_not_started_without_systemctl(tmp_path: Path) -> None:
    data_dir = tmp_path / "my data"
    result = install_service(
        data_dir=data_dir,
        unit_dir=tmp_path / "units",
        executable=Path("/opt/agents/bin/agents-machine"),
        systemctl=None,
    )
    assert result.unit_path == tmp_path / "units" / UNIT_NAME
    assert not result.started
    text = result.unit_path.read_text()
    assert f'ExecStart="/opt/agents/bin/agents-machine" serve --data-dir "{data_dir}"' in text
    assert "WantedBy=multi-user.target" in text
    assert "Restart=on-failure" in text
    assert stat.S_IMODE(result.unit_path.stat().st_mode) == 0o644


def test_systemctl_is_called(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    fake = tmp_path / "systemctl"
    fake.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n')
    fake.chmod(0o755)
    result = install_service(
        data_dir=tmp_path / "d", unit_dir=tmp_path / "u", systemctl=str(fake), user="agents"
    )
    assert result.started
    assert log.read_text().splitlines() == ["daemon-reload", f"enable --now {UNIT_NAME}"]
    assert "User=agents" in result.unit_path.read_text()


def test_systemctl_failure_is_a_clear_error(tmp_path: Path) -> None:
    fake = tmp_path / "systemctl"
    fake.write_text("#!/bin/sh\necho 'Access denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(InvalidState) as info:
        install_service(data_dir=tmp_path / "d", unit_dir=tmp_path / "u", systemctl=str(fake))
    assert "Access denied" in str(info.value)


def test_special_characters_are_escaped() -> None:
    text = render_unit(executable=Path(sys.executable), data_dir=Path('/srv/a "b" 100%'))
    assert '"/srv/a \\"b\\" 100%%"' in text
    with pytest.raises(InvalidArgument):
        render_unit(executable=Path("/x"), data_dir=Path("/a\nExecStartPre=/bin/evil"))
    with pytest.raises(InvalidArgument):
        render_unit(executable=Path("/x"), data_dir=Path("/a"), user="root\nx")


def test_unwritable_unit_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(InvalidState) as info:
        install_service(data_dir=tmp_path / "d", unit_dir=blocker / "units", systemctl=None)
    assert "cannot write the systemd unit" in str(info.value)


def _serve_args(unit: str) -> list[str]:
    """The words of the unit's ExecStart after the executable."""
    line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))[1:]


def test_unit_serves_metrics_on_the_service_port_or_the_one_given(tmp_path: Path) -> None:
    from machine.cli.main import _parser

    unit = render_unit(executable=Path("/x/agents-machine"), data_dir=tmp_path)
    args = _parser().parse_args(_serve_args(unit))
    assert (args.command, args.data_dir) == ("serve", str(tmp_path))
    assert args.metrics == SERVICE_METRICS_ADDRESS == "127.0.0.1:9471"
    result = install_service(
        data_dir=tmp_path / "d",
        unit_dir=tmp_path / "u",
        metrics_address="127.0.0.1:9555",
        systemctl=None,
    )
    assert _parser().parse_args(_serve_args(result.unit_path.read_text())).metrics == (
        "127.0.0.1:9555"
    )
