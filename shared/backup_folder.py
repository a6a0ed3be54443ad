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

Segments made by worker processes go into packs instead
(:mod:`shared.backup_packs`): the workers append them to pack files in
``packs/``, and the commit publishes each pack, then its index. Readers look
in packs first (the newest pack holding a name), then at segment files; a
prune deletes or rewrites whole packs.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import os
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Final, cast

from shared.atomic import fsync_dir, is_stale_temp
from shared.backup_packs import (
    INDEX_SUFFIX,
    PACKS,
    PackedSegment,
    PackEntry,
    PackWriter,
    debris_pack_id,
    decode_index,
    encode_index,
    is_pack_id,
    new_pack_id,
    newest_pack_id,
)
from shared.backup_target import ManifestInfo, StoreTarget, segment_key
from shared.errors import IntegrityError, InvalidState, NotFound, StoreError
from shared.object_file import HEADER_LEN, PendingObject, parse_header
from shared.store.folder import FolderStore

__all__ = ["FolderTarget"]

logger = logging.getLogger(__name__)

#: Up to this many names, have_segments looks each up; past it, one listing.
_LOOKUPS: Final = 512
#: A segment up to this size is written in one worker-thread call.
_GATHER: Final = 4 * 1024 * 1024
#: Bytes of a packed segment read at once.
_READ: Final = 1024 * 1024
#: The largest pack index read (about 80 bytes a segment).
_MAX_INDEX: Final = 64 * 1024 * 1024


@dataclass
class _NewPack:
    """A pack the segment workers wrote during this backup, not published yet."""

    temp: str
    entries: list[PackEntry] = field(default_factory=list)


@dataclass(frozen=True)
class _Stored:
    """A published pack: its content size and entries."""

    size: int
    entries: tuple[PackEntry, ...]


