"""The audit trail: one create-once JSON object per action under ``audit/``.

Records are kept ``audit_retention_days`` (400 by default; docs/retention.md).
:class:`AuditRetention` removes them by whole UTC days: a record's key starts
with its day (:func:`~controlplane.integrity.records.audit_key`), so the keys of
older days sort first and a sweep lists only what it removes, plus one page.
Each record is one object removed by one delete: a sweep stopped anywhere (a
crash, a store fault) leaves every record it did not reach whole, and the next
sweep removes the rest.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable
from typing import Final

from controlplane.integrity.records import AuditRecord, audit_key, encode
from shared.errors import AgentsError
from shared.ids import new_id
from shared.outage import OutageLog
from shared.store.base import DEFAULT_PAGE_SIZE, ObjectStore, delete_keys
from shared.store.causes import set_cause
from shared.timestamps import Clock, utc_now

__all__ = ["AUDIT_PREFIX", "AUDIT_SWEEP_INTERVAL", "AuditRetention", "Auditor"]

logger = logging.getLogger(__name__)

#: Where every audit record lives (controlplane.integrity.records).
AUDIT_PREFIX: Final = "audit/"
#: Seconds between two retention sweeps: records go by whole days, so an hour late
#: is nothing, and an idle sweep costs one listing request.
AUDIT_SWEEP_INTERVAL: Final = 3600.0


class Auditor:
    """Writes audit records. Never fails the action it records: a failed write is logged."""

    def __init__(self, store: ObjectStore, clock: Clock = utc_now) -> None:
        self._store = store
        self._clock = clock

    async def record(
        self, actor: str, action: str, target: str, account_id: str = "", outcome: str = "ok"
    ) -> AuditRecord:
        """Write one record (who, what, on what, result) and return it."""
        now = self._clock()
        rec = AuditRecord(
            audit_id=new_id("audit"),
            at=now,
            actor=actor,
            action=action,
            target=target,
            account_id=account_id,
            outcome=outcome,
        )
        try:
            await self._store.put(audit_key(now, rec.audit_id), encode(rec), if_none_match=True)
        except AgentsError as e:
            logger.error("audit %s %s: cannot write: %s", action, target, e)
        return rec


class AuditRetention:
    """Removes the audit records of every UTC day that ended more than ``keep`` ago
    (see the module doc): a record is kept at least ``keep``, at most a day more."""

    def __init__(
        self,
        store: ObjectStore,
        keep: dt.timedelta,
        clock: Clock = utc_now,
        on_removed: Callable[[int], None] | None = None,
        may_expire: Callable[[], bool] | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> None:
        self._store = store
        self._keep = keep
        self._clock = clock
        self._on_removed = on_removed
        # Nothing goes for its age while our clock disagrees with the store's
        # (controlplane.integrity.clock): a clock a year ahead would erase a year.
        self._may_expire = may_expire
        self._page_size = page_size

    async def sweep(self) -> int:
        """Remove the records older than the retention; return how many went
        (none while the clocks disagree)."""
        if self._may_expire is not None and not self._may_expire():
            return 0
        cutoff = (self._clock() - self._keep).astimezone(dt.UTC).date()
        # Every key of a day before the cutoff sorts before this; its own day's after.
        boundary = f"{AUDIT_PREFIX}{cutoff:%Y/%m/%d}/"
        removed = 0
        # Deleting keys behind the listing's cursor does not disturb it (as the
        # account deletion's sweep relies on too: controlplane.deletion.sweep).
        async for page in self._store.list_pages(AUDIT_PREFIX, page_size=self._page_size):
            old = [info.key for info in page if info.key < boundary]
            if old:
                await delete_keys(self._store, old)
                removed += len(old)
                if self._on_removed is not None:
                    self._on_removed(len(old))
            if len(old) < len(page):
                break  # the first day still kept: every later key is newer
        if removed:
            logger.info("audit: removed %d record(s) from before %s", removed, cutoff)
        return removed

    async def run(self, interval: float = AUDIT_SWEEP_INTERVAL) -> None:
        """Sweep now and every ``interval`` seconds; a failure is logged once per
        outage (shared.outage) and the next tick tries again."""
        set_cause("retention")
        outage = OutageLog(logger, "audit retention")
        while True:
            try:
                await self.sweep()
            except AgentsError as e:
                outage.failed(e)
            else:
                outage.recovered()
            await asyncio.sleep(interval)
