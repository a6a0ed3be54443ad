"""ControlConfig: flags > env > file > defaults, and validation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from controlplane.config import load_config
from shared.errors import ConfigError
from shared.sd_notify import NotifyConfig


def test_precedence(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('listen = "127.0.0.1:1"\nheartbeat_interval = 9.0\n')
    env = {
        "AGENTS_CONTROL_LISTEN": "127.0.0.1:2",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
    }
    cfg = load_config({"home": tmp_path}, env)
    assert cfg.listen == "127.0.0.1:2" and cfg.heartbeat_interval == 9.0
    assert cfg.store_access_key == "k" and "s" not in repr(cfg).split("store_region")[0][-5:]
    assert "store_secret_key" not in repr(cfg)
    cfg = load_config({"home": tmp_path, "listen": "127.0.0.1:3"}, env)
    assert cfg.listen == "127.0.0.1:3"
    assert load_config({}, {"AGENTS_CONTROL_HOME": str(tmp_path)}).home == tmp_path


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        ({"listen": "nope"}, "listen"),
        ({"heartbeat_interval": 0.0001}, "heartbeat_interval"),
        ({"log_level": "LOUD"}, "log_level"),
        ({"cluster_url": "http://127.0.0.1:4222"}, "cluster_url"),
        ({"cluster_url": "nats://127.0.0.1"}, "cluster_url"),
        ({"cluster_url": "nats://user:secret@127.0.0.1:4222"}, "cluster_url"),
        ({"cluster_url": " , "}, "cluster_url"),
    ],
)
def test_validation_names_the_field(tmp_path: Path, flags: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config({"home": tmp_path, **flags}, {})


def test_every_setting_read_from_the_file_is_a_known_key() -> None:
    # A setting read from config.toml but missing from FILE_KEYS is refused as
    # "unknown key": the two lists must not drift apart.
    import inspect
    import re

    from controlplane import config

    source = inspect.getsource(config.load_config)
    read = set(re.findall(r'get\(\s*"([a-z_]+)",\s*(?:"[A-Z_]+"|None)', source))
    assert "listen" in read, "the pattern still finds the settings"
    assert read - set(config.FILE_KEYS) == set()


def test_systemd_notify_settings_come_from_the_environment(tmp_path: Path) -> None:
    assert load_config({"home": tmp_path}, {}).notify == NotifyConfig()
    env = {
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "WATCHDOG_USEC": "30000000",
        "WATCHDOG_PID": str(os.getpid()),
    }
    cfg = load_config({"home": tmp_path}, env)
    assert cfg.notify == NotifyConfig("/run/systemd/notify", 30.0)


def test_log_level_and_format_from_file_env_and_flags(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('log_level = "debug"\nlog_format = "json"\n')
    cfg = load_config({"home": tmp_path}, {})
    assert (cfg.log_level, cfg.log_format) == ("DEBUG", "json")
    env = {"AGENTS_CONTROL_LOG_LEVEL": "Warning", "AGENTS_CONTROL_LOG_FORMAT": "TEXT"}
    cfg = load_config({"home": tmp_path}, env)
    assert (cfg.log_level, cfg.log_format) == ("WARNING", "text")
    cfg = load_config({"home": tmp_path, "log_level": "error", "log_format": "json"}, env)
    assert (cfg.log_level, cfg.log_format) == ("ERROR", "json")
    assert load_config({"home": tmp_path / "none"}, {}).log_format == "text"


def test_a_bad_log_format_names_the_field_and_where_it_came_from(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"log_format: bad value from \$AGENTS_CONTROL_LOG_FORMAT"
    ):
        load_config({"home": tmp_path}, {"AGENTS_CONTROL_LOG_FORMAT": "xml"})
    (tmp_path / "config.toml").write_text('log_level = "loud"\n')
    with pytest.raises(ConfigError, match="log_level: bad value from config file"):
        load_config({"home": tmp_path}, {})


def test_cluster_url_from_flag_env_or_file(tmp_path: Path) -> None:
    assert load_config({"home": tmp_path}, {}).cluster_url == "", "one process by default"
    (tmp_path / "config.toml").write_text('cluster_url = "nats://10.0.0.5:4222"\n')
    assert load_config({"home": tmp_path}, {}).cluster_url == "nats://10.0.0.5:4222"
    env = {"AGENTS_CONTROL_CLUSTER": "nats://a:1, tls://b:2"}
    cfg = load_config({"home": tmp_path}, env)
    from controlplane.config import cluster_servers

    assert cluster_servers(cfg.cluster_url) == ("nats://a:1", "tls://b:2")
    flags = {"home": tmp_path, "cluster_url": "nats://c:3"}
    assert load_config(flags, env).cluster_url == "nats://c:3"
    with pytest.raises(ConfigError, match="credentials") as e:
        load_config({"home": tmp_path, "cluster_url": "nats://u:secret@h:1"}, {})
    assert "secret" not in str(e.value), "a password is never echoed"