class _Slice(io.RawIOBase):
    """``size`` bytes of an open file from ``offset``, read as a file of their own
    (closing it closes the file if it ``owns`` it)."""

    def __init__(self, f: BinaryIO, offset: int, size: int, *, owns: bool = True) -> None:
        self._f = f
        self._owns = owns
        self._pos = offset
        self._left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        want = min(len(buffer), self._left)
        if want <= 0:
            return 0
        data = os.pread(self._f.fileno(), want, self._pos)
        if not data:
            raise IntegrityError("backup pack", "ends before a segment it indexes")
        buffer[: len(data)] = data
        self._pos += len(data)
        self._left -= len(data)
        return len(data)

    def close(self) -> None:
        if self._owns:
            self._f.close()
        super().close()


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
        self._packs_dir = store.root.joinpath(*self._key(PACKS).strip("/").split("/"))
        self._new_packs: dict[str, _NewPack] = {}
        # Pack ids from this one on are this backup's (see _sweep_new_temps).
        self._since = ""
        self._own: PackWriter | None = None
        # Published packs as last read (see _scan), and the newest pack holding
        # each segment. Restore threads read these while others look up names.
        self._lock = threading.Lock()
        # One scan at a time, and none while a prune rewrites packs: a scan that
        # listed the folder before another's change must not undo it.
        self._scan_lock = threading.RLock()
        # The daemon's own pack is written from several upload threads at once.
        self._own_lock = threading.Lock()
        # A flush and a discard never run together (a cancelled flush's thread
        # goes on while the failed backup discards).
        self._commit_lock = threading.Lock()
        self._stored: dict[str, _Stored] = {}
        self._where: dict[str, tuple[str, PackEntry]] = {}

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
        """See :meth:`StoreTarget.have_segments`: packed segments, then segment files.

        A backup asks once per window of a few hundred segments: looking each
        file up keeps that proportional to the window, where a listing of the
        whole folder each time would grow with the number of segments stored.
        """
        wanted = set(names)
        await asyncio.to_thread(self._scan)
        with self._lock:
            out = {n: self._where[n][1].size for n in wanted if n in self._where}
        rest = sorted(wanted - out.keys())
        if len(rest) > _LOOKUPS:
            out.update(await super().have_segments(rest))
        elif rest:
            out.update(await asyncio.to_thread(self._sizes, rest))
        return out

    def segment_reader(self, name: str) -> BinaryIO:
        """See :class:`~shared.backup_target.LocalSegments`."""
        for _ in range(2):
            placed = self._packed(name)
            if placed is None:
                break
            pack, entry = placed
            try:
                f = self._folder.open_blocking(self._key(PACKS + pack))
            except NotFound:
                # Repacked (by a prune, maybe another process's) since it was
                # looked up: its kept segments are in a newer pack. Look again.
                self._scan()
                continue
            return cast(BinaryIO, _Slice(f, HEADER_LEN + entry.offset, entry.size))
        try:
            return self._folder.open_blocking(self._key(segment_key(name)))
        except NotFound:
            raise NotFound("segment", name[:16]) from None

    async def get_segment(self, name: str) -> AsyncIterator[bytes]:
        """See :meth:`StoreTarget.get_segment`."""
        placed = await asyncio.to_thread(self._packed, name)
        if placed is None:
            async for chunk in super().get_segment(name):
                yield chunk
            return
        reader = await asyncio.to_thread(self.segment_reader, name)
        try:
            while chunk := await asyncio.to_thread(reader.read, _READ):
                yield chunk
        finally:
            reader.close()

    # -- packs -----------------------------------------------------------------

    def pack_folder(self) -> Path:
        """The folder where segment workers write this backup's packs (made if
        needed; blocking). Hand each segment written there to :meth:`add_packed`."""
        self._present()
        # Every pack made from now on has an id above every pack present, so at
        # or above this one (ids compare as strings of equal length).
        if not self._since:
            newest = newest_pack_id(self._packs_dir)
            self._since = f"{int(newest[:16], 16) + 1:016x}" + "0" * 16 if newest else "0" * 32
        return self._folder.make_folder(self._key(PACKS))

    def add_packed(self, name: str, placed: PackedSegment, *, keep: bool) -> None:
        """A segment a worker appended to a pack: stored at the next commit if
        ``keep``; if not (stored already), its bytes go with the pack's next prune."""
        new = self._new_packs.setdefault(placed.pack, _NewPack(placed.temp))
        if new.temp != placed.temp:
            raise ValueError(f"pack {placed.pack} written under two temp names")
        if keep:
            new.entries.append(PackEntry(name, placed.offset, placed.size))

    def _pack_own(self, name: str, chunks: list[bytes]) -> None:
        """Append a segment to this process's own pack (blocking; see _put_segment)."""
        with self._own_lock:
            if self._own is None:
                self._own = PackWriter(self.pack_folder())
            self.add_packed(name, self._own.add(chunks), keep=True)

    def _close_own(self, *, discard: bool = False) -> None:
        with self._own_lock:
            own, self._own = self._own, None
            if own is not None and discard:
                own.discard()
            elif own is not None:
                own.close()

    def discard_pending(self) -> None:
        """Drop every segment and pack written since the last commit (a backup that
        failed; blocking): none is named by a stored backup."""
        with self._commit_lock:
            pending, self._pending = self._pending, []
            for obj in pending:
                obj.discard()
            self._close_own(discard=True)
            new, self._new_packs = self._new_packs, {}
            for pack in new.values():
                (self._packs_dir / pack.temp).unlink(missing_ok=True)
            self._sweep_new_temps()

    def _sweep_new_temps(self, keep: Set[str] = frozenset()) -> None:
        """Remove this backup's pack temp files but ``keep``: those no segment was
        handed over in (a worker's answer lost to a failure) are no one's (blocking)."""
        since, self._since = self._since, ""
        if not since:
            return
        for name in self._pack_files():
            if (debris_pack_id(name) or "") >= since and name not in keep:
                (self._packs_dir / name).unlink(missing_ok=True)

    def _packed(self, name: str) -> tuple[str, PackEntry] | None:
        """The newest published pack holding ``name``, and where (blocking)."""
        with self._lock:
            placed = self._where.get(name)
        if placed is None:
            self._scan()  # published since the last look (another target object's)
            with self._lock:
                placed = self._where.get(name)
        return placed

    def _scan(self) -> set[str]:
        """Read the indexes of packs published since the last scan (blocking); the
        packs listed with an index that did not read.

        A pack counts once both it and its index are there (a crash between the
        two renames, or between a prune's two deletes, leaves one alone: never
        read, and removed by the next prune). An index that does not read is
        logged and its pack left alone: its segments read as not stored.
        """
        with self._scan_lock:
            return self._scan_locked()

    def _scan_locked(self) -> set[str]:
        files = self._pack_files()
        present = {
            f.removesuffix(INDEX_SUFFIX)
            for f in files
            if f.endswith(INDEX_SUFFIX) and f.removesuffix(INDEX_SUFFIX) in files
        }
        present = {p for p in present if is_pack_id(p)}
        with self._lock:
            known = set(self._stored)
        loaded: dict[str, _Stored] = {}
        for pack in sorted(present - known):
            try:
                loaded[pack] = self._read_index(pack)
            except (IntegrityError, NotFound, OSError) as e:
                logger.warning("backup pack %s left alone: %s", pack, e)
        with self._lock:
            gone = [p for p in known - present if self._stored.pop(p, None) is not None]
            self._stored.update(loaded)
            if loaded or gone:
                self._index_all()
            return present - self._stored.keys()

    def _read_index(self, pack: str) -> _Stored:
        """A pack's index, checked against its header's SHA-256: a flipped byte in
        a name would otherwise hide that segment, and a prune would drop it."""
        size = os.stat(self._packs_dir / pack).st_size - HEADER_LEN
        with open(self._packs_dir / (pack + INDEX_SUFFIX), "rb") as f:
            etag = parse_header(f.read(HEADER_LEN), PACKS + pack + INDEX_SUFFIX)
            data = f.read(_MAX_INDEX + 1)
        if len(data) > _MAX_INDEX:
            raise IntegrityError(f"backup pack {pack}", "index is too big")
        if hashlib.sha256(data).hexdigest() != etag:
            raise IntegrityError(f"backup pack {pack}", "index does not match its checksum")
        return _Stored(size, tuple(decode_index(data, pack, size)))

    def _index_all(self) -> None:
        """Rebuild the name -> newest pack map (call with the lock held)."""
        where: dict[str, tuple[str, PackEntry]] = {}
        for pack in sorted(self._stored):  # by age: a newer pack's copy wins
            for entry in self._stored[pack].entries:
                where[entry.name] = (pack, entry)
        self._where = where

    def _publish_packs(self) -> list[PendingObject]:
        """The new packs with their indexes, ready to publish (blocking); packs
        holding nothing kept are removed. Each index is read back as a reader
        will read it: a pack it does not fit fails the backup, not its restore."""
        new, self._new_packs = self._new_packs, {}
        out: list[PendingObject] = []
        if not new:
            self._sweep_new_temps()
            return out
        try:
            for pack, made in sorted(new.items()):
                temp = self._packs_dir / made.temp
                if not made.entries:
                    temp.unlink(missing_ok=True)
                    continue
                key = self._key(PACKS + pack)
                out.append(PendingObject.adopt(key, self._packs_dir / pack, temp))
                size = os.stat(temp).st_size - HEADER_LEN
                decode_index(encode_index(size, made.entries), pack, size)
                out.append(self._index_object(pack, size, made.entries))
        except BaseException:
            for obj in out:
                obj.discard()
            for made in new.values():
                (self._packs_dir / made.temp).unlink(missing_ok=True)
            self._sweep_new_temps()
            raise
        self._sweep_new_temps(keep={obj.temp.name for obj in out})
        return out

    def _index_object(self, pack: str, size: int, entries: list[PackEntry]) -> PendingObject:
        """A pack's index written and synced, ready to publish after its pack."""
        key = self._key(PACKS + pack + INDEX_SUFFIX)
        obj = PendingObject.create(key, self._packs_dir / (pack + INDEX_SUFFIX))
        try:
            obj.write(encode_index(size, entries))
            obj.close(sync=True)
        except BaseException:
            obj.discard()
            raise
        return obj

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
        if replace and await asyncio.to_thread(self._packed, name) is not None:
            # A packed copy is read before a segment file: the new copy must go
            # into a pack, newer than the one it replaces.
            chunks = [chunk async for chunk in data]
            await asyncio.to_thread(self._pack_own, name, chunks)
            return
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
        """Make every segment put and pack written so far durable and visible.

        Each pack is published before its index (a crash between leaves a pack
        no scan reads), and every segment and pack before the manifest.
        """
        count = await asyncio.to_thread(self._flush)
        logger.debug("folder target: %d segments and packs made durable", count)

    def _flush(self) -> int:
        """:meth:`flush` in one worker-thread call, so that a cancelled flush still
        publishes or removes everything it took (blocking)."""
        with self._commit_lock:
            pending, self._pending = self._pending, []
            try:
                self._close_own()
                pending += self._publish_packs()
                if pending:
                    self._folder.publish(pending)
            except BaseException:
                for obj in pending:
                    obj.discard()
                raise
            return len(pending)

    async def _prune_segments(self, named: set[str]) -> int:
        """Segment files as :class:`StoreTarget` prunes them, then packs: a pack all of
        whose bytes are kept stays, one holding nothing kept goes, and the kept
        segments of any other are first copied to a new pack (see _prune_packs)."""
        removed = await super()._prune_segments(named)
        files = set(await self._segment_names())
        return removed + await asyncio.to_thread(self._prune_packs, named, files)

    def _prune_packs(self, named: set[str], files: Set[str]) -> int:
        """Repack and delete packs (blocking). Every step leaves each kept segment in
        a published pack: a repack publishes its new pack and index before the old
        index goes, then the old pack; a crash between leaves two copies, and the
        newer is the one read, so the next prune deletes the older whole."""
        with self._scan_lock:
            return self._prune_packs_locked(named, files)

    def _prune_packs_locked(self, named: set[str], files: Set[str]) -> int:
        unread = self._scan()
        if unread:
            # A newer copy of a kept segment may be in it: a repack could put an
            # older (damaged) copy above that one. Rewrite no pack until it reads.
            logger.warning(
                "prune: the index of pack %s did not read; packs left as they are", min(unread)
            )
            self._remove_debris()
            return 0
        with self._lock:
            stored = dict(self._stored)
            where = dict(self._where)
        lost = named - where.keys() - files
        if lost:
            # A kept segment found nowhere: an index that did not read, or damage.
            # Which bytes are whose is then uncertain: rewrite no pack.
            logger.warning(
                "prune: %d kept segments are in no pack nor file (%s…); packs left as they are",
                len(lost),
                min(lost)[:16],
            )
            self._remove_debris()
            return 0
        removed = 0
        for pack in sorted(stored):
            held = stored[pack]
            kept = [e for e in held.entries if e.name in named and where[e.name][0] == pack]
            if len(kept) == len(held.entries) and sum(e.size for e in kept) == held.size:
                continue  # every byte of it is kept
            removed += len({e.name for e in held.entries if e.name not in named})
            if kept:
                self._repack(pack, kept)
            self._delete_pack(pack)
        self._remove_debris()
        return removed

    def _pack_files(self) -> dict[str, float]:
        """The regular files in the packs folder, with their mtimes (blocking)."""
        files: dict[str, float] = {}
        try:
            with os.scandir(self._packs_dir) as scan:
                for e in scan:
                    if e.is_file(follow_symlinks=False):
                        files[e.name] = e.stat(follow_symlinks=False).st_mtime
        except (FileNotFoundError, NotADirectoryError):
            pass
        return files

    def _remove_debris(self) -> None:
        """Remove what crashes left (blocking): a pack whose index went (or never
        came), an index alone, and the temp files of a backup killed an hour ago or
        more (the store's own sweep runs only when the daemon starts)."""
        now = time.time()
        files = self._pack_files()
        for name, mtime in sorted(files.items()):
            if debris_pack_id(name) is not None:
                if is_stale_temp(name, mtime, now):
                    (self._packs_dir / name).unlink(missing_ok=True)
                continue
            pack = name.removesuffix(INDEX_SUFFIX)
            if not is_pack_id(pack):
                continue
            partner = pack if name.endswith(INDEX_SUFFIX) else pack + INDEX_SUFFIX
            if partner not in files:
                self._unlink(self._packs_dir / name)

    def _repack(self, pack: str, kept: list[PackEntry]) -> None:
        """Copy ``kept`` of ``pack`` to a new pack, published with its index (blocking)."""
        new = new_pack_id(newest_pack_id(self._packs_dir))
        obj = PendingObject.create(self._key(PACKS + new), self._packs_dir / new)
        entries: list[PackEntry] = []
        try:
            with self._folder.open_blocking(self._key(PACKS + pack)) as src:
                for entry in kept:
                    reader = _Slice(src, HEADER_LEN + entry.offset, entry.size, owns=False)
                    offset = obj.size
                    while chunk := reader.read(_READ):
                        obj.write(chunk)
                    if obj.size - offset != entry.size:
                        raise StoreError(f"repack of backup pack {pack}: segment cut short")
                    entries.append(PackEntry(entry.name, offset, entry.size))
            obj.close(sync=True)
            index = self._index_object(new, obj.size, entries)
        except BaseException:
            obj.discard()
            raise
        try:
            self._folder.publish([obj, index])
        except BaseException:
            obj.discard()
            index.discard()
            raise
        with self._lock:
            self._stored[new] = _Stored(obj.size, tuple(entries))
            self._index_all()
        logger.info("prune: %d segments of pack %s kept in pack %s", len(entries), pack, new)
        if self._after_delete is not None:
            self._after_delete()  # a step of the prune, as each delete is

    def _delete_pack(self, pack: str) -> None:
        """Index first: a pack without one is never read (blocking)."""
        self._unlink(self._packs_dir / (pack + INDEX_SUFFIX))
        self._unlink(self._packs_dir / pack)
        with self._lock:
            self._stored.pop(pack, None)
            self._index_all()

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            return
        fsync_dir(path.parent)
        if self._after_delete is not None:
            self._after_delete()

    async def put_manifest(self, backup_id: str, blob: bytes, names: Iterable[str]) -> None:
        """Publish the segments, then store the manifest: the commit point."""
        await asyncio.to_thread(self._present)
        await self.flush()
        await super().put_manifest(backup_id, blob, names)
