"""machine.formats.cron: fire times in a zone, across both DST transitions, and missed runs."""

from __future__ import annotations

import datetime as dt

import pytest

from machine.formats.cron import (
    fires_between,
    next_fire,
    plan_start,
    readable_cron,
    validate_cron,
    validate_zone,
)
from shared.errors import InvalidArgument

BERLIN = validate_zone("Europe/Berlin")
NEW_YORK = validate_zone("America/New_York")


def utc(*args: int) -> dt.datetime:
    return dt.datetime(*args, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("expr", "match"),
    [
        ("* * * * * *", "has 6 fields"),
        ("* * * *", "has 4 fields"),
        ("61 * * * *", "not a number from 0 to 59"),
        ("hello world foo bar baz", "minute field 'hello'"),
        ("", "cron expression"),
    ],
)
def test_bad_cron_refused(expr: str, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        validate_cron(expr)


def test_cron_is_normalised() -> None:
    assert validate_cron("0  7 * *   1-5") == "0 7 * * 1-5"
    # croniter reads a range with equal ends as the whole cycle (every minute): in
    # cron it is the one value, and it is stored so.
    assert validate_cron("0-0 * 5-5/2 * *") == "0 * 5 * *"


@pytest.mark.parametrize("expr", ["0 0 31 2 *", "0 0 30 2 *", "0 0 31 4 *", "0 0 31 2,4,6 *"])
def test_rule_that_never_fires_is_refused(expr: str) -> None:
    with pytest.raises(InvalidArgument, match="never fires") as refused:
        validate_cron(expr)
    assert refused.value.field == "cron"


@pytest.mark.parametrize(
    "expr",
    [
        "0 0 29 2 *",  # leap years only, but it fires
        "0 0 31 2 1",  # day of month or day of week: every Monday of February
        "0 0 31 2-4 *",  # 31 March
        "0 0 31 */2 *",
        "*/15 9-17 * * mon-fri",
        "1-5/2,10 0 1 JAN,jul *",
        "0 0 * * 7",  # Sunday, as 0
        "0 0 * * sun-sat",
        "59 23 31 12 5-7",
    ],
)
def test_standard_cron_is_accepted(expr: str) -> None:
    assert validate_cron(expr) == expr
    assert next_fire(expr, BERLIN, utc(2026, 1, 1)) is not None


@pytest.mark.parametrize(
    ("expr", "match"),
    [
        ("R * * * *", "minute field 'R'"),  # random, drawn anew on every computation
        ("H * * * *", "minute field 'H'"),
        ("0 0 L * *", "day-of-month field 'L'"),
        ("0 0 15W * *", "day-of-month field '15W'"),
        ("0 0 ? * *", "day-of-month field '\\?'"),
        ("0 0 * * 1#2", "day-of-week field '1#2'"),
        ("0 0 * * 5L", "day-of-week field '5L'"),
        ("0 0 * * L", "day-of-week field 'L'"),
        ("0 0 * * jan", "day-of-week field 'jan'"),
        ("0 0 * mon *", "month field 'mon'"),
        ("5/15 * * * *", "a step follows \\* or a range: write 5-59/15"),
        ("*/0 * * * *", "step /0 must be 1 to 60"),
        ("*/61 * * * *", "step /61 must be 1 to 60"),
        ("0 0 * * 7-1", "runs backwards"),
        ("0 0 1,,2 * *", "empty list element"),
        ("0 24 * * *", "not a number from 0 to 23"),
        ("0 0 * * 8", "not a number from 0 to 7"),
        ("*-5 * * * *", "not standard cron"),
        ("@daily", "has 1 fields"),
        ("0 0 0 * * *", "has 6 fields"),  # a seconds field
        ("0 0 0 * * * 2030", "has 7 fields"),  # a year field
    ],
)
def test_non_standard_cron_is_refused(expr: str, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match) as refused:
        validate_cron(expr)
    assert refused.value.field == "cron"
    assert "accepted in each field" in refused.value.reason or "fields" in refused.value.reason


def test_rule_stored_by_an_older_version_that_never_fires_has_no_fire_time() -> None:
    # validate_cron refuses it now; one already stored plans as "never", not as an error.
    assert readable_cron("0 0 31  2 *") == "0 0 31 2 *"
    assert next_fire("0 0 31 2 *", BERLIN, utc(2026, 1, 1)) is None
    assert fires_between("0 0 31 2 *", BERLIN, utc(2026, 1, 1), utc(2027, 1, 1)) == []
    plan = plan_start("0 0 31 2 *", BERLIN, "once", None, utc(2026, 1, 1), utc(2027, 1, 1))
    assert (plan.missed, plan.catch_up, plan.next_fire) == (0, None, None)


def test_rule_croniter_cannot_read_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="cannot be read"):
        next_fire("61 * * * *", BERLIN, utc(2026, 1, 1))


@pytest.mark.parametrize(
    "zone", ["Mars/Olympus", "../../etc/passwd", "", "x" * 100, "localtime", "posixrules"]
)
def test_bad_zone_refused(zone: str) -> None:
    with pytest.raises(InvalidArgument, match="time_zone"):
        validate_zone(zone)


