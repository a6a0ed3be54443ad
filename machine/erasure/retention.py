"""Retention sweeps of the machine: run at start and on the prune timer.

Each rule reads the time from one injectable clock, so tests move the clock
instead of waiting:

- the machine log: entries older than ``event_retention_days`` (7);
- attachment files no conversation names, once an hour old (a younger one may
  be an upload whose record is about to be written);
- Outgoing/ and Incoming/ files untouched for an hour (:class:`~machine.backups.handoff.Handoff`);
- erased-list entries older than 400 days, with their finished receipts.

docs/retention.md lists every kind of data and the test that proves its rule.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from machine.core.attachments import unnamed_attachment_files
from machine.erasure.service import ERASED_KEEP_SECONDS, ErasureService
from machine.storage import tables
from machine.storage.db import Database
from machine.storage.tables import erasures as store_erasures

__all__ = ["ATTACHMENT_MIN_AGE", "Retention", "SweepResult"]

logger = logging.getLogger(__name__)

#: An unnamed attachment file younger than this is left alone (an upload in flight).
ATTACHMENT_MIN_AGE: Final = 3600.0


class Sweeper(Protocol):
    """What the retention sweep needs of the export/import folders
    (:class:`machine.backups.handoff.Handoff`): erasure never imports backups."""

    async def sweep(self) -> int:
        """Remove what is past its time; how many files went."""
        ...


@dataclass(frozen=True)
class SweepResult:
    """What one sweep removed."""

    log_entries: int = 0
    attachments: int = 0
    handoff_files: int = 0
    erased_entries: int = 0


class Retention:
    """Runs every retention rule of the machine (see the module docstring)."""

    def __init__(
        self,
        db: Database,
        *,
        attachments_dir: Path,
        erasure: ErasureService,
        handoff: Sweeper | None,
        log_days: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._db = db
        self._attachments = attachments_dir
        self._erasure = erasure
        self._handoff = handoff
        self._log_days = log_days
        self._clock = clock

    async def sweep(self) -> SweepResult:
        """Apply every rule once; return what went."""
        now = self._clock()
        log_cutoff = now - self._log_days * 86400
        removed_log = await self._db.write(
            lambda c: tables.prune_log(c, log_cutoff), what="prune the machine log"
        )
        shas = await unnamed_attachment_files(
            self._db, self._attachments, min_age=ATTACHMENT_MIN_AGE, now=now
        )
        removed_files = await self._erasure.remove_attachment_files(shas)
        handoff = await self._handoff.sweep() if self._handoff is not None else 0
        erased_cutoff = now - ERASED_KEEP_SECONDS
        removed_erased = await self._db.write(
            lambda c: store_erasures.prune_erased(c, erased_cutoff), what="prune the erased list"
        )
        result = SweepResult(removed_log, removed_files, handoff, removed_erased)
        if removed_files or removed_erased:
            logger.info(
                "retention: %d unnamed attachment(s), %d erased-list entr(y/ies) removed",
                removed_files,
                removed_erased,
            )
        return result
