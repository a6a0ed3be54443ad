"""Where backups go: one small interface, and the store-backed implementation.

A stand-alone machine backs up to a folder (a :class:`StoreTarget` over a
``FolderStore``); a joined server backs up to the control plane (a target
over the ``MachineLink`` backup RPCs), which keeps them with a
:class:`StoreTarget` under ``accounts/<acct>/backups/<machine>/`` of its own
store, without being able to open them. The backup engine sees only
:class:`BackupTarget`, so every target runs one contract suite.

Objects are write-once: a segment's name is a hash of its content, and a
manifest's id is new for each backup, so every write is create-once and
retrying one is safe. Layout inside a target (after its prefix)::

    manifests/<backup id>.sealed     the sealed manifest (the commit point)
                                     (bk_...: a daily point; bki_...: an increment)
    manifests/<backup id>.names      JSON list of the segment names it uses
    segments/<segment name>          sealed segments, shared by backups

A target may keep its manifests and names lists in a second store,
``records``: the control plane passes its MAC'd record store, so that write
access to the bucket alone cannot plant a backup (a manifest sealed to an
account's recovery key is anonymous; its MAC says the control plane stored it
for that machine). Segments need no MAC: a manifest names each by a keyed
hash and holds its key, so an authentic manifest authenticates them.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Final, Protocol, runtime_checkable

from shared.backup_packs import PackedSegment
from shared.errors import IntegrityError, InvalidId, NotFound, PreconditionFailed
from shared.ids import id_time_ms, is_backup_id, is_increment
from shared.limits import LINK_MAX_MESSAGE
from shared.store.base import ObjectStore, validate_prefix

__all__ = [
    "BackupTarget",
    "LocalSegments",
    "MANIFESTS",
    "MAX_LINK_MANIFEST",
    "ManifestInfo",
    "NAMES_SUFFIX",
    "PackTarget",
    "PruneResult",
    "StoreTarget",
    "backup_order",
    "is_backup_id",
    "is_increment",
    "is_segment_name",
    "kept_by_points",
    "manifest_key",
    "names_key",
    "segment_key",
    "validate_backup_id",
]

logger = logging.getLogger(__name__)

#: Inside a target: manifests (and each backup's names list beside its manifest).
MANIFESTS: Final = "manifests/"
_SEGMENTS = "segments/"
_SUFFIX = ".sealed"
#: A backup's names list: ``MANIFESTS + backup id + NAMES_SUFFIX``.
NAMES_SUFFIX: Final = ".names"
#: The largest sealed manifest a control plane stores. It names every segment with
#: its key (a few hundred bytes each) and holds the machine's usage history
#: (compressed); it travels in one link message with its names list (65 bytes a
#: segment), for which a mebibyte is left.
MAX_LINK_MANIFEST: Final = LINK_MAX_MESSAGE - 1024 * 1024


_SEGMENT_NAME: Final = re.compile(r"[0-9a-f]{64}")


def is_segment_name(name: str) -> bool:
    """Whether ``name`` is a segment name: 64 lower-case hex characters."""
    return _SEGMENT_NAME.fullmatch(name) is not None


def _check_name(name: str) -> str:
    if not is_segment_name(name):
        raise ValueError(f"not a segment name: {name[:80]!r}")
    return name


def validate_backup_id(value: str, field: str = "backup_id") -> str:
    """``value`` if it is a point's or an increment's id, else InvalidId."""
    if not is_backup_id(value):
        raise InvalidId("backup", value if isinstance(value, str) else repr(value), field)
    return value


def backup_order(backup_id: str) -> tuple[int, str]:
    """Sort key of backups by time, points and increments together (their prefixes
    differ, so the ids alone do not sort across kinds)."""
    return id_time_ms(backup_id), backup_id


def kept_by_points(ids: list[str], keep: int) -> tuple[list[str], list[str]]:
    """Which backups (ids oldest first) a prune keeping ``keep`` points keeps, and
    which it drops: the newest ``keep`` daily points, and every increment after
    the oldest of them (an increment goes with the point it continues). Before
    any point is stored, nothing is dropped."""
    points = [b for b in ids if not is_increment(b)]
    if not points:
        return list(ids), []
    kept_points = set(points[-keep:])
    oldest = backup_order(points[-keep:][0])
    kept = [b for b in ids if b in kept_points or (is_increment(b) and backup_order(b) > oldest)]
    held = set(kept)
    return kept, [b for b in ids if b not in held]


def manifest_key(backup_id: str) -> str:
    """Key of a sealed manifest inside a target."""
    return MANIFESTS + validate_backup_id(backup_id) + _SUFFIX


def names_key(backup_id: str) -> str:
    """Key of the list of segment names a backup uses (beside its manifest)."""
    return MANIFESTS + validate_backup_id(backup_id) + NAMES_SUFFIX


def segment_key(name: str) -> str:
    """Key of a sealed segment inside a target."""
    return _SEGMENTS + _check_name(name)


@dataclass(frozen=True)
class ManifestInfo:
    """One stored backup, as a listing shows it (the manifest itself is sealed)."""

    backup_id: str
    size: int

    @property
    def increment(self) -> bool:
        """An increment of continuous backups (else a daily point)."""
        return is_increment(self.backup_id)


@dataclass(frozen=True)
class PruneResult:
    """What a prune removed."""

    manifests: tuple[str, ...]
    segments: int


class BackupTarget(Protocol):
    """Write-once storage for one machine's sealed manifests and segments.

    Beside each sealed manifest the target keeps the list of the segment
    names it uses (names are keyed hashes: they reveal nothing), so that a
    target that cannot open manifests (the control plane) can still prune.
    """

    #: Whether ``put_segment(replace=True)`` writes over a stored segment (a
    #: damaged one is then mended by the next backup).
    replaces_segments: bool

    async def have_segments(self, names: Iterable[str]) -> dict[str, int]:
        """Which of ``names`` are stored already, with their stored sizes."""
        ...

    async def put_segment(
        self, name: str, data: AsyncIterable[bytes], *, replace: bool = False
    ) -> None:
        """Store a segment; a segment already stored under ``name`` is kept as it is,
        unless ``replace`` (its stored copy was found damaged: it fails to
        authenticate). A target that cannot replace (``replaces_segments``
        false) keeps it."""
        ...

    async def put_manifest(self, backup_id: str, blob: bytes, names: Iterable[str]) -> None:
        """Store a sealed manifest and its segment names: the backup's commit point."""
        ...

    async def list_manifests(self) -> list[ManifestInfo]:
        """Every stored backup (points and increments), oldest first
        (:func:`backup_order`)."""
        ...

    async def get_manifest(self, backup_id: str) -> bytes:
        """A sealed manifest; NotFound if there is none with that id."""
        ...

    def get_segment(self, name: str) -> AsyncIterator[bytes]:
        """A stored segment's bytes; NotFound on first iteration if missing."""
        ...

    async def prune(self, keep: int) -> PruneResult:
        """Keep the newest ``keep`` daily points and the increments after the
        oldest of them (:func:`kept_by_points`); delete the other manifests, then
        every segment no kept backup names. A crash part-way leaves every kept
        backup whole."""
        ...


