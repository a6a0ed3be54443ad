"""Replays found: a record older than the create-only marker that outlives it.

A bucket writer can put an older genuine version of a record back (its MAC
still verifies); each record whose older version grants more has a marker the
writer cannot take away (docs/security.md). When a read finds the two
disagree, the marker wins and the finding is reported here: one log line and
``agents_cp_store_replays_refused_total{record}`` (through ``on_replay``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

__all__ = ["ReplayLog"]

logger = logging.getLogger(__name__)


class ReplayLog:
    """Where the services report a replayed record (one per daemon)."""

    def __init__(self, on_replay: Callable[[str], None] | None = None) -> None:
        self._on_replay = on_replay

    def report(self, record: str, message: str) -> None:
        """Log ``message`` (it names the record, never a secret) and count ``record``."""
        logger.warning("%s", message)
        if self._on_replay is not None:
            self._on_replay(record)
