"""A settable clock for domain unit tests (``clock.now += timedelta(...)``)."""

from __future__ import annotations

import datetime as dt


class FixedClock:
    """Returns ``now``, which a test moves by hand."""

    def __init__(self, now: dt.datetime | None = None) -> None:
        self.now = now or dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

    def __call__(self) -> dt.datetime:
        return self.now
