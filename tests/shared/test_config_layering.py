"""Config layering: flags beat the environment, which beats the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import Sources, load_toml, parse_bool, parse_size, pick, split_hostport
from shared.errors import ConfigError


def _pick(flag: object, env: dict[str, str], file: dict[str, object]) -> int:
    return pick(
        "limit", flag=flag, env=env, env_key="LIMIT", file=file, default=7, parse=parse_size
    )


def test_precedence_flag_env_file_default() -> None:
    assert _pick("1k", {"LIMIT": "2k"}, {"limit": 3}) == 1024
    assert _pick(None, {"LIMIT": "2k"}, {"limit": 3}) == 2048
    assert _pick(None, {}, {"limit": 3}) == 3
    assert _pick(None, {"LIMIT": ""}, {}) == 7


def test_bad_value_names_field_and_origin() -> None:
    with pytest.raises(ConfigError) as info:
        _pick(None, {"LIMIT": "lots"}, {})
    assert "limit" in str(info.value) and "$LIMIT" in str(info.value)


def test_parsers() -> None:
    assert parse_size("20MiB") == 20 * 1024 * 1024
    assert parse_size(5) == 5
    assert parse_bool("yes") is True and parse_bool("off") is False
    with pytest.raises(ValueError):
        parse_bool("maybe")
    with pytest.raises(ValueError):
        parse_size(-1)


def test_load_toml(tmp_path: Path) -> None:
    assert load_toml(tmp_path / "missing.toml") == {}
    good = tmp_path / "c.toml"
    good.write_text('store = "s3://b/p"\n')
    assert load_toml(good) == {"store": "s3://b/p"}
    bad = tmp_path / "bad.toml"
    bad.write_text("store = \n")
    with pytest.raises(ConfigError):
        load_toml(bad)


def test_sources_layer_flags_env_file_default() -> None:
    src = Sources(
        flags={"limit": None, "name": "flag"},
        env={"LIMIT": "2k", "NAME": "env"},
        file={"limit": 3, "name": "file", "ratio": "0.5"},
    )
    assert src.get("name", "NAME", "default") == "flag"
    assert src.get("limit", "LIMIT", 7, parse_size) == 2048
    assert src.get("limit", None, 7, parse_size) == 3  # no env key: the file is next
    assert src.get("ratio", None, 1.0, float) == 0.5
    assert src.get("missing", "MISSING", 42) == 42


def test_sources_bad_value_names_field_and_origin() -> None:
    src = Sources(flags={}, env={}, file={"limit": "lots"})
    with pytest.raises(ConfigError) as info:
        src.get("limit", "LIMIT", 7, parse_size)
    assert info.value.field == "limit" and "config file" in str(info.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:7443", ("127.0.0.1", 7443)),
        ("example.org:0", ("example.org", 0)),
        ("[::1]:80", ("::1", 80)),
        ("[fe80::1%eth0]:65535", ("fe80::1%eth0", 65535)),
        ("::1:80", ("::1", 80)),  # unbracketed: the last colon separates the port
    ],
)
def test_split_hostport_accepts(value: str, expected: tuple[str, int]) -> None:
    assert split_hostport(value, "listen") == expected


@pytest.mark.parametrize(
    "value",
    [
        "",
        "nonsense",
        "host:",
        ":80",
        "host:http",
        "host:-1",
        "host:+80",
        "host:65536",
        "host:\u0662",  # a non-ASCII digit
        "[::1]",
        "[::1]80",
        "[::1:80",
        "[]:80",
    ],
)
def test_split_hostport_refuses_naming_the_field(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        split_hostport(value, "link_listen")
    assert info.value.field == "link_listen"


def test_split_hostport_port_zero_optional() -> None:
    assert split_hostport("h:0", "listen") == ("h", 0)
    with pytest.raises(ConfigError, match="between 1 and 65535"):
        split_hostport("h:0", "listen", allow_port_zero=False)
    assert split_hostport("h:1", "listen", allow_port_zero=False) == ("h", 1)


def test_a_config_file_this_user_cannot_reach_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As for a data folder of another user: stat itself fails (tests run as root,
    # whom permissions do not stop, so the refusal is made here).
    def denied(self: Path, *args: object, **kwargs: object) -> bool:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "exists", denied)
    with pytest.raises(ConfigError, match="machine.toml: cannot read: Permission denied"):
        load_toml(tmp_path / "machine.toml")


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(b'listen = "\xff"\n')
    with pytest.raises(ConfigError, match="config.toml: cannot read: not UTF-8"):
        load_toml(path)
