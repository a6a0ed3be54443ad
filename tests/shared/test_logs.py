"""shared.logs: the two formats, the level, the capped libraries."""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
from collections.abc import Iterator

import pytest

from shared.errors import ConfigError
from shared.logs import (
    CAPPED,
    JsonFormatter,
    TextFormatter,
    check_format,
    check_level,
    setup_logging,
)

SECRET = "agcr1_s3cr3t-value-never-logged"


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """setup_logging changes the root logger and the capped ones: put them back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    capped = {name: logging.getLogger(name).level for name in CAPPED}
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, old in capped.items():
            logging.getLogger(name).setLevel(old)


def _record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord(
        "controlplane.api.link", logging.WARNING, __file__, 1, msg, args, None
    )
    record.__dict__.update(extra)
    return record


def test_a_json_line_has_the_fields_and_the_ids_as_top_level_keys() -> None:
    record = _record("join refused: %s", "token expired", machine_id="mc_1", account_id="ac_2")
    line = JsonFormatter().format(record)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["level"] == "WARNING"
    assert obj["logger"] == "controlplane.api.link"
    assert obj["message"] == "join refused: token expired"
    assert obj["machine_id"] == "mc_1" and obj["account_id"] == "ac_2"
    when = dt.datetime.fromisoformat(obj["time"])
    assert obj["time"].endswith("Z") and when.utcoffset() == dt.timedelta(0)
    assert abs(when.timestamp() - record.created) < 0.001


def test_an_exception_is_one_string_field_on_the_same_line() -> None:
    try:
        raise ValueError("boom\nsecond line")
    except ValueError as e:
        record = _record("failed")
        record.exc_info = (type(e), e, e.__traceback__)
    line = JsonFormatter().format(record)
    assert "\n" not in line
    obj = json.loads(line)
    assert "Traceback" in obj["exception"] and "ValueError: boom" in obj["exception"]


def test_a_text_line_names_the_ids_after_the_message() -> None:
    line = TextFormatter().format(_record("link up", machine_id="mc_1"))
    assert line.endswith(" WARNING controlplane.api.link: link up [machine_id=mc_1]")
    assert TextFormatter().format(_record("plain")).endswith("controlplane.api.link: plain")


def test_setup_logging_writes_json_lines_at_the_level(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging("warning", "json", out)
    log = logging.getLogger("machine.link.connection")
    log.info("not shown")
    log.warning("shown %d", 1, extra={"machine_id": "mc_9"})
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["machine_id"] == "mc_9"


def test_setup_logging_again_replaces_its_handler(restore_logging: None) -> None:
    first, second = io.StringIO(), io.StringIO()
    setup_logging("info", "text", first)
    setup_logging("info", "json", second)
    logging.getLogger("x").info("once")
    assert first.getvalue() == ""
    assert json.loads(second.getvalue())["message"] == "once"


def test_the_chatty_libraries_stay_at_warning_at_our_debug(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging("debug", "json", out)
    for name in CAPPED:
        logging.getLogger(f"{name}.sub").debug("flood")
        logging.getLogger(f"{name}.sub").info("flood")
    logging.getLogger("botocore.endpoint").warning("kept")
    logging.getLogger("machine.x").debug("ours")
    messages = [json.loads(line)["message"] for line in out.getvalue().splitlines()]
    assert messages == ["kept", "ours"]


def test_at_error_the_capped_libraries_follow_our_level(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging("error", "text", out)
    logging.getLogger("botocore").warning("not shown")
    assert out.getvalue() == ""


def test_a_refused_credential_line_names_ids_never_the_secret(
    restore_logging: None,
) -> None:
    """The shape callers follow: the credential's id and why, never its value."""
    out = io.StringIO()
    setup_logging("info", "json", out)
    logging.getLogger("controlplane.access.authz").warning(
        "credential refused: %s", "unknown credential", extra={"credential_id": "cr_1"}
    )
    assert SECRET not in out.getvalue()
    assert json.loads(out.getvalue())["credential_id"] == "cr_1"


@pytest.mark.parametrize("value", ["loud", "", "10"])
def test_a_bad_level_is_a_config_error_naming_the_field(value: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_level(value)
    assert raised.value.field == "log_level"
    assert "debug, info, warning, error" in raised.value.reason


def test_levels_and_formats_take_any_case() -> None:
    assert check_level("Debug") == "DEBUG"
    assert check_format("JSON") == "json"
    with pytest.raises(ConfigError, match="log_format"):
        check_format("xml")
