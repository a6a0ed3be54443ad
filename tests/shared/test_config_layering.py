"""Config layering: flags beat the environment, which beats the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import load_toml, parse_bool, parse_size, pick
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
