"""An object store in a local folder: each object one file.

Layout: the object ``a/b/c`` is the file ``<root>/a/b/c``. Each file starts
with a fixed-size header holding the SHA-256 of its content (the etag), so
``head`` and ``list`` read a few bytes instead of hashing whole objects, and
``get`` can verify the content. Writes go temp file -> fsync -> rename ->
fsync the folder (:mod:`shared.atomic`); conditional writes and every rename
or unlink run under an asyncio lock plus ``fcntl.flock`` on ``<root>/.lock``,
so two processes sharing one folder keep compare-and-swap correct. Files are
0600, folders 0700. Blocking I/O runs in worker threads, in bounded chunks.

Limits of a file system that an S3 bucket does not have: a key cannot also
be a folder of other keys (``a`` and ``a/b`` cannot coexist); such a put is
refused with InvalidArgument.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Generator
from pathlib import Path
from typing import BinaryIO, Final

from shared.atomic import DIR_MODE, ensure_private_dir, fsync_dir, is_stale_temp, open_atomic
from shared.errors import (
    IntegrityError,
    InvalidArgument,
    NotFound,
    PreconditionFailed,
    StoreError,
)
from shared.object_file import HEADER_LEN as _HEADER_LEN
from shared.object_file import UNFINISHED as _UNFINISHED
from shared.object_file import PendingObject
from shared.object_file import header as _header
from shared.object_file import parse_header as _parse_header
from shared.store.base import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PAGE_SIZE,
    ObjectInfo,
    PutData,
    StoreBase,
    check_conditions,
    check_sizes,
    iter_chunks,
    validate_key,
    validate_prefix,
)

__all__ = ["FolderStore", "PendingObject"]

logger = logging.getLogger(__name__)

_WRITE_CHUNK: Final = 1024 * 1024
_LOCK_NAME: Final = ".lock"
# A concurrent delete may prune the folder a put just created; retry that often.
_MKDIR_ATTEMPTS: Final = 5


def _sync_folder(folder: Path) -> None:
    """fsync ``folder``; gone already (a delete since pruned it) is nothing to do."""
    with contextlib.suppress(FileNotFoundError):
        fsync_dir(folder)


class FolderStore(StoreBase):
    """An :class:`~shared.store.base.ObjectStore` in the folder ``root``."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).absolute()
        self._alock = asyncio.Lock()
        self._lock_fd: int | None = None
        self._root_ready = False

    @classmethod
    async def open(cls, root: Path | str) -> FolderStore:
        """Create the root if needed and sweep debris of crashed writes."""
        store = cls(root)
        await asyncio.to_thread(store._ensure_root)
        return store

    @property
    def root_made(self) -> bool:
        """Whether the root was made or found (opened, or written to) by this store."""
        return self._root_ready

    async def __aenter__(self) -> FolderStore:
        await asyncio.to_thread(self._ensure_root)
        return self

    # -- helpers (blocking; run in worker threads) ------------------------

    def _ensure_root(self) -> None:
        if not self._root_ready:
            if self.root.exists() and not self.root.is_dir():
                raise InvalidArgument("store", f"{self.root} is not a folder")
            ensure_private_dir(self.root)
            self._sweep_stale_temps()
            self._root_ready = True

    def _sweep_stale_temps(self) -> None:
        """Remove temp files of writes that crashed (hidden from listings, they
        would otherwise outlive every delete of their prefix)."""
        now = time.time()
        removed = 0
        for folder, _dirs, files in os.walk(self.root):
            for name in files:
                path = Path(folder) / name
                with contextlib.suppress(FileNotFoundError):
                    if is_stale_temp(name, path.stat().st_mtime, now):
                        path.unlink()
                        removed += 1
        if removed:
            logger.info("folder store %s: removed %d stale temp files", self.root, removed)

    def _only_stale_temps_left(self, folder: Path) -> bool:
        """Remove ``folder``'s stale temp files when nothing else is in it; False,
        at the first entry that stays, otherwise.

        A delete asks this of its object's folder: stopping at the first object
        keeps a delete O(1) in a folder of thousands (a whole scan each time
        made deleting a big prefix quadratic). Stale temps beside live objects
        are the start-up sweep's.
        """
        now = time.time()
        stale: list[str] = []
        with os.scandir(folder) as scan:
            for entry in scan:
                name = entry.name
                if not (name.startswith(".") and name.endswith(".tmp")):
                    return False
                try:
                    if not entry.is_file(follow_symlinks=False) or not is_stale_temp(
                        name, entry.stat().st_mtime, now
                    ):
                        return False
                except FileNotFoundError:
                    continue
                stale.append(entry.path)
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return True

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/"))

    def _make_parents(self, key: str) -> Path:
        self._ensure_root()
        path = self.root
        for segment in key.split("/")[:-1]:
            path = path / segment
            try:
                os.mkdir(path, DIR_MODE)
            except FileExistsError:
                if not path.is_dir():
                    raise InvalidArgument(
                        "key", f"{key!r} lies under an existing object in a folder store"
                    ) from None
            else:
                os.chmod(path, DIR_MODE)
                # The new folder's entry must be durable before the object in it is.
                fsync_dir(path.parent)
        return path

    # -- batched writes (blocking; for many create-once objects at a time) ------

    def begin_unsynced(self, key: str) -> PendingObject:
        """Start writing ``key`` under a temp name, with no fsync (blocking).

        For writers of many create-once objects (a backup's segments): write
        each with :meth:`PendingObject.write`, then make them all durable and
        visible at once with :meth:`publish`; one fsync pass for the batch
        instead of two fsyncs per object. Until published an object is a
        stale temp file to every reader and sweep, never a half-written object.
        """
        validate_key(key)
        self._make_parents(key)
        path = self._path(key)
        if path.is_dir():
            raise InvalidArgument("key", f"{key!r} is a folder of other objects in a folder store")
        return PendingObject.create(key, path)

    def make_folder(self, prefix: str) -> Path:
        """The folder of the keys under ``prefix`` (ending in "/"), made if needed
        (blocking): for writers of :meth:`PendingObject.create` objects."""
        validate_prefix(prefix)
        if not prefix.endswith("/"):
            raise InvalidArgument("prefix", f"{prefix!r} does not end with '/'")
        return self._make_parents(prefix + "x")

    def publish(self, pending: list[PendingObject]) -> None:
        """Make closed pending objects durable, then visible under their keys (blocking).

        Each temp file is fsynced before any is renamed, so a key never names
        an object whose bytes a crash could lose; an object already stored under
        its key is kept (create-once) and the temp file removed, unless the
        object is to :attr:`~PendingObject.replace` it. Then each folder is
        fsynced once.
        """
        for obj in pending:
            if obj.synced:
                continue
            fd = os.open(obj.temp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        folders: set[Path] = set()
        for obj in pending:
            if obj.path.exists() and not obj.replace:
                os.unlink(obj.temp)
            else:
                os.replace(obj.temp, obj.path)
            folders.add(obj.path.parent)
        for folder in folders:
            fsync_dir(folder)

    def _open_object(self, key: str) -> tuple[BinaryIO, str, int]:
        path = self._path(key)
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed by the caller
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound("object", key) from None
        except OSError as exc:
            raise StoreError(f"get {key}: {exc.strerror}") from None
        try:
            size = os.fstat(f.fileno()).st_size - _HEADER_LEN
            etag = _parse_header(f.read(_HEADER_LEN), key)
        except BaseException:
            f.close()
            raise
        return f, etag, size

    def _current_etag(self, key: str) -> str | None:
        try:
            f, etag, _ = self._open_object(key)
        except NotFound:
            return None
        f.close()
        return etag

    def _acquire_file_lock(self) -> None:
        if self._lock_fd is None:
            self._ensure_root()
            self._lock_fd = os.open(self.root / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)

    def _release_file_lock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    @contextlib.asynccontextmanager
    async def _locked(self) -> AsyncIterator[None]:
        """Hold the in-process lock, then the cross-process file lock."""
        async with self._alock:
            acquiring = asyncio.ensure_future(asyncio.to_thread(self._acquire_file_lock))
            try:
                await asyncio.shield(acquiring)
            except asyncio.CancelledError:
                # The thread may still win the lock after we were cancelled:
                # wait for it and let go, or the folder stays locked.
                with contextlib.suppress(Exception):
                    await acquiring
                    self._release_file_lock()
                raise
            try:
                yield
            finally:
                self._release_file_lock()

    # -- reads -------------------------------------------------------------

    def _read_all(self, key: str) -> bytes:
        f, etag, _ = self._open_object(key)
        with f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != etag:
            raise IntegrityError(f"object {key}", "content does not match its hash")
        return data

    async def get(self, key: str) -> bytes:
        """See :meth:`ObjectStore.get`. Raises IntegrityError on a corrupt file."""
        validate_key(key)
        return await asyncio.to_thread(self._read_all, key)

    async def get_stream(
        self, key: str, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> AsyncIterator[bytes]:
        """See :meth:`ObjectStore.get_stream`; the hash is checked at the end."""
        validate_key(key)
        check_sizes(chunk_size)
        f, etag, _ = await asyncio.to_thread(self._open_object, key)
        try:
            hasher = hashlib.sha256()
            while chunk := await asyncio.to_thread(f.read, chunk_size):
                hasher.update(chunk)
                yield chunk
            if hasher.hexdigest() != etag:
                raise IntegrityError(f"object {key}", "content does not match its hash")
        finally:
            f.close()

    async def head(self, key: str) -> ObjectInfo:
        """See :meth:`ObjectStore.head`."""
        validate_key(key)
        return await asyncio.to_thread(self.head_blocking, key)

    def open_blocking(self, key: str) -> BinaryIO:
        """The object at ``key`` open for reading, at its first byte (blocking; the
        caller closes it). NotFound if there is none, IntegrityError for a file
        that is not a store object."""
        validate_key(key)
        f, _, _ = self._open_object(key)
        return f

    def head_blocking(self, key: str) -> ObjectInfo:
        """:meth:`head` in the calling thread, for callers that look up many keys in one
        worker-thread call. NotFound if there is no object at ``key``."""
        validate_key(key)
        f, etag, size = self._open_object(key)
        f.close()
        return ObjectInfo(key, size, etag)

    # -- writes ------------------------------------------------------------

    async def _open_temp(
        self, key: str
    ) -> tuple[contextlib.AbstractContextManager[BinaryIO], BinaryIO]:
        path = self._path(key)
        for attempt in range(_MKDIR_ATTEMPTS):
            await asyncio.to_thread(self._make_parents, key)
            if await asyncio.to_thread(path.is_dir):
                raise InvalidArgument(
                    "key", f"{key!r} is a folder of other objects in a folder store"
                )
            # The folder is fsynced by put, after the lock (see there).
            manager = open_atomic(path, sync_dir=False)
            try:
                f = await asyncio.to_thread(manager.__enter__)
            except FileNotFoundError:
                if attempt + 1 == _MKDIR_ATTEMPTS:
                    raise
                continue
            return manager, f
        raise AssertionError("unreachable")

    def _write_temp(
        self, key: str, content: bytes
    ) -> tuple[contextlib.AbstractContextManager[BinaryIO], str]:
        """The temp file of a put of ``content``, written and fsynced (blocking: one
        worker-thread call where a streamed put takes one per step), and its etag."""
        path = self._path(key)
        etag = hashlib.sha256(content).hexdigest()
        for attempt in range(_MKDIR_ATTEMPTS):
            self._make_parents(key)
            if path.is_dir():
                raise InvalidArgument(
                    "key", f"{key!r} is a folder of other objects in a folder store"
                )
            manager = open_atomic(path, sync_dir=False)
            try:
                f = manager.__enter__()
            except FileNotFoundError:
                if attempt + 1 == _MKDIR_ATTEMPTS:
                    raise
                continue
            try:
                f.write(_header(etag))
                f.write(content)
                f.flush()
                # fsync outside the lock; open_atomic's own fsync then finds nothing dirty.
                os.fsync(f.fileno())
            except BaseException as exc:
                manager.__exit__(type(exc), exc, exc.__traceback__)
                raise
            return manager, etag
        raise AssertionError("unreachable")

    async def _stream_temp(
        self, key: str, data: PutData
    ) -> tuple[contextlib.AbstractContextManager[BinaryIO], str]:
        """The temp file of a put of streamed ``data``, chunk by chunk, and its etag."""
        manager, f = await self._open_temp(key)
        try:
            hasher = hashlib.sha256()
            await asyncio.to_thread(f.write, _header(_UNFINISHED))
            async for chunk in iter_chunks(data, _WRITE_CHUNK):
                hasher.update(chunk)
                await asyncio.to_thread(f.write, chunk)
            etag = hasher.hexdigest()

            def _finish_temp() -> None:
                f.seek(0)
                f.write(_header(etag))
                f.flush()
                # fsync outside the lock; open_atomic's own fsync then finds nothing dirty.
                os.fsync(f.fileno())

            await asyncio.to_thread(_finish_temp)
        except BaseException as exc:
            with contextlib.suppress(BaseException):
                await asyncio.to_thread(manager.__exit__, type(exc), exc, exc.__traceback__)
            raise
        return manager, etag

    async def put(
        self,
        key: str,
        data: PutData,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
    ) -> str:
        """See :meth:`ObjectStore.put`."""
        validate_key(key)
        check_conditions(if_none_match, if_match)
        if isinstance(data, bytes | bytearray | memoryview):
            manager, etag = await asyncio.to_thread(self._write_temp, key, bytes(data))
        else:
            manager, etag = await self._stream_temp(key, data)

        def _commit() -> None:
            # Under the lock: the check and the rename are one step for every writer.
            if if_none_match or if_match is not None:
                current = self._current_etag(key)
                if if_none_match and current is not None:
                    raise PreconditionFailed(key, "object already exists")
                if if_match is not None and current is None:
                    raise PreconditionFailed(key, "object does not exist")
                if if_match is not None and current != if_match:
                    raise PreconditionFailed(key, "etag does not match")
            manager.__exit__(None, None, None)

        try:
            async with self._locked():
                commit = asyncio.ensure_future(asyncio.to_thread(_commit))
                try:
                    await asyncio.shield(commit)
                except asyncio.CancelledError:
                    # The thread goes on: let it rename (or refuse) before the temp
                    # file is cleaned up below, never both at once.
                    with contextlib.suppress(Exception):
                        await commit
                    raise
        except BaseException as exc:
            with contextlib.suppress(BaseException):
                await asyncio.to_thread(manager.__exit__, type(exc), exc, exc.__traceback__)
            raise
        # The rename is durable before the put is answered, but made so outside the
        # lock: the lock orders the renames (what compare-and-swap needs), and the
        # folder fsyncs of many writers then share the file system's journal
        # commits instead of queueing behind it one by one. Readers never took
        # the lock, so none sees less than before.
        await asyncio.to_thread(_sync_folder, self._path(key).parent)
        return etag

    def _delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return
        except OSError as exc:
            raise StoreError(f"delete {key}: {exc.strerror}") from None
        fsync_dir(path.parent)
        # Prune folders the delete emptied, so deleted prefixes leave no trace.
        parent = path.parent
        while parent != self.root:
            try:
                with contextlib.suppress(FileNotFoundError):
                    if not self._only_stale_temps_left(parent):
                        break  # still holds something: neither it nor a parent empties
                os.rmdir(parent)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    logger.warning("cannot prune folder in store: %s", exc.strerror)
                break
            parent = parent.parent

    async def delete(self, key: str) -> None:
        """See :meth:`ObjectStore.delete`."""
        validate_key(key)
        async with self._locked():
            await asyncio.to_thread(self._delete, key)

    # -- listing -----------------------------------------------------------

    def _walk_prefix(self, prefix: str, after: str) -> Generator[ObjectInfo, None, None]:
        """:meth:`_walk` from the deepest folder every key under ``prefix`` lies in:
        a listing of ``a/b/c/`` reads that folder alone, and its objects are not
        handed up through a generator per level. What the walk from the root
        skips is skipped here too: a hidden name, a link or a file where a folder
        should be (nothing under it is listed)."""
        base = prefix[: prefix.rfind("/") + 1]
        folder = self.root
        for part in base.split("/")[:-1]:
            if part.startswith("."):
                return
            folder = folder / part
            try:
                if not stat.S_ISDIR(os.lstat(folder).st_mode):
                    return
            except (FileNotFoundError, NotADirectoryError):
                return
        yield from self._walk(folder, base, prefix, after)

    def _walk(
        self, folder: Path, base: str, prefix: str, after: str
    ) -> Generator[ObjectInfo, None, None]:
        """Yield objects under ``folder`` (key prefix ``base``) in lexical key order."""
        try:
            with os.scandir(folder) as scan:
                entries = [e for e in scan if not e.name.startswith(".")]
        except (FileNotFoundError, NotADirectoryError):
            return
        # A folder's keys all start with "name/": sorting it as that string puts
        # it where its keys belong among its sibling files ("a-b" < "a/x").
        named = [
            (base + e.name + ("/" if e.is_dir(follow_symlinks=False) else ""), e) for e in entries
        ]
        ordered = sorted(named, key=lambda pair: pair[0])
        for name, entry in ordered:
            if name.endswith("/"):
                if not (name.startswith(prefix) or prefix.startswith(name)):
                    continue
                if after and not after.startswith(name) and after > name:
                    continue
                yield from self._walk(Path(entry.path), name, prefix, after)
            elif entry.is_file(follow_symlinks=False):
                if not name.startswith(prefix) or name <= after:
                    continue
                try:
                    validate_key(name)
                    # os-level calls, not open(): a listing reads every object's
                    # header, and a file object costs more than the read itself.
                    fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        etag = _parse_header(os.pread(fd, _HEADER_LEN, 0), name)
                        size = os.fstat(fd).st_size - _HEADER_LEN
                    finally:
                        os.close(fd)
                except FileNotFoundError:
                    continue  # deleted while we walked
                except (InvalidArgument, IntegrityError) as e:
                    # Named (repr: a file name may hold anything) so that an operator
                    # can find a damaged object that listings no longer show.
                    logger.warning("skipping %r: not a store object (%s)", name, e)
                    continue
                yield ObjectInfo(name, size, etag)

    async def list_pages(
        self,
        prefix: str = "",
        *,
        start_after: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[list[ObjectInfo]]:
        """See :meth:`ObjectStore.list_pages`."""
        validate_prefix(prefix)
        check_sizes(page_size, "page_size")
        walker = self._walk_prefix(prefix, start_after or "")

        def _take() -> list[ObjectInfo]:
            page: list[ObjectInfo] = []
            for info in walker:
                page.append(info)
                if len(page) == page_size:
                    break
            return page

        try:
            while page := await asyncio.to_thread(_take):
                yield page
                if len(page) < page_size:
                    return
        finally:
            # A cancel lands while _take may still run in its thread: closing the
            # walker then raises ValueError ("generator already executing"), which
            # would replace the CancelledError and leave the cancelled task running.
            with contextlib.suppress(ValueError):
                walker.close()

    async def close(self) -> None:
        """Close the lock file. The store may not be used afterwards."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
