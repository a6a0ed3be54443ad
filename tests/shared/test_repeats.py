"""RepeatLimit: one WARNING per kind per interval, repeats folded and counted."""

from __future__ import annotations

import logging

import pytest

from shared.repeats import RepeatLimit

NAME = "tests.repeats"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == NAME]


def test_repeats_within_the_interval_are_debug_and_counted_in_the_next_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, NAME)
    clock = Clock()
    limit = RepeatLimit(logging.getLogger(NAME), every=60, monotonic=clock)
    for _ in range(4):
        limit.warning("refused: %s", "bad secret", extra={"credential_id": "cr_1"})
        clock.now += 10
    clock.now += 30  # 70 s after the first warning
    limit.warning("refused: %s", "bad secret", extra={"credential_id": "cr_1"})
    assert _lines(caplog) == [
        (logging.WARNING, "refused: bad secret"),
        *[(logging.DEBUG, "refused: bad secret (again)")] * 3,
        (logging.WARNING, "refused: bad secret (and 3 more like it in the last 70 s)"),
    ]


def test_another_id_or_message_is_its_own_kind(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, NAME)
    limit = RepeatLimit(logging.getLogger(NAME), monotonic=Clock())
    limit.warning("refused: %s", "bad secret", extra={"credential_id": "cr_1"})
    limit.warning("refused: %s", "bad secret", extra={"credential_id": "cr_2"})
    limit.warning("refused: %s", "expired", extra={"credential_id": "cr_1"})
    limit.warning("refused: %s", "bad secret")
    assert [level for level, _ in _lines(caplog)] == [logging.WARNING] * 4


def test_kinds_remembered_are_bounded_least_recent_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, NAME)
    limit = RepeatLimit(logging.getLogger(NAME), max_kinds=2, monotonic=Clock())
    for ident in ("a", "b", "a", "c", "a", "b"):
        limit.warning("refused %s", ident)
    # "b" was dropped when "c" came (the least recently seen), so it warns again.
    assert [level for level, _ in _lines(caplog)] == [
        logging.WARNING,  # a
        logging.WARNING,  # b
        logging.DEBUG,  # a again
        logging.WARNING,  # c (b dropped)
        logging.DEBUG,  # a again
        logging.WARNING,  # b again: forgotten
    ]
    assert len(limit._seen) == 2