def test_daily_wall_time_follows_summer_time() -> None:
    # 07:00 in Berlin is 06:00 UTC in winter and 05:00 UTC in summer.
    got = fires_between("0 7 * * *", BERLIN, utc(2026, 3, 27, 12), utc(2026, 3, 30, 12))
    assert got == [utc(2026, 3, 28, 6), utc(2026, 3, 29, 5), utc(2026, 3, 30, 5)]


def test_time_in_the_spring_gap_fires_once_at_the_jump() -> None:
    # 2026-03-29 02:30 does not exist in Berlin: clocks go 02:00 CET -> 03:00 CEST (01:00 UTC).
    got = fires_between("30 2 * * *", BERLIN, utc(2026, 3, 27, 12), utc(2026, 3, 30, 12))
    assert got == [utc(2026, 3, 28, 1, 30), utc(2026, 3, 29, 1, 0), utc(2026, 3, 30, 0, 30)]


def test_time_in_the_repeated_autumn_hour_fires_once() -> None:
    # 2026-10-25 02:30 happens twice in Berlin (00:30 UTC in CEST, 01:30 UTC in CET).
    got = fires_between("30 2 * * *", BERLIN, utc(2026, 10, 24, 12), utc(2026, 10, 26, 12))
    assert got == [utc(2026, 10, 25, 0, 30), utc(2026, 10, 26, 1, 30)]


def test_every_minute_across_both_transitions_never_repeats() -> None:
    spring = fires_between("* * * * *", NEW_YORK, utc(2026, 3, 8, 6), utc(2026, 3, 8, 8))
    # The skipped hour costs nothing on the UTC line: one fire a minute throughout.
    assert spring == [utc(2026, 3, 8, 6) + dt.timedelta(minutes=m) for m in range(1, 121)]
    autumn = fires_between("* * * * *", NEW_YORK, utc(2026, 11, 1, 4), utc(2026, 11, 1, 7))
    assert autumn == sorted(set(autumn)), "strictly increasing, no repeats"
    # 01:00-01:59 wall time happens twice (05:00-05:59 and 06:00-06:59 UTC): fired once.
    assert len(autumn) == 180 - 60
    assert utc(2026, 11, 1, 6, 30) not in autumn


def test_next_fire_is_strictly_after() -> None:
    at = utc(2026, 6, 1, 5, 0)  # 07:00 in Berlin
    assert next_fire("0 7 * * *", BERLIN, at) == utc(2026, 6, 2, 5, 0)
    assert next_fire("0 7 * * *", BERLIN, at - dt.timedelta(seconds=1)) == at


def test_naive_start_refused() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        next_fire("* * * * *", BERLIN, dt.datetime(2026, 1, 1))


def test_missed_run_policies() -> None:
    created = utc(2026, 6, 1, 0)
    last = utc(2026, 6, 1, 5)  # Monday 07:00 Berlin fired
    now = utc(2026, 6, 4, 12)  # down since: Tue, Wed, Thu 07:00 were missed
    once = plan_start("0 7 * * *", BERLIN, "once", last, created, now)
    assert once.missed == 3
    assert once.catch_up == utc(2026, 6, 4, 5), "one catch-up, for the latest missed time"
    assert once.next_fire == utc(2026, 6, 5, 5)
    skip = plan_start("0 7 * * *", BERLIN, "skip", last, created, now)
    assert (skip.missed, skip.catch_up, skip.next_fire) == (3, None, utc(2026, 6, 5, 5))


def test_nothing_missed_means_no_catch_up() -> None:
    created = utc(2026, 6, 1, 0)
    plan = plan_start("0 7 * * *", BERLIN, "once", utc(2026, 6, 4, 5), created, utc(2026, 6, 4, 6))
    assert (plan.missed, plan.catch_up) == (0, None)
    fresh = plan_start("0 7 * * *", BERLIN, "once", None, utc(2026, 6, 4, 6), utc(2026, 6, 4, 7))
    assert (fresh.missed, fresh.catch_up) == (0, None), "no fire before the schedule existed"


def test_long_outage_counts_are_bounded() -> None:
    plan = plan_start(
        "* * * * *", BERLIN, "once", utc(2026, 1, 1), utc(2026, 1, 1), utc(2026, 3, 1)
    )
    assert plan.missed == 1000
    assert plan.catch_up == utc(2026, 3, 1), "the latest missed time, not the 1,000th"


@pytest.mark.parametrize(
    ("rule", "stored", "days"),
    [
        ("0 9 * * fri-sun", "0 9 * * 5-7", ["Sun", "Fri", "Sat", "Sun"]),
        ("0 9 * * SAT-SUN", "0 9 * * 6-7", ["Sun", "Sat", "Sun"]),
        (
            "0 9 * * sun-sat",
            "0 9 * * sun-sat",
            ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"],
        ),
    ],
)
def test_a_weekday_range_may_end_on_sunday(rule: str, stored: str, days: list[str]) -> None:
    assert validate_cron(rule) == stored
    # 2026-03-01 is a Sunday.
    fires = fires_between(
        stored, validate_zone("UTC"), dt.datetime(2026, 3, 1, tzinfo=dt.UTC),
        dt.datetime(2026, 3, 9, tzinfo=dt.UTC),
    )  # fmt: skip
    assert [f.strftime("%a") for f in fires] == days
