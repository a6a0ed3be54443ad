"""Attachments: content-addressed files under ``attachments/<sha256>``.

An upload streams into a temp file in the same folder while it is hashed and
counted; over the limit, the temp file is removed and TooLarge raised, so
nothing is left. A complete upload is fsync'd, renamed to its hash (0600) and
the folder fsync'd, then recorded against the agent that will use it. A
process killed mid-upload leaves its temp file behind: :func:`remove_partial_uploads`
deletes those when the machine opens, before any upload can start.

Each upload records a media type (``type/subtype``): the one its header
declares, else one guessed from the file name, else
``application/octet-stream`` (:func:`media_type_for`).

An attachment id that is not a SHA-256 answers exactly as an unknown one
(NotFound): a caller learns nothing more from a malformed id than from a wrong
one. A directory standing where an attachment's file goes (made by hand, or by
a tool run in the data folder) is refused as FAILED_PRECONDITION naming it,
and logged once per attachment per process, never read or replaced.
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

from machine.formats.media_types import media_type_for
from machine.models import AttachmentRecord
from machine.storage import tables
from machine.storage.db import Database
from machine.storage.faults import is_disk_full
from shared.atomic import ensure_private_dir, fsync_dir
from shared.errors import (
    DiskFull,
    InvalidArgument,
    InvalidId,
    InvalidState,
    NotFound,
    TooLarge,
)
from shared.ids import validate_id, validate_sha256

__all__ = [
    "AttachmentStore",
    "remove_partial_uploads",
    "unnamed_attachment_files",
]

logger = logging.getLogger(__name__)

_MAX_FILE_NAME = 255
_TMP_PREFIX = ".upload-"
_TMP_SUFFIX = ".tmp"


def _shown(value: str) -> str:
    """An id as an error message may carry it: bounded, printable ASCII only."""
    clean = "".join(c if " " < c < "\x7f" else "?" for c in value)
    return clean if len(clean) <= 64 else clean[:61] + "..."


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
        # Attachments found with a directory for a file: each logged once.
        self._dirs_logged: set[str] = set()

    def path(self, sha256: str) -> Path:
        """Where an attachment's bytes live."""
        return self.folder / validate_sha256(sha256)

    async def upload(
        self,
        *,
        agent_id: str,
        file_name: str,
        declared_size: int,
        chunks: AsyncIterator[bytes],
        media_type: str = "",
    ) -> AttachmentRecord:
        """Store ``chunks`` for ``agent_id``; TooLarge (field ``attachment``) over the limit.

        ``media_type`` is the header's (empty: guessed, see :func:`media_type_for`).
        """
        validate_id("agent", agent_id, "agent_id")
        if len(file_name) > _MAX_FILE_NAME or "/" in file_name or "\x00" in file_name:
            raise InvalidArgument("file_name", "must be a plain file name of at most 255 bytes")
        media_type = media_type_for(media_type, file_name)
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
            if final.is_dir():
                raise self._directory(sha, final)
            try:
                await asyncio.to_thread(_commit_file, tmp, final)
            except IsADirectoryError:  # one made since the check
                raise self._directory(sha, final) from None
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
            tables.add_attachment_ref(
                conn, sha, agent_id, file_name=file_name, media_type=media_type, now=now
            )

        await self._db.write(write, what=f"upload attachment for agent {agent_id}")
        logger.info("attachment %s (%d bytes) stored for %s", sha[:12], size, agent_id)
        return AttachmentRecord(sha, size, agent_id, file_name, media_type=media_type)

    def check_usable(self, conn: sqlite3.Connection, agent_id: str, sha256: str) -> Path:
        """In a transaction: the attachment is recorded for the agent and its file
        is on disk. NotFound for an unknown or malformed id (one answer for both);
        InvalidState when a directory stands where the file should be."""
        if not _is_sha256(sha256) or not tables.attachment_referenced(conn, sha256, agent_id):
            raise NotFound("attachment", _shown(sha256))
        path = self.folder / sha256
        if path.is_dir():
            raise self._directory(sha256, path)
        if not path.exists():
            raise NotFound("attachment", sha256)
        return path

    def _directory(self, sha256: str, path: Path) -> InvalidState:
        """The refusal of an attachment whose file is a directory, logged once."""
        if sha256 not in self._dirs_logged:
            self._dirs_logged.add(sha256)
            logger.error(
                "attachment %s: %s is a directory, not the attachment's file; remove it "
                "and upload the file again",
                sha256,
                path,
            )
        return InvalidState(
            f"attachment {sha256}",
            "a directory stands where its file should be in the data folder; "
            "remove it and upload the file again",
        )


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
