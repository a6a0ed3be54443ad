"""Attachments: content-addressed files under ``attachments/<sha256>``.

An upload streams into a temp file in the same folder while it is hashed and
counted; over the limit, the temp file is removed and TooLarge raised, so
nothing is left. A complete upload is fsync'd, renamed to its hash (0600) and
the folder fsync'd, then recorded against the agent that will use it. A
process killed mid-upload leaves its temp file behind: :func:`remove_partial_uploads`
deletes those when the machine opens, before any upload can start.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from machine.models import AttachmentRecord
from machine.storage import tables
from machine.storage.db import Database
from machine.storage.faults import is_disk_full
from shared.atomic import ensure_private_dir, fsync_dir
from shared.errors import DiskFull, InvalidArgument, InvalidId, NotFound, TooLarge
from shared.ids import validate_id, validate_sha256

__all__ = ["AttachmentStore", "remove_partial_uploads", "unnamed_attachment_files"]

logger = logging.getLogger(__name__)

_MAX_FILE_NAME = 255
_TMP_PREFIX = ".upload-"
_TMP_SUFFIX = ".tmp"


class AttachmentStore:
    """Stores uploads and answers which agent may use which attachment."""

    def __init__(
        self,
        db: Database,
        folder: Path,
        *,
        limit: int,
        machine_id: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._db = db
        self.folder = folder
        self.limit = limit
        self._machine_id = machine_id
        self._clock = clock

    def path(self, sha256: str) -> Path:
        """Where an attachment's bytes live."""
        return self.folder / validate_sha256(sha256)

    async def upload(
        self, *, agent_id: str, file_name: str, declared_size: int, chunks: AsyncIterator[bytes]
    ) -> AttachmentRecord:
        """Store ``chunks`` for ``agent_id``; TooLarge (field ``attachment``) over the limit."""
        validate_id("agent", agent_id, "agent_id")
        if len(file_name) > _MAX_FILE_NAME or "/" in file_name or "\x00" in file_name:
            raise InvalidArgument("file_name", "must be a plain file name of at most 255 bytes")
        if declared_size < 0:
            raise InvalidArgument("size", "must not be negative")
        if declared_size > self.limit:
            raise TooLarge("attachment", self.limit, declared_size)
        await self._db.read(lambda c: tables.get_agent(c, agent_id, self._machine_id))
        ensure_private_dir(self.folder)
        tmp = self.folder / f"{_TMP_PREFIX}{secrets.token_hex(8)}{_TMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        digest = hashlib.sha256()
        size = 0
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.limit:
                        raise TooLarge("attachment", self.limit, size)
                    digest.update(chunk)
                    await asyncio.to_thread(f.write, chunk)
                f.flush()
                await asyncio.to_thread(os.fsync, f.fileno())
            sha = digest.hexdigest()
            final = self.folder / sha
            await asyncio.to_thread(_commit_file, tmp, final)
        except BaseException as e:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            if is_disk_full(e):
                # The data folder is the attachments folder's parent.
                what = f"upload attachment for agent {agent_id}"
                raise DiskFull(what, str(self.folder.parent)) from e
            raise
        now = self._clock()

        def write(conn: sqlite3.Connection) -> None:
            tables.get_agent(conn, agent_id, self._machine_id)
            tables.record_attachment(conn, sha, size, now)
            tables.add_attachment_ref(conn, sha, agent_id, file_name=file_name, now=now)

        await self._db.write(write, what=f"upload attachment for agent {agent_id}")
        logger.info("attachment %s (%d bytes) stored for %s", sha[:12], size, agent_id)
        return AttachmentRecord(sha, size, agent_id, file_name)

    def check_usable(self, conn: sqlite3.Connection, agent_id: str, sha256: str) -> Path:
        """In a transaction: the attachment is recorded for the agent and on disk."""
        validate_sha256(sha256, "attachments")
        path = self.folder / sha256
        if not tables.attachment_referenced(conn, sha256, agent_id) or not path.exists():
            raise NotFound("attachment", sha256)
        return path


def remove_partial_uploads(folder: Path) -> int:
    """Delete upload temp files left in ``folder`` by a killed process; return how
    many. Call only while no upload can be in progress (when the machine opens)."""
    removed = 0
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return 0
    for entry in entries:
        name = entry.name
        if not (name.startswith(_TMP_PREFIX) and name.endswith(_TMP_SUFFIX)):
            continue
        if not entry.is_file(follow_symlinks=False) and not entry.is_symlink():
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        removed += 1
    if removed:
        fsync_dir(folder)
        logger.info("removed %d unfinished attachment upload(s) from %s", removed, folder)
    return removed


def _commit_file(tmp: Path, final: Path) -> None:
    os.chmod(tmp, 0o600)
    os.replace(tmp, final)  # same content, same name: replacing an existing copy is harmless
    fsync_dir(final.parent)


def _is_sha256(name: str) -> bool:
    try:
        validate_sha256(name)
    except InvalidId:
        return False
    return True


def _files_older_than(folder: Path, cutoff: float) -> list[str]:
    names = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(folder):
            if not _is_sha256(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            with contextlib.suppress(FileNotFoundError):
                if entry.stat(follow_symlinks=False).st_mtime <= cutoff:
                    names.append(entry.name)
    return names


async def unnamed_attachment_files(
    db: Database, folder: Path, *, min_age: float, now: float | None = None
) -> list[str]:
    """sha256 names of attachment files at least ``min_age`` old that no agent names."""
    cutoff = (time.time() if now is None else now) - min_age
    names = await asyncio.to_thread(_files_older_than, folder, cutoff)
    if not names:
        return []
    return await db.read(
        lambda c: tables.unreferenced_attachments(c, names), what="read attachments"
    )
