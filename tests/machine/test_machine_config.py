"""MachineConfig: data folder resolution, precedence, validation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from machine.config import MachineConfig, default_data_dir, resolve_data_dir, server_data_dir
from shared.errors import ConfigError
from shared.sd_notify import NotifyConfig

HOME = Path("/home/u")


def test_default_data_dir_per_platform() -> None:
    assert default_data_dir({}, HOME, "linux") == HOME / ".local/share/Agents"
    assert default_data_dir({"XDG_DATA_HOME": "/x"}, HOME, "linux") == Path("/x/Agents")
    assert default_data_dir({"XDG_DATA_HOME": "rel"}, HOME, "linux") == HOME / ".local/share/Agents"
    mac = default_data_dir({}, HOME, "darwin")
    assert mac == HOME / "Library/Application Support/Agents"
    assert server_data_dir(HOME) == HOME / ".agents-server/root"


def test_flag_beats_env_beats_default() -> None:
    env = {"AGENTS_DATA_DIR": "/env/dir"}
    assert resolve_data_dir("/flag/dir", env, HOME) == Path("/flag/dir")
    assert resolve_data_dir(None, env, HOME) == Path("/env/dir")


def test_build_reads_file_and_env(tmp_path: Path) -> None:
    data = tmp_path / "d"
    data.mkdir()
    (data / "machine.toml").write_text('prompt_limit = "2KiB"\nattachment_limit = 100\n')
    cfg = MachineConfig.build(
        flags={"data_dir": str(data), "attachment_limit": "300"},
        env={"AGENTS_MACHINE_PROMPT_LIMIT": "1k"},
        home=HOME,
    )
    assert cfg.prompt_limit == 1024  # env beats file
    assert cfg.attachment_limit == 300  # flag beats file
    assert cfg.socket == data / "machine.sock"
    assert cfg.metrics_address is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tcp_address", "0.0.0.0:5000"),
        ("tcp_address", "nonsense"),
        ("metrics_address", "10.0.0.1:9000"),
        ("prompt_limit", 0),
        ("event_retention_days", 0),
        ("shutdown_grace_seconds", -1),
        ("shutdown_grace_seconds", float("nan")),
        ("shutdown_grace_seconds", 1e9),
    ],
)
def test_validate_names_the_bad_field(tmp_path: Path, field: str, value: object) -> None:
    cfg = MachineConfig(data_dir=tmp_path, **{field: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert err.value.field == field


def test_bad_env_value_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="prompt_limit"):
        MachineConfig.build(
            flags={"data_dir": str(tmp_path)},
            env={"AGENTS_MACHINE_PROMPT_LIMIT": "lots"},
            home=HOME,
        )


def test_every_setting_read_from_the_file_is_a_known_key() -> None:
    # A setting the file may carry but FILE_KEYS does not list is refused as
    # "unknown key": the two lists must not drift apart.
    import inspect
    import re

    from machine.config import FILE_KEYS, MachineConfig

    source = inspect.getsource(MachineConfig.build)
    read = set(re.findall(r'src\.get\(\s*"([a-z_]+)"', source))
    read |= set(re.findall(r'opt\("([a-z_]+)"', source))
    assert read, "the pattern still finds the settings"
    assert read - set(FILE_KEYS) == set()


def test_backup_settings_defaults_and_file(tmp_path: Path) -> None:
    data = tmp_path / "d"
    data.mkdir()
    cfg = MachineConfig.build(flags={"data_dir": str(data)}, env={}, home=HOME)
    assert (cfg.backup_keep, cfg.backup_time) == (3, "03:30")
    assert cfg.backups_dir == data / "backups"
    assert cfg.outgoing_dir == data / "Outgoing" and cfg.incoming_dir == data / "Incoming"
    (data / "machine.toml").write_text(
        f'backup_keep = 10\nbackup_time = "23:05"\nbackup_dir = "{tmp_path / "b"}"\n'
    )
    cfg = MachineConfig.build(flags={"data_dir": str(data)}, env={}, home=HOME)
    assert (cfg.backup_keep, cfg.backup_time, cfg.backups_dir) == (10, "23:05", tmp_path / "b")


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("backup_keep = 0", "backup_keep"),
        ("backup_keep = 11", "backup_keep"),
        ('backup_keep = "three"', "backup_keep"),
        ('backup_time = "24:00"', "backup_time"),
        ('backup_time = "3pm"', "backup_time"),
        ('backup_dir = "relative/dir"', "backup_dir"),
    ],
)
def test_backup_settings_out_of_range_are_refused(tmp_path: Path, line: str, field: str) -> None:
    data = tmp_path / "d"
    data.mkdir()
    (data / "machine.toml").write_text(line + "\n")
    with pytest.raises(ConfigError, match=field):
        MachineConfig.build(flags={"data_dir": str(data)}, env={}, home=HOME)


def test_backup_keep_from_env_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="backup_keep.*1 to 10"):
        MachineConfig.build(
            flags={"data_dir": str(tmp_path)}, env={"AGENTS_MACHINE_BACKUP_KEEP": "12"}, home=HOME
        )


@pytest.mark.parametrize(
    ("line", "shown"),
    [
        (
            "backup_time = 03:30:00",
            'a time of day: 03:30:00 (TOML strings are in quotes: backup_time = "…")',
        ),
        ("time_zone = 1979-05-27", "a date: 1979-05-27 (TOML strings are in quotes"),
        ("backup_dir = true", "a boolean: true (TOML strings"),
        ('backup_keep = "3"', 'an integer in FILE, got a string: "3"'),
    ],
)
def test_a_value_of_the_wrong_toml_type_is_shown_as_the_file_wrote_it(
    tmp_path: Path, line: str, shown: str
) -> None:
    data = tmp_path / "d"
    data.mkdir()
    (data / "machine.toml").write_text(line + "\n")
    with pytest.raises(ConfigError) as err:
        MachineConfig.build(flags={"data_dir": str(data)}, env={}, home=HOME)
    assert shown in str(err.value).replace(str(data / "machine.toml"), "FILE")
    assert "datetime" not in str(err.value)


def test_systemd_notify_settings_come_from_the_environment(tmp_path: Path) -> None:
    flags = {"data_dir": str(tmp_path)}
    assert MachineConfig.build(flags=flags, env={}, home=HOME).notify == NotifyConfig()
    env = {
        "NOTIFY_SOCKET": "@notify",
        "WATCHDOG_USEC": "30000000",
        "WATCHDOG_PID": str(os.getpid()),
    }
    cfg = MachineConfig.build(flags=flags, env=env, home=HOME)
    assert cfg.notify == NotifyConfig("@notify", 30.0)


def test_log_level_and_format_from_file_env_and_flags(tmp_path: Path) -> None:
    data = tmp_path / "d"
    data.mkdir()
    (data / "machine.toml").write_text('log_level = "debug"\nlog_format = "json"\n')

    def build(flags: dict[str, object], env: dict[str, str]) -> tuple[str, str]:
        cfg = MachineConfig.build(flags={"data_dir": str(data), **flags}, env=env, home=HOME)
        return cfg.log_level, cfg.log_format

    assert build({}, {}) == ("DEBUG", "json")
    env = {"AGENTS_MACHINE_LOG_LEVEL": "warning", "AGENTS_MACHINE_LOG_FORMAT": "Text"}
    assert build({}, env) == ("WARNING", "text")
    assert build({"log_level": "error", "log_format": "json"}, env) == ("ERROR", "json")
    (data / "machine.toml").unlink()
    assert build({}, {}) == ("INFO", "text")
    with pytest.raises(
        ConfigError, match=r"log_format: bad value from \$AGENTS_MACHINE_LOG_FORMAT"
    ):
        build({}, {"AGENTS_MACHINE_LOG_FORMAT": "xml"})


@pytest.mark.parametrize(
    ("written", "seconds"), [("90", 90.0), ('"90s"', 90.0), ('"5m"', 300.0), ('"1h30m"', 5400.0)]
)
def test_backup_interval_takes_seconds_or_a_duration(
    tmp_path: Path, written: str, seconds: float
) -> None:
    data = tmp_path / "d"
    data.mkdir()
    (data / "machine.toml").write_text(f"backup_interval = {written}\n")
    cfg = MachineConfig.build(flags={"data_dir": str(data)}, env={}, home=HOME)
    assert cfg.backup_interval == seconds


@pytest.mark.parametrize("written", ['"10 sec"', '"-5m"', '"5s"', '"2d"'])
def test_backup_interval_bad_or_out_of_range_names_the_setting(
    tmp_path: Path, written: str
) -> None:
    data = tmp_path / "d"
    data.mkdir()
    (data / "machine.toml").write_text(f"backup_interval = {written}\n")
    with pytest.raises(ConfigError, match="backup_interval"):
        MachineConfig.build(flags={"data_dir": str(data)}, env={}, home=HOME)
