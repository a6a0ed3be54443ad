"""Machines' sealed backups, kept in the control plane's store and never opened here.

Each machine's backups live under ``accounts/<acct>/backups/<machine>/``; the
account and machine always come from the caller's verified client
certificate (the link servicer passes them), never from a request field, so
one machine cannot name another's backups. Sizes are bounded: a segment
larger than the limit is refused and nothing of it is kept.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Final

from shared.backup_target import ManifestInfo, PruneResult, StoreTarget
from shared.errors import InvalidArgument, TooLarge
from shared.ids import validate_id
from shared.store.base import ObjectStore

__all__ = ["BackupLimits", "MachineBackups", "backups_prefix"]

logger = logging.getLogger(__name__)

#: A sealed manifest names every segment with its key: a few hundred bytes each.
DEFAULT_MAX_MANIFEST: Final = 64 * 1024 * 1024
DEFAULT_MAX_SEGMENT: Final = 4 * 1024**3


def validate_keep(keep: int) -> int:
    """How many backups to keep: 1 to 10 (the machine's own setting's range)."""
    if not 1 <= keep <= 10:
        raise InvalidArgument("keep", "must be from 1 to 10")
    return keep


def backups_prefix(account_id: str, machine_id: str) -> str:
    """Where one machine's backups live in the store."""
    acct = validate_id("account", account_id, "account_id")
    return f"accounts/{acct}/backups/{validate_id('machine', machine_id, 'machine_id')}/"


@dataclass(frozen=True)
class BackupLimits:
    """Bounds on what one machine may store per object."""

    max_manifest: int = DEFAULT_MAX_MANIFEST
    max_segment: int = DEFAULT_MAX_SEGMENT


class MachineBackups:
    """The backup RPCs' domain: one verified machine's target in the store."""

    def __init__(self, store: ObjectStore, limits: BackupLimits | None = None) -> None:
        self._store = store
        self.limits = limits or BackupLimits()

    def target(self, account_id: str, machine_id: str) -> StoreTarget:
        """The calling machine's target (ids from its certificate)."""
        return StoreTarget(self._store, backups_prefix(account_id, machine_id))

    async def have_segments(
        self, account_id: str, machine_id: str, names: Iterable[str]
    ) -> dict[str, int]:
        return await self.target(account_id, machine_id).have_segments(names)

    async def put_segment(
        self, account_id: str, machine_id: str, name: str, data: AsyncIterable[bytes]
    ) -> int:
        """Store a segment streamed by the machine; returns its size."""
        size = 0
        limit = self.limits.max_segment

        async def bounded() -> AsyncIterator[bytes]:
            nonlocal size
            async for chunk in data:
                size += len(chunk)
                if size > limit:
                    raise TooLarge("segment", limit, size)
                yield chunk

        await self.target(account_id, machine_id).put_segment(name, bounded())
        return size

    async def list_manifests(self, account_id: str, machine_id: str) -> list[ManifestInfo]:
        return await self.target(account_id, machine_id).list_manifests()

    async def get_manifest(self, account_id: str, machine_id: str, backup_id: str) -> bytes:
        return await self.target(account_id, machine_id).get_manifest(backup_id)

    def get_segment(self, account_id: str, machine_id: str, name: str) -> AsyncIterator[bytes]:
        return self.target(account_id, machine_id).get_segment(name)

    async def put_manifest(
        self, account_id: str, machine_id: str, backup_id: str, blob: bytes, names: list[str]
    ) -> None:
        if len(blob) > self.limits.max_manifest:
            raise TooLarge("manifest", self.limits.max_manifest, len(blob))
        await self.target(account_id, machine_id).put_manifest(backup_id, blob, names)

    async def prune(self, account_id: str, machine_id: str, keep: int) -> PruneResult:
        """Keep the machine's newest ``keep`` backups (from their names lists)."""
        return await self.target(account_id, machine_id).prune(validate_keep(keep))
