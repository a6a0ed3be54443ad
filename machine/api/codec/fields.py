"""The wire's field conventions every codec module follows.

An unset Timestamp is an unknown time, not the epoch: a reader gives None for
it, and a writer leaves the field unset for None (:func:`shared.timestamps.from_seconds`).
"""

from __future__ import annotations

import logging

from google.protobuf.message import Message

from shared.timestamps import to_seconds

__all__ = ["time_field"]

logger = logging.getLogger(__name__)


def time_field(msg: Message, name: str) -> float | None:
    """A Timestamp field as Unix seconds; None when it is not set."""
    return to_seconds(getattr(msg, name)) if msg.HasField(name) else None
