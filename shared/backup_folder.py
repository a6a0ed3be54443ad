"""A folder backup target whose segments are made durable in one batch, at the commit.

:class:`~shared.backup_target.StoreTarget` over a ``FolderStore`` writes each
segment as its own durable object: temp file, fsync, rename, fsync the
folder. A backup writes hundreds or thousands of segments, and those two
fsyncs each were about half of a full backup's time. :class:`FolderTarget`
writes segments unsynced under temp names and, before the manifest (the
backup's commit point), fsyncs them all, renames them into place and fsyncs
the folder once (``FolderStore.publish``). The layout and object format are
the FolderStore's, so every other reader (listing, restore, prune, a copied
backup folder) sees the same objects.

Until the next :meth:`FolderTarget.put_manifest` (or :meth:`flush`) a segment
put is not visible: a backup reads none of its own segments before its
commit. A crash before it leaves only temp files, which the store's sweep
removes; no object under a segment's name can lose its bytes to a crash.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Callable, Iterable
from typing import BinaryIO, Final

from shared.backup_target import ManifestInfo, StoreTarget, segment_key
from shared.errors import InvalidState, NotFound
from shared.store.folder import FolderStore, PendingObject

__all__ = ["FolderTarget"]

logger = logging.getLogger(__name__)

#: Up to this many names, have_segments looks each up; past it, one listing.
_LOOKUPS: Final = 512
#: A segment up to this size is written in one worker-thread call.
_GATHER: Final = 4 * 1024 * 1024


class FolderTarget(StoreTarget):
    """A :class:`StoreTarget` over a folder, with batched segment durability."""

    def __init__(
        self,
        store: FolderStore,
        prefix: str = "",
        *,
        after_delete: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(store, prefix, after_delete=after_delete)
        self._folder = store
        self._pending: list[PendingObject] = []

    def _present(self) -> None:
        """InvalidState naming the folder when it is gone (moved, deleted, replaced by
        a file): otherwise a listing reads as "no backups" and a write fails on a
        missing parent with an error that names neither."""
        root = self._folder.root
        if self._folder.root_made and not root.is_dir():
            raise InvalidState(
                f"backup folder {root}",
                "gone (moved, deleted or replaced by a file); put it back, or set"
                " backup_dir and restart the daemon",
            )

    async def list_manifests(self) -> list[ManifestInfo]:
        """See :meth:`StoreTarget.list_manifests` (every backup and prune starts here)."""
        await asyncio.to_thread(self._present)
        return await super().list_manifests()

    async def have_segments(self, names: Iterable[str]) -> dict[str, int]:
        """See :meth:`StoreTarget.have_segments`; a few names are looked up one by one.

        A backup asks once per window of a few hundred segments: looking each
        up keeps that proportional to the window, where a listing of the whole
        folder each time would grow with the number of segments stored.
        """
        wanted = sorted(set(names))
        if len(wanted) > _LOOKUPS:
            return await super().have_segments(wanted)
        return await asyncio.to_thread(self._sizes, wanted)

    def segment_reader(self, name: str) -> BinaryIO:
        """See :class:`~shared.backup_target.LocalSegments`."""
        try:
            return self._folder.open_blocking(self._key(segment_key(name)))
        except NotFound:
            raise NotFound("segment", name[:16]) from None

    def _sizes(self, names: list[str]) -> dict[str, int]:
        """Stored size of each of ``names`` stored (in one worker-thread call)."""
        out: dict[str, int] = {}
        for name in names:
            try:
                out[name] = self._folder.head_blocking(self._key(segment_key(name))).size
            except NotFound:
                continue
        return out

    async def put_segment(
        self, name: str, data: AsyncIterable[bytes], *, replace: bool = False
    ) -> None:
        """Write a segment; it is stored (durable and visible) at the next commit.
        One stored already is kept (create-once), unless ``replace``.

        A segment that fits in :data:`_GATHER` (most of a backup's) is gathered
        first and written in one worker-thread call: a full backup writes
        thousands, and each hand-over to a thread costs more than its write.
        """
        try:
            await self._put_segment(name, data, replace)
        except (FileNotFoundError, NotADirectoryError):
            await asyncio.to_thread(self._present)  # the folder went mid-backup: say so
            raise

    async def _put_segment(self, name: str, data: AsyncIterable[bytes], replace: bool) -> None:
        key = self._key(segment_key(name))
        gathered: list[bytes] = []
        size = 0
        source = aiter(data)
        async for chunk in source:
            gathered.append(chunk)
            size += len(chunk)
            if size > _GATHER:
                break
        else:
            obj = await asyncio.to_thread(self._write_whole, key, gathered)
            obj.replace = replace
            self._pending.append(obj)
            return
        obj = await asyncio.to_thread(self._folder.begin_unsynced, key)
        obj.replace = replace
        try:
            await asyncio.to_thread(obj.write, b"".join(gathered))
            async for chunk in source:
                await asyncio.to_thread(obj.write, chunk)
            await asyncio.to_thread(obj.close)
        except BaseException:
            await asyncio.to_thread(obj.discard)
            raise
        self._pending.append(obj)

    def _write_whole(self, key: str, chunks: list[bytes]) -> PendingObject:
        obj = self._folder.begin_unsynced(key)
        try:
            for chunk in chunks:
                obj.write(chunk)
            obj.close(sync=True)  # here, beside the other writes, not all at the flush
        except BaseException:
            obj.discard()
            raise
        return obj

    async def flush(self) -> None:
        """Make every segment put so far durable and visible."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            await asyncio.to_thread(self._folder.publish, pending)
        except BaseException:
            for obj in pending:
                await asyncio.to_thread(obj.discard)
            raise
        logger.debug("folder target: %d segments made durable", len(pending))

    async def put_manifest(self, backup_id: str, blob: bytes, names: Iterable[str]) -> None:
        """Publish the segments, then store the manifest: the commit point."""
        await asyncio.to_thread(self._present)
        await self.flush()
        await super().put_manifest(backup_id, blob, names)
