"""shared.durations: one duration grammar for both CLIs (Go's, with ``d``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.cli import duration, whole_seconds
from shared.durations import DurationError, format_duration, parse_duration, seconds_value


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90), ("30m", 1800), ("1h30m", 5400), ("2h45m30s", 9930), ("1d", 86400),
        ("1d12h", 129600), ("250ms", 0.25), ("1.5h", 5400), (".5s", 0.5), ("1h0m", 3600),
        # plain seconds and the single suffixes the flags took before
        ("3600", 3600), ("2.5", 2.5), ("0", 0), ("45s", 45), ("1h", 3600),
        (" 1h30m ", 5400),
    ],
)  # fmt: skip
def test_what_parses(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("1h-5m", "'1h-5m': no signs, a duration is not negative"),
        ("-5m", "no signs"),
        ("+5m", "no signs"),
        ("5x", "'5x': unknown unit 'x' (ms, s, m, h, d;"),
        ("30M", "unknown unit 'M'"),
        ("5µs", "unknown unit 'µs'"),
        ("", "empty duration"),
        ("   ", "empty duration"),
        ("1h30", "30 needs a unit"),
        ("1m1h", "units go from the largest to the smallest, each once"),
        ("1h1h", "each once"),
        ("5 m", "unexpected ' '"),
        ("h", "unexpected 'h'"),
        ("١٢s", "unexpected '١'"),  # digits of another script: float() would take them
        ("9" * 400 + "d", "too long: '99999999999999999999…'"),
        ("9" * 400, "too long"),
    ],
)
def test_what_is_refused_and_why(text: str, says: str) -> None:
    with pytest.raises(DurationError) as info:
        parse_duration(text)
    message = str(info.value)
    assert says in message and "\n" not in message
    assert isinstance(info.value, ValueError)  # config loading names the source of it


@given(st.integers(min_value=0, max_value=10**10))
def test_whole_seconds_round_trip(seconds: int) -> None:
    text = format_duration(seconds)
    assert parse_duration(text) == seconds
    assert text == "0s" or text[0] != "0"


@given(
    st.integers(0, 400), st.integers(0, 23), st.integers(0, 59), st.integers(0, 59),
    st.integers(0, 999),
)  # fmt: skip
def test_parts_add_up_and_format_back(d: int, h: int, m: int, s: int, ms: int) -> None:
    parts = [(d, "d"), (h, "h"), (m, "m"), (s, "s"), (ms, "ms")]
    text = "".join(f"{n}{u}" for n, u in parts if n) or "0s"
    seconds = d * 86400 + h * 3600 + m * 60 + s + ms / 1000
    assert parse_duration(text) == pytest.approx(seconds, abs=1e-6)
    assert format_duration(parse_duration(text)) == text


def test_format_duration() -> None:
    assert [format_duration(v) for v in (0, 1, 90, 5400, 86400, 90061.25, 0.0004)] == [
        "0s", "1s", "1m30s", "1h30m", "1d", "1d1h1m1s250ms", "0s",
    ]  # fmt: skip
    with pytest.raises(ValueError):
        format_duration(-1)


def test_seconds_value_takes_numbers_and_text() -> None:
    assert seconds_value(15) == 15.0 and seconds_value(2.5) == 2.5
    assert seconds_value("1m30s") == 90.0 and seconds_value("20") == 20.0
    for bad in (True, -1, float("inf"), "1h-5m"):
        with pytest.raises(DurationError):
            seconds_value(bad)


def _arg(kind: object, text: str) -> object:
    p = argparse.ArgumentParser()
    p.add_argument("--ttl", type=kind)
    return p.parse_args(["--ttl", text]).ttl


def test_argparse_types_bound_and_round() -> None:
    assert _arg(duration(), "1h30m") == 5400.0
    assert _arg(whole_seconds(1, 2**32 - 1), "1h30m") == 5400
    assert isinstance(_arg(whole_seconds(1, 10), "10"), int)
    t = whole_seconds(1, 2**32 - 1)
    for text, says in (
        ("0", "must be at least 1s, got '0'"),
        ("0h", "must be at least 1s"),
        ("1.5s", "must be whole seconds, got '1.5s'"),
        ("50000d", "too long: '50000d' (at most 49710d6h28m15s)"),
        ("1h-5m", "no signs"),
    ):
        with pytest.raises(argparse.ArgumentTypeError) as info:
            t(text)
        assert says in str(info.value)
    assert "no signs" in _type_error(duration(), "-1")


def _type_error(kind: object, text: str) -> str:
    try:
        kind(text)  # type: ignore[operator]
    except argparse.ArgumentTypeError as e:
        return str(e)
    raise AssertionError("accepted")


def test_the_clis_take_durations(tmp_path: Path) -> None:
    from controlplane.cli.main import build_parser
    from machine.cli.common import build_config
    from machine.cli.main import parse_args

    acct, mc = "acct_" + "0" * 26, "mc_" + "0" * 26
    args = build_parser().parse_args(["token", "create", "--account", acct, "--ttl", "1h30m"])
    assert args.ttl == 5400
    args = build_parser().parse_args(["machine", "repair", mc, "--ttl", "1d"])
    assert args.ttl == 86400
    args = build_parser().parse_args(["serve", "--heartbeat-interval", "500ms"])
    assert args.heartbeat_interval == 0.5
    args = parse_args(["--data-dir", str(tmp_path), "serve", "--grace", "1m"])
    assert build_config(args, {}, tmp_path).shutdown_grace_seconds == 60
    # The environment's durations take the same grammar.
    args = parse_args(["--data-dir", str(tmp_path), "serve"])
    env = {
        "AGENTS_MACHINE_SHUTDOWN_GRACE": "1m30s",
        "AGENTS_MACHINE_INTEGRITY_CHECK_SECONDS": "12h",
    }
    cfg = build_config(args, env, tmp_path)
    assert (cfg.shutdown_grace_seconds, cfg.integrity_check_seconds) == (90, 43200)


def test_the_control_plane_environment_takes_durations(tmp_path: Path) -> None:
    from controlplane.config import load_config
    from shared.errors import ConfigError

    env = {"AGENTS_CONTROL_HEARTBEAT": "500ms", "AGENTS_CONTROL_JOIN_CONFIRM_GRACE": "10m"}
    cfg = load_config({"home": str(tmp_path)}, env)
    assert (cfg.heartbeat_interval, cfg.join_confirm_grace) == (0.5, 600)
    with pytest.raises(ConfigError) as info:
        load_config({"home": str(tmp_path)}, {"AGENTS_CONTROL_HEARTBEAT": "5x"})
    assert "heartbeat_interval: bad value from $AGENTS_CONTROL_HEARTBEAT" in str(info.value)
    assert "unknown unit 'x'" in str(info.value)
