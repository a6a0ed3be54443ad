"""The clean-stop mark: why a start after a clean stop need not read all of machine.db.

A start used to run SQLite's ``quick_check`` before opening machine.db for
writing, so that a damaged file is never written on. The check reads every
page: 2 s warm on a 2.2 GB file, over 30 s cold after a reboot, and it grows
with the history kept. What it guards against at start is damage done while
the daemon was not running: a crash in the middle of a write (SQLite's own
journal covers that, but a lying disk cache does not), or something else
writing into the file.

So the last thing a clean stop does, once every connection is closed and the
WAL is folded into the file, is write this mark: the file's inode, size,
modification and change times, and a hash of its first page. The next open
takes the mark away (durably, before anything else happens) and skips the
check only when the file still matches it exactly. Anything else (no mark: a
SIGKILL, a power cut, a crash; a WAL left beside the file; a file written,
copied, restored or touched since) gets the full ``quick_check`` at start, as
before.

The change time is set by the kernel and nobody can set it back, but it moves
in coarse ticks: a write landing in the same tick as the stop could leave every
figure unchanged. The mark is therefore published only once the kernel's
clock has moved past the file's change time (seen on the mark's own temp file,
never on the wall clock, which a test or an operator may have moved); a stop
that cannot see that within a second writes no mark.

What the mark cannot see is a disk that flips bits under an unchanged inode.
That is what the quick check started in the background after such a start
(writes not held) and the scheduled ``integrity_check`` are for, and SQLite
reports a damaged page it reads at any time (see :mod:`machine.storage.faults`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from shared.atomic import fsync_dir, open_atomic

__all__ = ["FileIdentity", "mark_path", "take_mark", "write_mark"]

logger = logging.getLogger(__name__)

_VERSION = 1
#: How long a stop waits for the kernel's clock to tick past the file's change time.
_TICK_WAIT = 1.0
_HEADER_BYTES = 4096


@dataclass(frozen=True)
class FileIdentity:
    """What must be unchanged for a file to be the one a clean stop left."""

    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    header_sha256: str


def mark_path(db_path: Path) -> Path:
    """Where the mark for ``db_path`` lives: beside it."""
    return db_path.with_name(db_path.name + ".clean-stop")


def _wal_in_use(db_path: Path) -> bool:
    wal = db_path.with_name(db_path.name + "-wal")
    try:
        return wal.stat().st_size > 0
    except FileNotFoundError:
        return False


def identity(db_path: Path) -> FileIdentity | None:
    """``db_path``'s identity now; None when it does not exist."""
    try:
        fd = os.open(db_path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        header = os.pread(fd, _HEADER_BYTES, 0)
    finally:
        os.close(fd)
    return FileIdentity(
        st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, hashlib.sha256(header).hexdigest()
    )


def write_mark(db_path: Path) -> bool:
    """Record that ``db_path`` was closed cleanly (call after its last connection
    closed). Returns False, writing nothing, when the file cannot be vouched for:
    a WAL is still in use beside it, or the clock did not tick in time."""
    if _wal_in_use(db_path):
        logger.info("%s: a WAL is still in use at stop; the next start checks the file", db_path)
        return False
    ident = identity(db_path)
    if ident is None:
        return False
    payload = json.dumps({"version": _VERSION, **asdict(ident)}).encode()
    mark = mark_path(db_path)
    try:
        with open_atomic(mark) as f:
            f.write(payload)
            f.flush()
            deadline = time.monotonic() + _TICK_WAIT
            # The temp file's times come from the same kernel clock as the
            # database's: once they are past its change time, any later write to
            # the database gets a change time the mark does not hold.
            while os.fstat(f.fileno()).st_mtime_ns <= ident.ctime_ns:
                if time.monotonic() > deadline:
                    raise TimeoutError("the file-time clock did not move")
                time.sleep(0.002)
                os.utime(f.fileno())
    except (OSError, TimeoutError) as e:
        logger.warning("%s: no clean-stop mark (%s); the next start checks the file", db_path, e)
        return False
    return True


def take_mark(db_path: Path) -> bool:
    """Remove the mark (durably) and say whether ``db_path`` is still exactly the
    file the last clean stop left, and so needs no check before it is written.

    Call before anything opens the database: from here on a crash leaves no
    mark, and the start after it checks the file.
    """
    mark = mark_path(db_path)
    try:
        raw = mark.read_bytes()
    except FileNotFoundError:
        return False
    mark.unlink()
    fsync_dir(mark.parent)
    recorded: FileIdentity | None = None
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        data = json.loads(raw)
        if data.pop("version") == _VERSION:
            recorded = FileIdentity(**data)
    if recorded is None:
        logger.warning("%s: unreadable clean-stop mark; checking the file", mark)
        return False
    if _wal_in_use(db_path):
        return False
    return identity(db_path) == recorded
