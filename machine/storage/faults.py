"""What storage faults mean for machine.db: one table from SQLite/OS errors to ours.

Two faults get their own errors because the person running the machine can
act on them:

- a full disk (SQLITE_FULL, ENOSPC, EDQUOT) is :class:`~shared.errors.DiskFull`
  naming the data folder: not permanent, writes work again once space is freed;
- a damaged file (SQLITE_CORRUPT, SQLITE_NOTADB, or an integrity check that
  reports problems) is :class:`~shared.errors.DatabaseDamaged`: the database
  stops taking writes until it is restored.

Integrity checks run on a connection of their own, so a long full check
blocks neither the writer nor the reader.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shared.errors import AgentsError, DatabaseDamaged, DiskFull, IntegrityError, StoreError

__all__ = [
    "CheckResult",
    "damage_reason",
    "disk_full_named",
    "is_disk_full",
    "run_check",
    "translate",
]

logger = logging.getLogger(__name__)

# SQLite primary result codes (the low byte of an extended code).
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_NOTADB = 26
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# integrity_check stops after this many problems: enough to show, bounded to send.
_MAX_PROBLEMS = 100


def _primary_code(error: BaseException) -> int | None:
    code = getattr(error, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` means the disk (or the user's quota) is full."""
    if isinstance(error, DiskFull):
        return True
    if isinstance(error, OSError):
        return error.errno in _DISK_FULL_ERRNOS
    return _primary_code(error) == _SQLITE_FULL


@contextlib.contextmanager
def disk_full_named(what: str, data_dir: Path) -> Iterator[None]:
    """A full disk met inside the block (ENOSPC, EDQUOT) leaves it as
    :class:`~shared.errors.DiskFull` naming ``data_dir``; anything else as it was."""
    try:
        yield
    except OSError as e:
        if is_disk_full(e):
            raise DiskFull(what, str(data_dir)) from e
        raise


def damage_reason(error: BaseException) -> str | None:
    """SQLite's words when ``error`` says the file is damaged, else None."""
    if _primary_code(error) in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return str(error)
    return None


def translate(error: BaseException, what: str, path: Path) -> AgentsError | None:
    """Our error for a storage fault of ``path`` during ``what``; None for other errors."""
    if is_disk_full(error):
        return DiskFull(what, str(path.parent))
    reason = damage_reason(error)
    if reason is not None:
        return DatabaseDamaged(what, str(path), reason)
    if isinstance(error, sqlite3.OperationalError) and str(error).startswith("Could not decode"):
        # One stored value is not UTF-8: that value is lost, the file itself is
        # sound (SQLite does not check text encodings), so no DatabaseDamaged.
        return IntegrityError(what, f"a value stored in {path.name} is not valid UTF-8")
    return None


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one integrity check of machine.db."""

    full: bool
    """``integrity_check`` (True) or the faster ``quick_check`` (False)."""
    problems: tuple[str, ...]
    """What SQLite reported; empty when the file is sound."""
    finished_at: float
    seconds: float

    @property
    def ok(self) -> bool:
        """True when nothing was found."""
        return not self.problems


def run_check(path: Path, *, full: bool) -> CheckResult:
    """Run ``integrity_check`` (``full``) or ``quick_check`` on its own connection.

    A file SQLite cannot even read as a database is reported as a problem,
    not raised; a file it cannot open at all raises StoreError. Blocking:
    call it in a thread.
    """
    pragma = "integrity_check" if full else "quick_check"
    start = time.perf_counter()
    problems: list[str] = []
    try:
        conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=30)
        try:
            rows = conn.execute(f"PRAGMA {pragma}({_MAX_PROBLEMS})").fetchall()
        finally:
            conn.close()
        problems = [str(r[0]) for r in rows if str(r[0]) != "ok"]
    except sqlite3.Error as e:
        if damage_reason(e) is None:
            raise StoreError(f"check {path}: {e}") from e
        problems = [str(e)]
    seconds = time.perf_counter() - start
    return CheckResult(full, tuple(problems), time.time(), seconds)
