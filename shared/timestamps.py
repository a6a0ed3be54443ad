"""The one codec between our times and ``google.protobuf.Timestamp``.

Domain code keeps times as aware UTC datetimes (control plane) or Unix
seconds (machine); only servicers and clients call these.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Final, TypeAlias, overload

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

__all__ = [
    "MAX_SECONDS",
    "Clock",
    "field_datetime",
    "from_datetime",
    "from_seconds",
    "to_datetime",
    "to_seconds",
    "utc_now",
]


#: 9999-12-31T23:59:59Z: the last second a Timestamp (and a datetime) carries.
MAX_SECONDS: Final = 253_402_300_799

Clock: TypeAlias = Callable[[], dt.datetime]
"""What modules that read the wall clock take (injected, so tests can move time)."""


def utc_now() -> dt.datetime:
    """The default :data:`Clock`: now, as an aware UTC datetime."""
    return dt.datetime.now(dt.UTC)


@overload
def from_datetime(value: dt.datetime) -> Timestamp: ...
@overload
def from_datetime(value: None) -> None: ...
def from_datetime(value: dt.datetime | None) -> Timestamp | None:
    """A Timestamp from an aware datetime (None stays None: the field stays unset)."""
    if value is None:
        return None
    out = Timestamp()
    out.FromDatetime(value.astimezone(dt.UTC))
    return out


def from_seconds(seconds: float | None) -> Timestamp | None:
    """A Timestamp from Unix seconds (None stays None)."""
    if seconds is None:
        return None
    out = Timestamp()
    out.FromNanoseconds(int(seconds * 1e9))
    return out


def to_datetime(value: Timestamp) -> dt.datetime:
    """An aware UTC datetime from a Timestamp."""
    return value.ToDatetime(dt.UTC)


def field_datetime(message: Message, name: str) -> dt.datetime | None:
    """The Timestamp field ``name`` of ``message`` as an aware UTC datetime, or None
    when the field is unset (an unset time is unknown, not the epoch)."""
    if not message.HasField(name):
        return None
    value = getattr(message, name)
    assert isinstance(value, Timestamp), f"{name} is not a Timestamp field"
    return to_datetime(value)


def to_seconds(value: Timestamp) -> float:
    """Unix seconds from a Timestamp: the inverse of :func:`from_seconds`."""
    return value.ToNanoseconds() / 1e9
