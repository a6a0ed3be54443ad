"""One account deletion's state, as its tombstone and its ``deleted/`` record hold it.

:class:`Deletion` is what ``accounts/<a>/deleting.json`` (the tombstone, written
at the deletion's commit point, its count saved as the sweep goes) and
``deleted/<a>.json`` (written once the account's objects are gone) store, and
what ``GetDeletion`` reports. The order they are written and removed in, and
what a crash leaves, is :mod:`controlplane.deletion.service`'s.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from controlplane.integrity.records import parse_time, utc_iso
from shared.ids import validate_id

__all__ = ["Deletion"]


@dataclass(frozen=True)
class Deletion:
    """One account deletion, running or finished."""

    account_id: str
    state: str
    """"deleting" or "deleted"."""
    started_at: dt.datetime
    deleted_by: str
    """The credential id that asked for it."""
    finished_at: dt.datetime | None = None
    deleted_objects: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The stored form (tombstone and ``deleted/`` record)."""
        out: dict[str, Any] = {
            "account_id": self.account_id,
            "state": self.state,
            "started_at": utc_iso(self.started_at),
            "deleted_by": self.deleted_by,
            "deleted_objects": self.deleted_objects,
        }
        if self.finished_at is not None:
            out["finished_at"] = utc_iso(self.finished_at)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], state: str) -> Deletion:
        """Inverse of :meth:`to_dict`."""
        finished = data.get("finished_at")
        return cls(
            account_id=validate_id("account", str(data.get("account_id", "")), "account_id"),
            state=state,
            started_at=parse_time(str(data["started_at"])),
            deleted_by=str(data.get("deleted_by", "")),
            finished_at=parse_time(str(finished)) if finished else None,
            deleted_objects=int(data.get("deleted_objects", 0) or 0),
        )
