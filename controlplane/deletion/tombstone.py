"""One account deletion's state, as its tombstone and its ``deleted/`` record hold it.

:class:`Deletion` is what ``accounts/<a>/deleting.json`` (the tombstone, written
at the deletion's commit point) and ``deleted/<a>.json`` (written once the
account's objects are gone) store, and what ``GetDeletion`` reports. The order
they are written and removed in, and what a crash leaves, is
:mod:`controlplane.deletion.service`'s.

:class:`SweepProgress` is what the tombstone keeps of the sweep so that a
resumed run counts on from where the last one stopped (its object count, and
what it already counted): :mod:`controlplane.deletion.sweep` writes it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from controlplane.integrity.records import parse_time, utc_iso
from shared.ids import validate_id

__all__ = ["Deletion", "SweepProgress"]


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


@dataclass
class SweepProgress:
    """The sweep's count as the tombstone saves it (``deleted_objects`` and ``sweep``).

    Each batch the listing finds is counted, and the count saved, BEFORE its
    delete, with the batch's key range in ``counted``: a run resumed after a
    crash has the count of everything deleted, and deletes the keys of a
    counted range that are left without counting them again. The named
    segments (deleted by name, found again by a resumed run whatever the last
    one deleted) are counted by one run from start to end: their count is saved
    once, with ``segments_done``, and a resumed run skips that step.
    """

    deleted: int = 0
    """Objects counted: deleted, or in a ``counted`` range and deleted next."""
    segments_done: bool = False
    """The named segments are gone, and their count is in ``deleted``."""
    counted: list[tuple[str, str]] = field(default_factory=list)
    """First and last key of each counted batch whose delete may not have happened."""

    @classmethod
    def from_tombstone(cls, tomb: dict[str, Any]) -> SweepProgress:
        """What ``tomb`` saved (a tombstone of an older release: its count only)."""
        sweep = tomb.get("sweep")
        sweep = sweep if isinstance(sweep, dict) else {}
        ranges = sweep.get("counted")
        return cls(
            deleted=int(tomb.get("deleted_objects", 0) or 0),
            segments_done=sweep.get("segments_done") is True,
            counted=[
                (str(r[0]), str(r[1]))
                for r in (ranges if isinstance(ranges, list) else [])
                if isinstance(r, list) and len(r) == 2
            ],
        )

    def to_tombstone(self, tomb: dict[str, Any]) -> dict[str, Any]:
        """``tomb`` with this progress in it."""
        return {
            **tomb,
            "deleted_objects": self.deleted,
            "sweep": {
                "segments_done": self.segments_done,
                "counted": [[first, last] for first, last in self.counted],
            },
        }

    def was_counted(self, key: str) -> bool:
        """Whether ``key`` lies in a counted range (counted before, maybe not deleted)."""
        return any(first <= key <= last for first, last in self.counted)
