"""bench/connect.py counts every failed connect attempt, the DEBUG repeats too."""

from __future__ import annotations

import logging

from bench.connect import ConnectFailures

FORMAT = "control link to %s failed (attempt %d), retrying in %.2fs: %s: %s"


def test_every_attempt_is_counted_whatever_its_level() -> None:
    log = logging.getLogger("machine.link.connection")
    before = log.level
    with ConnectFailures().counting() as failures:
        log.warning(FORMAT, "cp:7444", 1, 0.5, "TimeoutError", "deadline")
        log.debug(FORMAT, "cp:7444", 2, 1.0, "TimeoutError", "deadline")
        log.warning(
            FORMAT + " (failing for %.0f s, %d tries)", "cp", 3, 1, "Unavailable", "x", 9, 3
        )
        log.info("control link up")
    assert failures.by_error == {"TimeoutError": 2, "Unavailable": 1}
    assert failures.timeouts == 2
    assert log.level == before
