"""When a schedule fires: five-field cron in an IANA time zone, DST included.

Fire times are wall-clock times in the schedule's zone, computed by croniter
on naive local times and then placed on the UTC time line by ``zoneinfo``, so
the two DST transitions have one stated meaning:

* a wall time that does not exist (the hour skipped in spring) fires at the
  instant the clocks jump to, once;
* a wall time that occurs twice (the hour repeated in autumn) fires once, at
  its first occurrence.

Fire times are strictly increasing and never repeat, whatever the rule. No
function here reads the clock: every one takes the instant it plans from.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, CroniterError, croniter

from shared.errors import InvalidArgument

__all__ = [
    "MissedPolicy",
    "StartPlan",
    "fires_between",
    "latest_fire",
    "next_fire",
    "plan_start",
    "readable_cron",
    "validate_cron",
    "validate_zone",
]

logger = logging.getLogger(__name__)

MissedPolicy = Literal["skip", "once"]
#: Longest cron expression accepted (five fields never need more).
MAX_CRON: Final = 200
#: Fire times examined per call at most: a rule that fires every minute over a
#: long outage is not walked minute by minute forever.
MAX_STEPS: Final = 100_000
_UTC: Final = dt.UTC


#: What a field may hold, said in every refusal (docs/schedules.md says the same).
_SYNTAX: Final = (
    "accepted in each field: numbers, *, ranges a-b, steps */n or a-b/n, lists a,b,c,"
    " and month (jan-dec) and weekday (sun-sat) names"
)
_ITEM: Final = re.compile(
    r"(\*|[0-9a-z]+)(?:-([0-9a-z]+))?(?:/([0-9]+))?", re.IGNORECASE | re.ASCII
)


@dataclass(frozen=True)
class _Field:
    name: str
    low: int
    high: int
    names: tuple[str, ...] = ()
    """Names of the values from ``low`` up, in order (jan = 1, sun = 0)."""

    def value(self, token: str) -> int:
        if token.isdigit() and len(token) <= 2 and self.low <= int(token) <= self.high:
            return int(token)
        if token.lower() in self.names:
            return self.low + self.names.index(token.lower())
        named = f" or a name ({self.names[0]}-{self.names[-1]})" if self.names else ""
        raise ValueError(f"{token!r} is not a number from {self.low} to {self.high}{named}")


_MONTHS: Final = (
    "jan",
    "feb",
    "mar",
    "apr",
    "may",
    "jun",
    "jul",
    "aug",
    "sep",
    "oct",
    "nov",
    "dec",
)
_WEEKDAYS: Final = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_FIELDS: Final = (
    _Field("minute", 0, 59),
    _Field("hour", 0, 23),
    _Field("day-of-month", 1, 31),
    _Field("month", 1, 12, _MONTHS),
    _Field("day-of-week", 0, 7, _WEEKDAYS),  # 0 and 7 are both Sunday
)


def _check_item(spec: _Field, item: str) -> str:
    """``item`` (one list element of a field) as croniter must read it, else ValueError."""
    if not item:
        raise ValueError("has an empty list element")
    m = _ITEM.fullmatch(item)
    if m is None:
        raise ValueError(f"{item!r} is not standard cron")
    start, end, step = m.groups()
    if step is not None and not 1 <= int(step) <= spec.high - spec.low + 1:
        raise ValueError(f"step /{step} must be 1 to {spec.high - spec.low + 1}")
    if start == "*":
        if end is not None:
            raise ValueError(f"{item!r} is not standard cron")
        return item
    first = spec.value(start)
    if end is None:
        if step is not None:
            # croniter reads ``a/n`` one way in one field and another in the next.
            raise ValueError(f"a step follows * or a range: write {start}-{spec.high}/{step}")
        return item
    last = spec.value(end)
    if spec.names is _WEEKDAYS and end.lower() == "sun" and first > 0:
        # ``fri-sun``: Sunday ends the week here (7), as cron reads it.
        return f"{first}-7" + (f"/{step}" if step is not None else "")
    if first > last:
        raise ValueError(f"range {start}-{end} runs backwards (ranges do not wrap around)")
    if first == last:
        # croniter reads ``5-5`` as the whole cycle; in cron it is the one value.
        return item.split("-", 1)[0]
    return item


def validate_cron(expr: str, field: str = "cron") -> str:
    """``expr`` normalised if it is a standard five-field cron expression that fires
    at some time, else InvalidArgument.

    Only standard cron is accepted (:data:`_SYNTAX`): croniter's extras (``R``
    drawn at random anew on every computation, ``H``, ``L``, ``W``, ``#``, ``?``,
    a seconds or a year field) would make fire times that differ from what a
    person reading the rule expects, or change between two computations.
    """
    if not isinstance(expr, str) or not expr.strip() or len(expr) > MAX_CRON:
        raise InvalidArgument(field, f"must be a cron expression of 1 to {MAX_CRON} characters")
    parts = expr.split()
    if len(parts) != 5:
        raise InvalidArgument(
            field,
            f"{expr!r} has {len(parts)} fields; a cron expression has five: "
            "minute hour day-of-month month day-of-week",
        )
    checked: list[str] = []
    for spec, part in zip(_FIELDS, parts, strict=True):
        try:
            checked.append(",".join(_check_item(spec, item) for item in part.split(",")))
        except ValueError as e:
            raise InvalidArgument(
                field, f"{expr!r}: {spec.name} field {part!r}: {e}; {_SYNTAX}"
            ) from None
    normal = " ".join(checked)
    if not croniter.is_valid(normal):
        raise InvalidArgument(field, f"{expr!r} is not a valid cron expression")
    try:
        # Any year from here on has the same days (a leap year comes within eight
        # years), so a rule with no fire now has none ever: 31 February, 31 April.
        croniter(normal, dt.datetime(2000, 1, 1)).get_next(dt.datetime)
    except CroniterBadDateError:
        raise InvalidArgument(
            field,
            f"{expr!r} never fires: none of its months has its day of the month"
            " (February has at most 29 days; April, June, September and November 30)",
        ) from None
    return normal


def readable_cron(expr: str, field: str = "cron") -> str:
    """``expr`` normalised if croniter reads it as five fields, else InvalidArgument.

    The looser check of earlier versions, kept for schedules they stored (in a
    database or an export) that :func:`validate_cron` would now refuse: such a
    schedule is kept, but cannot be resumed until it is written again.
    """
    if not isinstance(expr, str) or not expr.strip() or len(expr) > MAX_CRON:
        raise InvalidArgument(field, f"must be a cron expression of 1 to {MAX_CRON} characters")
    parts = expr.split()
    if len(parts) != 5 or not croniter.is_valid(" ".join(parts)):
        raise InvalidArgument(field, f"{expr!r} is not a valid five-field cron expression")
    return " ".join(parts)


#: Names ZoneInfo opens that are not zones of their own.
_NOT_ZONES: Final = frozenset({"localtime", "posixrules"})


def validate_zone(name: str, field: str = "time_zone") -> ZoneInfo:
    """The IANA zone ``name`` (such as ``Europe/Berlin``), else InvalidArgument."""
    if not isinstance(name, str) or not name or len(name) > 64 or ".." in name:
        raise InvalidArgument(field, f"{str(name)[:64]!r} is not an IANA time zone")
    if name in _NOT_ZONES:
        # Files in the zone database that are not zones: "localtime" follows
        # whatever the machine is set to, so a schedule would move with it.
        raise InvalidArgument(field, f"{name!r} is not an IANA time zone (name one: Europe/Berlin)")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidArgument(field, f"{name!r} is not an IANA time zone") from None


def _local(instant: dt.datetime, zone: ZoneInfo) -> dt.datetime:
    return instant.astimezone(zone).replace(tzinfo=None)


def _to_utc(wall: dt.datetime, zone: ZoneInfo) -> dt.datetime:
    """A naive wall time in ``zone`` as an instant: gaps jump forward, repeats take the first."""
    first = wall.replace(tzinfo=zone, fold=0).astimezone(_UTC)
    if _local(first, zone) == wall:
        return first  # fold=0 is the first occurrence of a repeated time
    # In a gap: the two readings straddle the jump; find the jump itself, the
    # first instant whose wall time is at or past ``wall``.
    lo = wall.replace(tzinfo=zone, fold=1).astimezone(_UTC)
    hi = first
    lo, hi = min(lo, hi), max(lo, hi)
    while hi - lo > dt.timedelta(seconds=1):
        mid = lo + (hi - lo) / 2
        if _local(mid, zone) >= wall:
            hi = mid
        else:
            lo = mid
    return hi.replace(microsecond=0)


def _walk(
    expr: str, zone: ZoneInfo, start: dt.datetime, *, backwards: bool = False
) -> Iterator[dt.datetime]:
    """Fire instants strictly after ``start`` (or at or before it, newest first).

    Ends when the rule has no more; InvalidArgument for a rule croniter cannot read.
    """
    if start.tzinfo is None:
        raise ValueError("start must be timezone-aware")
    # Begin an hour of wall time beyond ``start``: a fire in a DST gap lands
    # after its wall time, and a repeated hour reads wall times twice.
    slack = dt.timedelta(hours=-1 if not backwards else 1)
    try:
        it = croniter(expr, _local(start, zone) + slack)
    except CroniterError as e:
        # Only a rule stored by an older version can get here (validate_cron
        # refuses the rest): ours, so a caller can tell it from a bug.
        raise InvalidArgument("cron", f"{expr!r} cannot be read: {e}") from None
    last: dt.datetime | None = None
    for _ in range(MAX_STEPS):
        try:
            wall = it.get_prev(dt.datetime) if backwards else it.get_next(dt.datetime)
        except CroniterBadDateError:
            return  # no fire time (left) at all: 31 February, stored by an older version
        instant = _to_utc(wall, zone)
        if backwards:
            if instant > start or (last is not None and instant >= last):
                continue
        elif instant <= start or (last is not None and instant <= last):
            continue
        last = instant
        yield instant


def next_fire(expr: str, zone: ZoneInfo, after: dt.datetime) -> dt.datetime | None:
    """The first fire instant (UTC) strictly after ``after``; None if none comes."""
    return next(_walk(expr, zone, after), None)


def latest_fire(expr: str, zone: ZoneInfo, until: dt.datetime) -> dt.datetime | None:
    """The newest fire instant (UTC) at or before ``until``; None if none was."""
    return next(_walk(expr, zone, until, backwards=True), None)


def fires_between(
    expr: str, zone: ZoneInfo, after: dt.datetime, until: dt.datetime, *, limit: int = 1000
) -> list[dt.datetime]:
    """Fire instants in ``(after, until]``, at most ``limit`` of them."""
    out: list[dt.datetime] = []
    for instant in _walk(expr, zone, after):
        if instant > until or len(out) >= limit:
            break
        out.append(instant)
    return out


@dataclass(frozen=True)
class StartPlan:
    """What a schedule does when the daemon starts (or is resumed)."""

    catch_up: dt.datetime | None
    """The missed fire time to run once now, or None."""
    missed: int
    """How many fire times passed while the daemon was down (at most 1,000 counted)."""
    next_fire: dt.datetime | None
    """The next fire time after now."""


def plan_start(
    expr: str,
    zone: ZoneInfo,
    policy: MissedPolicy,
    last_fire: dt.datetime | None,
    created_at: dt.datetime,
    now: dt.datetime,
) -> StartPlan:
    """Plan a schedule at start: which missed fire (if any) runs, and the next one.

    Fire times after ``last_fire`` (or after ``created_at`` for a schedule that
    never fired) and up to ``now`` were missed. With ``once`` the latest of
    them runs now, as one catch-up; with ``skip`` none does. Either way the
    schedule then goes on from its next fire time after ``now``.
    """
    since = max(last_fire or created_at, created_at)
    missed = len(fires_between(expr, zone, since, now))
    latest = latest_fire(expr, zone, now) if missed else None
    catch_up = latest if policy == "once" and latest is not None and latest > since else None
    return StartPlan(catch_up, missed, next_fire(expr, zone, now))
