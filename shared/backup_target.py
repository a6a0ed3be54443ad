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

    manifests/<backup id>.sealed
    segments/<segment name>
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Protocol

from shared.errors import NotFound, PreconditionFailed
from shared.ids import is_valid_id, validate_id
from shared.store.base import ObjectStore, validate_prefix

__all__ = ["BackupTarget", "ManifestInfo", "StoreTarget", "manifest_key", "segment_key"]

logger = logging.getLogger(__name__)

_MANIFESTS = "manifests/"
_SEGMENTS = "segments/"
_SUFFIX = ".sealed"


def _check_name(name: str) -> str:
    if len(name) != 64 or any(c not in "0123456789abcdef" for c in name):
        raise ValueError(f"not a segment name: {name[:80]!r}")
    return name


def manifest_key(backup_id: str) -> str:
    """Key of a sealed manifest inside a target."""
    return _MANIFESTS + validate_id("backup", backup_id, "backup_id") + _SUFFIX


def segment_key(name: str) -> str:
    """Key of a sealed segment inside a target."""
    return _SEGMENTS + _check_name(name)


@dataclass(frozen=True)
class ManifestInfo:
    """One stored backup, as a listing shows it (the manifest itself is sealed)."""

    backup_id: str
    size: int


class BackupTarget(Protocol):
    """Write-once storage for one machine's sealed manifests and segments."""

    async def have_segments(self, names: Iterable[str]) -> dict[str, int]:
        """Which of ``names`` are stored already, with their stored sizes."""
        ...

    async def put_segment(self, name: str, data: AsyncIterable[bytes]) -> None:
        """Store a segment; a segment already stored under ``name`` is kept as it is."""
        ...

    async def put_manifest(self, backup_id: str, blob: bytes) -> None:
        """Store a sealed manifest: the backup's commit point, written last."""
        ...

    async def list_manifests(self) -> list[ManifestInfo]:
        """Every stored backup, oldest first (backup ids sort by time)."""
        ...

    async def get_manifest(self, backup_id: str) -> bytes:
        """A sealed manifest; NotFound if there is none with that id."""
        ...

    def get_segment(self, name: str) -> AsyncIterator[bytes]:
        """A stored segment's bytes; NotFound on first iteration if missing."""
        ...

    async def delete_manifest(self, backup_id: str) -> None:
        """Remove a manifest; removing a missing one is not an error."""
        ...

    async def delete_segments(self, names: Iterable[str]) -> None:
        """Remove segments; removing missing ones is not an error."""
        ...

    async def list_segments(self) -> set[str]:
        """Every stored segment's name (for pruning what no manifest names)."""
        ...


class StoreTarget:
    """A :class:`BackupTarget` kept in an object store (a folder for stand-alone machines)."""

    def __init__(self, store: ObjectStore, prefix: str = "") -> None:
        if prefix and not prefix.endswith("/"):
            raise ValueError("a target prefix ends with '/'")
        self._store = store
        self._prefix = validate_prefix(prefix)

    async def have_segments(self, names: Iterable[str]) -> dict[str, int]:
        wanted = {_check_name(n) for n in names}
        if not wanted:
            return {}
        out: dict[str, int] = {}
        start = self._prefix + _SEGMENTS
        async for info in self._store.list(start):
            name = info.key[len(start) :]
            if name in wanted:
                out[name] = info.size
        return out

    async def put_segment(self, name: str, data: AsyncIterable[bytes]) -> None:
        try:
            await self._store.put(self._prefix + segment_key(name), data, if_none_match=True)
        except PreconditionFailed:
            # Same name, same content: the stored copy is as good as ours.
            logger.debug("segment %s already stored", name[:16])

    async def put_manifest(self, backup_id: str, blob: bytes) -> None:
        await self._store.put(self._prefix + manifest_key(backup_id), blob, if_none_match=True)

    async def list_manifests(self) -> list[ManifestInfo]:
        out: list[ManifestInfo] = []
        start = self._prefix + _MANIFESTS
        async for info in self._store.list(start):
            backup_id = info.key[len(start) :].removesuffix(_SUFFIX)
            if info.key.endswith(_SUFFIX) and is_valid_id("backup", backup_id):
                out.append(ManifestInfo(backup_id, info.size))
        return sorted(out, key=lambda m: m.backup_id)

    async def get_manifest(self, backup_id: str) -> bytes:
        try:
            return await self._store.get(self._prefix + manifest_key(backup_id))
        except NotFound:
            raise NotFound("backup", backup_id) from None

    async def get_segment(self, name: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._store.get_stream(self._prefix + segment_key(name)):
                yield chunk
        except NotFound:
            raise NotFound("segment", name[:16]) from None

    async def delete_manifest(self, backup_id: str) -> None:
        await self._store.delete(self._prefix + manifest_key(backup_id))

    async def delete_segments(self, names: Iterable[str]) -> None:
        for name in names:
            await self._store.delete(self._prefix + segment_key(name))

    async def list_segments(self) -> set[str]:
        out: set[str] = set()
        start = self._prefix + _SEGMENTS
        async for info in self._store.list(start):
            name = info.key[len(start) :]
            if len(name) == 64 and all(c in "0123456789abcdef" for c in name):
                out.add(name)
        return out
