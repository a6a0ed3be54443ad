"""The one Timestamp codec."""

from __future__ import annotations

import datetime as dt

from shared.timestamps import from_datetime, from_seconds, to_datetime


def test_datetimes_round_trip_in_utc_whatever_their_zone() -> None:
    paris = dt.timezone(dt.timedelta(hours=1))
    value = dt.datetime(2026, 12, 1, 15, 30, 5, 250000, tzinfo=paris)
    back = to_datetime(from_datetime(value))
    assert back == value and back.tzinfo == dt.UTC
    assert from_datetime(None) is None


def test_unix_seconds_keep_their_fraction() -> None:
    ts = from_seconds(1_764_601_805.5)
    assert ts is not None and ts.seconds == 1_764_601_805 and ts.nanos == 500_000_000
    assert from_seconds(None) is None
