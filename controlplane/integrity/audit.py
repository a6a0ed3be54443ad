"""The audit trail: one create-once JSON object per action under ``audit/``."""

from __future__ import annotations

import logging

from controlplane.integrity.records import AuditRecord, audit_key, encode
from shared.errors import AgentsError
from shared.ids import new_id
from shared.store.base import ObjectStore
from shared.timestamps import Clock, utc_now

__all__ = ["Auditor"]

logger = logging.getLogger(__name__)


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
