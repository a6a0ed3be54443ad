"""Machines' sealed backups, kept in the control plane's store and never opened here.

Each machine's backups live under ``accounts/<acct>/backups/<machine>/``; the
account and machine always come from the caller's verified client
certificate (the link servicer passes them), never from a request field, so
one machine cannot name another's backups. Sizes are bounded: a segment
larger than the limit is refused and nothing of it is kept.

Reading another machine's backups (a replacement box restoring a lost
machine's) is allowed within one account only: :meth:`MachineBackups.source`
answers NotFound for a machine of another account exactly as for a missing one.

Segments go to the store given here, NOT the MAC'd record store: they are
authenticated by the manifest that names them and may be gigabytes, which the
record wrapper (read whole, 16 MiB bound) cannot carry. They are streamed
through. Manifests and their names lists go to ``records`` (the server passes
its MAC'd store): a manifest is sealed anonymously, so without the MAC anyone
who can write the bucket and knows an account's recovery public key could plant
a backup that a repair would restore. A planted or moved one is refused on
read (DATA_LOSS) and reported by ``fsck``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Final

from shared.backup_target import (
    MAX_LINK_MANIFEST,
    ManifestInfo,
    PruneResult,
    StoreTarget,
    is_segment_name,
    manifest_key,
    names_key,
    segment_key,
)
from shared.errors import InvalidArgument, NotFound, PermissionDenied, TooLarge
from shared.ids import validate_id
from shared.store.base import ObjectStore, delete_keys

__all__ = ["BackupLimits", "MachineBackups", "backups_prefix"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_MANIFEST: Final = MAX_LINK_MANIFEST
DEFAULT_MAX_SEGMENT: Final = 4 * 1024**3
#: Names one HaveSegments call may ask about (link.proto).
MAX_HAVE_NAMES: Final = 10_000

MachineExists = Callable[[str, str], Awaitable[bool]]
"""``exists(account_id, machine_id)``: whether the account has that machine (any state)."""
AccountGone = Callable[[str], Awaitable[bool]]
"""``gone(account_id)``: whether the account is being deleted or was deleted."""


def check_segment_name(name: str) -> str:
    """A segment name as the link carries it: 64 lower-case hex characters."""
    if not is_segment_name(name):
        raise InvalidArgument("hash", "a segment hash is 64 lower-case hex characters")
    return name


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
    max_have: int = MAX_HAVE_NAMES


class MachineBackups:
    """The backup RPCs' domain: one verified machine's target in the store."""

    def __init__(
        self,
        store: ObjectStore,
        limits: BackupLimits | None = None,
        *,
        exists: MachineExists | None = None,
        gone: AccountGone | None = None,
        records: ObjectStore | None = None,
    ) -> None:
        self._store = store
        self._records = records
        self.limits = limits or BackupLimits()
        self._exists = exists
        self._gone = gone

    async def _unless_gone(self, account_id: str, keys: list[str]) -> None:
        """After a write: when the account's deletion began meanwhile, delete ``keys``
        (what the call wrote) and refuse.

        The caller was authorized at the call's start; an upload can outlast the
        deletion's last sweep. Checked after the write, so either the sweep saw
        the object or this check sees the tombstone (or the deleted marker).
        """
        if self._gone is None or not await self._gone(account_id):
            return
        await delete_keys(self._store, keys)
        raise PermissionDenied("backups: account is being deleted")

    async def source(self, account_id: str, caller_id: str, named: str) -> str:
        """Whose backups a read names: the caller's own when ``named`` is empty,
        else another machine of the SAME account (a replacement restoring a lost
        machine). Another account's machine is NotFound, exactly like a missing one."""
        if not named or named == caller_id:
            return caller_id
        machine_id = validate_id("machine", named, "machine_id")
        if self._exists is None or not await self._exists(account_id, machine_id):
            raise NotFound("machine", machine_id)
        return machine_id

    def target(self, account_id: str, machine_id: str) -> StoreTarget:
        """The calling machine's target (ids from its certificate)."""
        return StoreTarget(
            self._store, backups_prefix(account_id, machine_id), records=self._records
        )

    async def have_segments(
        self, account_id: str, machine_id: str, names: Iterable[str]
    ) -> dict[str, int]:
        wanted = [check_segment_name(n) for n in names]
        if len(wanted) > self.limits.max_have:
            raise TooLarge("hashes", self.limits.max_have, len(wanted))
        return await self.target(account_id, machine_id).have_segments(wanted)

    async def put_segment(
        self,
        account_id: str,
        machine_id: str,
        name: str,
        data: AsyncIterable[bytes],
        declared: int | None = None,
        *,
        replace: bool = False,
    ) -> int:
        """Store a segment streamed by the machine; returns the bytes stored
        (0 when a segment of that name is stored already: names are content hashes),
        unless ``replace``: the machine found the stored copy damaged and sends
        it again. The new bytes take the old ones' place whole, or not at all.

        The stream must hold exactly ``declared`` bytes when given: a short or
        long stream raises inside the upload, so the store keeps nothing of it.
        """
        check_segment_name(name)
        limit = self.limits.max_segment
        if declared is not None and declared > limit:
            raise TooLarge("segment", limit, declared)
        target = self.target(account_id, machine_id)
        if not replace:
            try:
                await self._store.head(backups_prefix(account_id, machine_id) + segment_key(name))
                return 0
            except NotFound:
                pass
        size = 0

        async def bounded() -> AsyncIterator[bytes]:
            nonlocal size
            async for chunk in data:
                size += len(chunk)
                if size > limit or (declared is not None and size > declared):
                    raise TooLarge("segment", declared if declared is not None else limit, size)
                yield chunk
            if declared is not None and size != declared:
                raise InvalidArgument("chunk", f"segment ended at {size} of {declared} bytes")

        await target.put_segment(name, bounded(), replace=replace)
        await self._unless_gone(
            account_id, [backups_prefix(account_id, machine_id) + segment_key(name)]
        )
        if replace:
            # Not checkable here (the control plane cannot open segments): a trace
            # of every overwrite, for the machine's own history only.
            logger.warning(
                "machine %s (account %s) replaced its stored segment %s (found damaged)",
                machine_id, account_id, name[:16],
            )  # fmt: skip
        return size

    async def list_manifests(self, account_id: str, machine_id: str) -> list[ManifestInfo]:
        return await self.target(account_id, machine_id).list_manifests()

    async def get_manifest(self, account_id: str, machine_id: str, backup_id: str) -> bytes:
        return await self.target(account_id, machine_id).get_manifest(backup_id)

    def get_segment(self, account_id: str, machine_id: str, name: str) -> AsyncIterator[bytes]:
        return self.target(account_id, machine_id).get_segment(check_segment_name(name))

    async def put_manifest(
        self, account_id: str, machine_id: str, backup_id: str, blob: bytes, names: list[str]
    ) -> None:
        if len(blob) > self.limits.max_manifest:
            raise TooLarge("manifest", self.limits.max_manifest, len(blob))
        names = [check_segment_name(n) for n in names]
        await self.target(account_id, machine_id).put_manifest(backup_id, blob, names)
        root = backups_prefix(account_id, machine_id)
        await self._unless_gone(
            account_id, [root + manifest_key(backup_id), root + names_key(backup_id)]
        )

    async def prune(self, account_id: str, machine_id: str, keep: int) -> PruneResult:
        """Keep the machine's newest ``keep`` backups (from their names lists)."""
        return await self.target(account_id, machine_id).prune(validate_keep(keep))
