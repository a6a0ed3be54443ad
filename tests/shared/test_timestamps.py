"""The one Timestamp codec."""

from __future__ import annotations

import datetime as dt

from shared.pb.control.v1 import link_pb2
from shared.timestamps import field_datetime, from_datetime, from_seconds, to_datetime


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


def test_an_unset_field_is_none_not_the_epoch() -> None:
    hello = link_pb2.Hello()
    assert field_datetime(hello, "next_fire_at") is None
    at = dt.datetime(2026, 12, 1, 15, 30, tzinfo=dt.UTC)
    hello.next_fire_at.CopyFrom(from_datetime(at))
    assert field_datetime(hello, "next_fire_at") == at
