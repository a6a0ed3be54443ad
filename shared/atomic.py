"""Durable file writes: temp file, fsync, rename, fsync the folder.

A reader sees either the old file or the new one, never a torn write, and a
power cut after the function returns loses nothing.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "ensure_private_dir",
    "fsync_dir",
    "is_stale_temp",
    "open_atomic",
    "sweep_tagged_temps",
    "write_atomic",
]

logger = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
#: A temp file untouched this long is debris of a crashed write.
STALE_TEMP_SECONDS = 3600.0


def fsync_dir(path: Path) -> None:
    """fsync a directory so that a rename or unlink inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_private_dir(path: Path, mode: int = DIR_MODE) -> Path:
    """Create ``path`` (and parents) if needed and force its mode to ``mode``.

    Each folder it creates is made durable by fsyncing its parent: a file
    written inside it later must not vanish with the folder after a power cut.
    """
    missing: list[Path] = []
    cur = path
    while not cur.exists():
        missing.append(cur)
        if cur.parent == cur:
            break
        cur = cur.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, mode)
        except FileExistsError:
            continue  # made concurrently
        fsync_dir(folder.parent)
    if not path.is_dir():  # a file there: never chmod what is not our folder
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(path))
    os.chmod(path, mode)
    return path


def is_stale_temp(name: str, mtime: float, now: float, age: float = STALE_TEMP_SECONDS) -> bool:
    """Whether ``name`` is a temp file of :func:`open_atomic` left by a crash.

    Only files untouched for ``age`` seconds count, so a write in progress in
    another process is never taken for debris.
    """
    return name.startswith(".") and name.endswith(".tmp") and now - mtime > age


def _temp_name(path: Path, tag: str = "") -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}{tag}.tmp")


def sweep_tagged_temps(folder: Path, tag: str, age: float = STALE_TEMP_SECONDS) -> list[Path]:
    """Remove the temp files :func:`open_atomic` made with ``tag`` in ``folder`` that
    a killed writer left: this user's regular files, untouched for ``age`` seconds
    (a write in progress elsewhere is never one). Return those removed.

    For folders that are not ours (a user's export destination): the tag tells
    our debris from anyone else's ``.tmp`` files, which are never touched.
    """
    pattern = re.compile(rf"\A\..+\.[0-9a-f]{{12}}{re.escape(tag)}\.tmp\Z", re.DOTALL)
    removed: list[Path] = []
    now = time.time()
    uid = os.getuid()
    with os.scandir(folder) as entries:
        for entry in entries:
            if not pattern.match(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                mine = stat.S_ISREG(st.st_mode) and st.st_uid == uid
                if mine and is_stale_temp(entry.name, st.st_mtime, now, age):
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
            except FileNotFoundError:
                continue  # removed meanwhile
    return removed


@contextlib.contextmanager
def open_atomic(
    path: Path,
    mode: int = FILE_MODE,
    *,
    create_new: bool = False,
    tag: str = "",
    sync_dir: bool = True,
) -> Iterator[BinaryIO]:
    """Yield a binary file that replaces ``path`` atomically when the block ends.

    If the block raises, the temp file is removed and ``path`` is untouched.
    With ``create_new``, an existing ``path`` is never replaced, even one made
    while the block ran: FileExistsError, and the temp file is removed. ``tag``
    goes in the temp file's name (see :func:`sweep_tagged_temps`). With
    ``sync_dir`` False the rename is not made durable here: the caller fsyncs
    ``path.parent`` itself (after letting go of a lock, say) before it counts
    the write as done.
    """
    tmp = _temp_name(path, tag)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        if create_new:
            os.link(tmp, path)  # fails if path exists: no check-then-replace race
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def write_atomic(path: Path, data: bytes | Iterable[bytes], mode: int = FILE_MODE) -> None:
    """Write ``data`` (bytes or an iterable of chunks) to ``path`` durably."""
    with open_atomic(path, mode) as f:
        if isinstance(data, bytes | bytearray | memoryview):
            f.write(data)
        else:
            for chunk in data:
                f.write(chunk)