@runtime_checkable
class PackTarget(Protocol):
    """A target on this machine into which the segment workers write packs
    (:class:`~shared.backup_folder.FolderTarget`; see shared.backup_packs)."""

    def pack_folder(self) -> Path:
        """Where the workers write this backup's packs (blocking)."""
        ...

    def add_packed(self, name: str, placed: PackedSegment, *, keep: bool) -> None:
        """A segment a worker packed: stored at the commit if ``keep``."""
        ...

    def discard_pending(self) -> None:
        """Drop what was written since the last commit (a failed backup; blocking)."""
        ...


@runtime_checkable
class LocalSegments(Protocol):
    """A target whose segments are files on this machine (a folder target): a
    restore reads them where they are instead of copying them first."""

    def segment_reader(self, name: str) -> BinaryIO:
        """Segment ``name`` as stored, open for reading (blocking; the caller
        closes it). NotFound if it is not stored."""
        ...


class StoreTarget:
    """A :class:`BackupTarget` kept in an object store (a folder for stand-alone machines).

    Commit order: segments, then the names list, then the sealed manifest. A
    names list without its manifest is debris of a crashed backup; prune
    removes it with the segments only it named.
    """

    replaces_segments = True

    def __init__(
        self,
        store: ObjectStore,
        prefix: str = "",
        *,
        records: ObjectStore | None = None,
        after_delete: Callable[[], None] | None = None,
    ) -> None:
        if prefix and not prefix.endswith("/"):
            raise ValueError("a target prefix ends with '/'")
        self._store = store
        self._after_delete = after_delete  # a test's fault point: after each prune delete
        # Manifests and names lists (see the module doc); listings and deletes
        # go to ``store``, which must hold the same objects.
        self._records = records or store
        self._prefix = validate_prefix(prefix)

    def _key(self, key: str) -> str:
        return self._prefix + key

    async def have_segments(self, names: Iterable[str]) -> dict[str, int]:
        wanted = {_check_name(n) for n in names}
        if not wanted:
            return {}
        out: dict[str, int] = {}
        start = self._key(_SEGMENTS)
        async for info in self._store.list(start):
            name = info.key[len(start) :]
            if name in wanted:
                out[name] = info.size
        return out

    async def put_segment(
        self, name: str, data: AsyncIterable[bytes], *, replace: bool = False
    ) -> None:
        try:
            key = self._key(segment_key(name))
            await self._store.put(key, data, if_none_match=not replace)
        except PreconditionFailed:
            # Same name, same content: the stored copy is as good as ours.
            logger.debug("segment %s already stored", name[:16])

    async def put_manifest(self, backup_id: str, blob: bytes, names: Iterable[str]) -> None:
        """See :meth:`BackupTarget.put_manifest`. Idempotent: a manifest stored
        already with exactly these bytes (a put sent again after its answer was
        lost) is done; one with other bytes is PreconditionFailed."""
        listing = json.dumps(sorted({_check_name(n) for n in names})).encode()
        await self._records.put(self._key(names_key(backup_id)), listing)
        key = self._key(manifest_key(backup_id))
        try:
            # The commit point: until this exists the backup is not listed.
            await self._records.put(key, blob, if_none_match=True)
        except PreconditionFailed:
            try:
                if await self._records.get(key) == blob:
                    return  # ours, from the try whose answer was lost
            except NotFound:
                pass
            raise

    async def list_manifests(self) -> list[ManifestInfo]:
        out: list[ManifestInfo] = []
        start = self._key(MANIFESTS)
        async for info in self._store.list(start):
            backup_id = info.key[len(start) :].removesuffix(_SUFFIX)
            if info.key.endswith(_SUFFIX) and is_backup_id(backup_id):
                out.append(ManifestInfo(backup_id, info.size))
        return sorted(out, key=lambda m: backup_order(m.backup_id))

    async def get_manifest(self, backup_id: str) -> bytes:
        try:
            return await self._records.get(self._key(manifest_key(backup_id)))
        except NotFound:
            raise NotFound("backup", backup_id) from None

    async def get_segment(self, name: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._store.get_stream(self._key(segment_key(name))):
                yield chunk
        except NotFound:
            raise NotFound("segment", name[:16]) from None

    async def _delete(self, key: str) -> None:
        await self._store.delete(key)
        if self._after_delete is not None:
            self._after_delete()

    async def _names(self, backup_id: str) -> set[str] | None:
        try:
            data = json.loads(await self._records.get(self._key(names_key(backup_id))))
        except (NotFound, ValueError, IntegrityError):
            return None
        if not isinstance(data, list) or not all(isinstance(n, str) for n in data):
            return None
        return set(data)

    async def prune(self, keep: int) -> PruneResult:
        if keep < 1:
            raise ValueError("keep at least one backup")
        infos = await self.list_manifests()
        by_id = {i.backup_id: i for i in infos}
        kept_list, dropped_list = kept_by_points([i.backup_id for i in infos], keep)
        kept, dropped = [by_id[b] for b in kept_list], [by_id[b] for b in dropped_list]
        named: set[str] = set()
        for info in kept:
            names = await self._names(info.backup_id)
            if names is None:
                # Cannot tell what a kept backup needs: delete nothing.
                logger.warning("prune: names of backup %s unreadable; pruning nothing", info)
                return PruneResult((), 0)
            named |= names
        # Manifests first (then their lists): a crash after this leaves orphan
        # segments, never a kept manifest naming a deleted segment.
        for info in dropped:
            await self._delete(self._key(manifest_key(info.backup_id)))
            await self._delete(self._key(names_key(info.backup_id)))
        kept_ids = {i.backup_id for i in kept}
        # Prune runs after the owner's own backup, never beside one (the engine
        # holds one lock for both), so a names list without a kept manifest is debris.
        async for obj in self._store.list(self._key(MANIFESTS)):
            stem = obj.key[len(self._key(MANIFESTS)) :].removesuffix(NAMES_SUFFIX)
            if obj.key.endswith(NAMES_SUFFIX) and stem not in kept_ids:
                await self._delete(obj.key)
        removed = await self._prune_segments(named)
        if dropped or removed:
            logger.info("prune: %d backups, %d segments removed", len(dropped), removed)
        return PruneResult(tuple(i.backup_id for i in dropped), removed)

    async def _prune_segments(self, named: set[str]) -> int:
        """Delete every stored segment not in ``named``; how many went."""
        orphans = [n for n in await self._segment_names() if n not in named]
        for name in orphans:
            await self._delete(self._key(segment_key(name)))
        return len(orphans)

    async def _segment_names(self) -> list[str]:
        out: list[str] = []
        start = self._key(_SEGMENTS)
        async for info in self._store.list(start):
            name = info.key[len(start) :]
            if len(name) == 64 and all(c in "0123456789abcdef" for c in name):
                out.append(name)
        return out
