"""OutageLog: one warning per outage, a reminder now and then, one line at recovery."""

from __future__ import annotations

import logging

import pytest

from shared.errors import StoreMisconfigured, StoreUnavailable
from shared.outage import OutageLog

LOGGER = "tests.outage"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str, bool]]:
    return [
        (r.levelno, r.getMessage(), r.exc_info is not None)
        for r in caplog.records
        if r.name == LOGGER
    ]


def test_an_outage_is_one_warning_then_one_recovery_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    clock = Clock()
    log = OutageLog(logging.getLogger(LOGGER), "self-check", remind=600, monotonic=clock)
    gone = StoreMisconfigured("get cp/deployment.json: the bucket does not exist (NoSuchBucket)")
    for _ in range(5):
        log.failed(gone)
        clock.now += 1
    assert log.failing and log.failures == 5
    log.recovered()
    log.recovered()  # nothing to say any more
    assert not log.failing
    lines = _lines(caplog)
    assert [level for level, _, _ in lines] == [logging.WARNING] + [logging.DEBUG] * 4 + [
        logging.INFO
    ]
    assert lines[0] == (logging.WARNING, f"self-check: {gone}", False)  # no traceback
    assert lines[-1][1] == "self-check: works again (after 5 failed tries over 5 s)"


def test_a_long_outage_is_recalled_and_a_new_failure_said_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    log = OutageLog(logging.getLogger(LOGGER), "wake", remind=600, monotonic=clock)
    gone = StoreMisconfigured("list accounts/: the bucket does not exist (NoSuchBucket)")
    log.failed(gone)
    clock.now = 599
    log.failed(gone)
    clock.now = 600
    log.failed(gone)  # the reminder
    log.failed(StoreUnavailable("list accounts/: connection refused"))  # another problem
    warnings = [msg for level, msg, _ in _lines(caplog) if level == logging.WARNING]
    assert warnings == [
        f"wake: {gone}",
        f"wake: {gone} (failing for 600 s, 3 tries)",
        "wake: list accounts/: connection refused",
    ]


def test_a_bug_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    log = OutageLog(logging.getLogger(LOGGER), "wake")
    try:
        {}["missing"]  # noqa: B018
    except KeyError as e:
        log.failed(e)
    [(level, message, traced)] = _lines(caplog)
    assert (level, message, traced) == (logging.WARNING, "wake: 'missing'", True)


def test_a_callers_own_line_keeps_its_format_at_every_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    clock = Clock()
    log = OutageLog(logging.getLogger(LOGGER), "link", remind=300, monotonic=clock)
    for attempt in range(1, 4):
        error = OSError(f"refused at attempt {attempt}")  # a message of its own each time
        line = ("dial %s failed (attempt %d): %s", ("cp:7444", attempt, error))
        log.failed(error, line=line, key="OSError", extra={"machine_id": "mc_1"})
        clock.now += 200
    records = [r for r in caplog.records if r.name == LOGGER]
    assert [r.levelno for r in records] == [logging.WARNING, logging.DEBUG, logging.WARNING]
    assert [r.args[1] for r in records if isinstance(r.args, tuple)] == [1, 2, 3]
    assert all(str(r.msg).startswith("dial %s failed (attempt %d)") for r in records)
    assert records[2].getMessage().endswith("(failing for 400 s, 3 tries)")
    assert all(r.exc_info is None for r in records)  # the line says what failed
    assert all(getattr(r, "machine_id", None) == "mc_1" for r in records)
    assert all(r.filename == "test_outage.py" for r in records)  # the caller's line
