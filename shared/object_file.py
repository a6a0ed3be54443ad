"""The file format of a folder store's objects, and an object being written.

Each object is one file: a fixed-size header holding the SHA-256 of the
content (its etag), then the content. Kept apart from :mod:`shared.store`
(whose package loads the metrics and the S3 client) so that a worker process
writing objects for the daemon (machine.backups.workers.segment_workers) imports only this.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import BinaryIO, Final

from shared.errors import IntegrityError

__all__ = ["HEADER_LEN", "UNFINISHED", "PendingObject", "header", "parse_header"]

_MAGIC: Final = b"agents-object-v1 sha256:"
#: Bytes before an object's content in its file.
HEADER_LEN: Final = len(_MAGIC) + 64 + 1
#: The etag in the header of an object still being written.
UNFINISHED: Final = "0" * 64


def header(etag: str) -> bytes:
    """The header of an object whose content has SHA-256 ``etag`` (hex)."""
    return _MAGIC + etag.encode("ascii") + b"\n"


def parse_header(raw: bytes, key: str) -> str:
    """The etag in an object's first :data:`HEADER_LEN` bytes; IntegrityError if
    they are not a header."""
    if len(raw) != HEADER_LEN or not raw.startswith(_MAGIC) or not raw.endswith(b"\n"):
        raise IntegrityError(f"object {key}", "missing or damaged header")
    return raw[len(_MAGIC) : -1].decode("ascii", "replace")


class PendingObject:
    """An object being written under a temp name (not visible yet), as
    :meth:`~shared.store.folder.FolderStore.begin_unsynced` and pack writers make them."""

    def __init__(self, key: str, path: Path, temp: Path, f: BinaryIO | None) -> None:
        self.key = key
        self.path = path
        self.temp = temp
        self._f: BinaryIO | None = f
        self._hash = hashlib.sha256()
        self.size = 0
        #: Its bytes are durable already (closed with ``sync``): publish skips it.
        self.synced = False
        #: Published over an object already stored under its key (one found
        #: damaged), instead of kept create-once.
        self.replace = False

    def write(self, chunk: bytes) -> None:
        """Append ``chunk`` (blocking)."""
        assert self._f is not None, "write after close"
        self._hash.update(chunk)
        self._f.write(chunk)
        self.size += len(chunk)

    def close(self, *, sync: bool = False) -> str:
        """Finish the file (its header names the content's SHA-256); return the etag.

        With ``sync`` its bytes are made durable now, in the caller's thread (a
        writer of many objects overlaps their fsyncs with its other work,
        instead of :meth:`~shared.store.folder.FolderStore.publish` making them all at its end).
        """
        assert self._f is not None, "closed twice"
        etag = self._hash.hexdigest()
        self._f.seek(0)
        self._f.write(header(etag))
        if sync:
            self._f.flush()
            os.fsync(self._f.fileno())
            self.synced = True
        self._f.close()
        self._f = None
        return etag

    @classmethod
    def create(cls, key: str, path: Path) -> PendingObject:
        """Start writing the object ``key``, stored at ``path``, under a temp name
        beside it (blocking; its folder exists): for a folder store's batched
        writes, and for a writer in another process whose objects a store publishes."""
        tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
        f = open(tmp, "xb")  # noqa: SIM115 - closed by PendingObject.close
        try:
            os.chmod(tmp, 0o600)
            f.write(header(UNFINISHED))
        except BaseException:
            f.close()
            tmp.unlink(missing_ok=True)
            raise
        return cls(key, path, tmp, f)

    @classmethod
    def adopt(cls, key: str, path: Path, temp: Path) -> PendingObject:
        """The object ``key`` that another process wrote and closed at ``temp``
        (beside ``path``), ready for a folder store to publish, which fsyncs it
        again (blocking): a finished header does not prove its writer's fsync ran.

        IntegrityError if its header is not finished: a writer that did not close it.
        """
        with open(temp, "rb") as f:
            raw = f.read(HEADER_LEN)
        try:
            etag = parse_header(raw, key)
        except IntegrityError:
            etag = UNFINISHED  # not even its header reached the file
        if etag == UNFINISHED:
            raise IntegrityError(f"object {key}", "its writer did not finish it")
        return cls(key, path, temp, None)

    def discard(self) -> None:
        """Drop the unfinished or unpublished object (blocking)."""
        if self._f is not None:
            self._f.close()
            self._f = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temp)
