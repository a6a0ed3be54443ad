"""Replies of the machine daemon that no domain record carries whole.

:class:`machine.cli.client.MachineClient` returns domain records where one holds
the whole reply (an agent, a run, an event) and these small views where the
wire form joins several records or keeps numbers the domain does not (a
backup's size on the target, a verify's duration in milliseconds).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from machine.app import MachineStatus
from machine.backups.service import BackupStatus
from machine.models import ScheduleRecord, SearchHit

__all__ = [
    "BackupProgress",
    "BackupView",
    "DaemonStatus",
    "DatabaseCheck",
    "RecoveryKeyText",
    "ScheduleView",
    "SearchResult",
    "VerifyReport",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DaemonStatus:
    """What ``status`` answers: the daemon's version, its counts, its backups."""

    version: str
    machine: MachineStatus
    backup: BackupStatus | None
    """None when the daemon has no backup service."""


@dataclass(frozen=True)
class DatabaseCheck:
    """A full integrity check of machine.db, run by the daemon."""

    ok: bool
    problems: tuple[str, ...]
    path: str
    checked_at: float | None
    duration_ms: int


@dataclass(frozen=True)
class ScheduleView:
    """A schedule and when it fires next (None: not while paused)."""

    schedule: ScheduleRecord
    next_run_at: float | None


@dataclass(frozen=True)
class SearchResult:
    """Search matches, and how many restored agents are still being indexed."""

    hits: tuple[SearchHit, ...]
    indexing: int


@dataclass(frozen=True)
class BackupView:
    """A backup just made, or one stored at the target.

    ``opens`` is False for a backup that does not open with this machine's key:
    then only ``id``, ``created_at`` and ``size_bytes`` are known, and
    ``problem`` says why ("another key", or "refused: ..." when forged or altered).
    """

    id: str
    created_at: float | None
    agents: int
    uploaded_bytes: int
    size_bytes: int
    segments: int
    uploaded_segments: int
    opens: bool
    pruned: tuple[str, ...]
    problem: str = ""
    increments: int = 0
    """Continuous backups' increments continuing it (listings)."""
    newest_increment_at: float | None = None


@dataclass(frozen=True)
class BackupProgress:
    """One step of a running backup: ``done`` of ``total`` in ``stage``."""

    stage: str
    done: int
    total: int


@dataclass(frozen=True)
class VerifyReport:
    """A backup opened and every segment authenticated."""

    ok: bool
    segments: int
    plain_bytes: int
    duration_ms: int


@dataclass(frozen=True)
class RecoveryKeyText:
    """A new recovery key pair in its text form; the private half is shown once."""

    private_key: str
    public_key: str

    def __repr__(self) -> str:
        # Never let the private half reach a log line or a traceback.
        return f"RecoveryKeyText(public_key={self.public_key!r})"
