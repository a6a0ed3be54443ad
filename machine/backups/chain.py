"""Restoring to a time: a daily point and the increments after it, merged.

The restorable times are the daily points and, after each, the increments
that continue it (:mod:`machine.backups.increments`). Which ones, for a time
T (default: the newest):

* from each point made at or before T whose manifest opens, the newest
  increment made at or before T that names it as ``base``, then the newest
  that names that one, and so on;
* of those chains, the one whose newest backup is newest (the newest point's,
  unless a daemon was killed between a point's commit and the chain's write:
  it went on continuing the chain before, past the new point). An increment
  whose base is not in the chain (its base was never committed, or does not
  open, or it was orphaned by a crash before the chain recorded it) is never
  restored; an increment that does not open ends the chain where it is.

Fetching a chain (:func:`fetch_chain`) fetches the point as a restore does
(its agents' segments as stored, decoded by the restore), then merges each
increment's deltas onto the agents they change, in order
(:func:`machine.formats.backup_delta.merge_delta`: a delta that does not
continue the agent's history so far is refused, naming the increment), and
stages each changed agent whole. The restore then commits the point's agents
and the merged ones in its one transaction: one commit point, as for a point
alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import io
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from machine.backups.reader import (
    BackupReader,
    FetchedBackup,
    VerifyResult,
    decode_checked,
    stored_chunks,
)
from machine.formats.backup import BackupManifest, SegmentRef
from machine.formats.backup_delta import (
    AgentSegment,
    merge_delta,
    read_agent_segment,
    segment_entries,
)
from shared.archive import write_tar
from shared.backup_target import BackupTarget, ManifestInfo, backup_order
from shared.crypto import BoxKeyPair
from shared.errors import IntegrityError, NotFound
from shared.ids import id_time_ms, is_increment

__all__ = ["BackupChains", "Chain", "Link", "chains", "fetch_chain", "follow", "plan_chain"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Link:
    """What planning a chain needs of an increment: its id, its base and its time
    (kept by the engine once known, so a listing does not open every increment
    again; a restore opens the ones it merges)."""

    backup_id: str
    base: str
    created_at: float

    @classmethod
    def of(cls, manifest: BackupManifest) -> Link:
        return cls(manifest.backup_id, manifest.base, manifest.created_at)


@dataclass(frozen=True)
class Chain:
    """One restorable time: a daily point and the increments after it, in order."""

    point: BackupManifest
    increments: tuple[Link, ...] = ()

    @property
    def backup_id(self) -> str:
        """The newest backup of the chain (what a restore to it names)."""
        return self.increments[-1].backup_id if self.increments else self.point.backup_id

    @property
    def created_at(self) -> float:
        return self.increments[-1].created_at if self.increments else self.point.created_at


Opener = Callable[[str], Awaitable[BackupManifest]]
"""Opens the manifest of a backup id (IntegrityError when it does not open)."""
Linker = Callable[[str], Awaitable[Link]]
"""The :class:`Link` of an increment id (IntegrityError when it does not open)."""


async def follow(
    point: BackupManifest, increments: Sequence[ManifestInfo], link_of: Linker, at: float
) -> Chain:
    """The increments continuing ``point`` up to ``at`` (see the module doc)."""
    after = [
        i
        for i in increments
        if backup_order(i.backup_id) > backup_order(point.backup_id)
        and id_time_ms(i.backup_id) / 1000 <= at
    ]
    opened: list[Link] = []
    for info in after:
        try:
            link = await link_of(info.backup_id)
        except (IntegrityError, NotFound) as e:  # NotFound: pruned since it was listed
            logger.warning("backup increment %s does not open: %s", info.backup_id, e)
            continue
        if link.created_at <= at:
            opened.append(link)
    chain: list[Link] = []
    tip = point.backup_id
    while True:
        children = [m for m in opened if m.base == tip]
        if not children:
            return Chain(point, tuple(chain))
        newest = children[-1]
        chain.append(newest)
        tip = newest.backup_id


async def plan_chain(
    listed: Sequence[ManifestInfo], open_: Opener, link_of: Linker, at: float | None = None
) -> Chain:
    """The chain to restore for time ``at`` (None: the newest) from every stored
    backup ``listed`` (oldest first); NotFound when no point at or before it opens."""
    when = float("inf") if at is None else at
    points = [i for i in listed if not i.increment and id_time_ms(i.backup_id) / 1000 <= when]
    increments = [i for i in listed if i.increment]
    refused: IntegrityError | None = None
    best: Chain | None = None
    for info in reversed(points):
        try:
            point = await open_(info.backup_id)
        except IntegrityError as e:
            logger.error("backup %s does not open, trying the one before: %s", info.backup_id, e)
            refused = refused or e
            continue
        if point.created_at > when:
            continue
        # Each point's chain (a few: ``backup_keep`` at most), the one reaching
        # furthest wins: a daemon killed between a point's commit and the chain's
        # write went on continuing the chain before it, past the new point.
        chain = await follow(point, increments, link_of, when)
        if best is None or chain.created_at > best.created_at:
            best = chain
    if best is not None:
        return best
    if refused is not None:
        raise refused
    # "daily backup made at or before 2020-01-01T00:00:00Z: not found"
    raise NotFound("daily backup", "stored" if at is None else f"made at or before {_iso(at)}")


async def chains(
    listed: Sequence[ManifestInfo], open_: Opener, link_of: Linker
) -> dict[str, Chain]:
    """For each point of ``listed`` that opens, its chain of increments (what
    ``backup list`` and ``backup verify`` show)."""
    increments = [i for i in listed if i.increment]
    out: dict[str, Chain] = {}
    for info in listed:
        if info.increment:
            continue
        try:
            point = await open_(info.backup_id)
        except IntegrityError:
            continue
        out[info.backup_id] = await follow(point, increments, link_of, float("inf"))
    return out


async def fetch_chain(
    reader: BackupReader, chain: Chain, dest: Path, keypair: BoxKeyPair | None = None
) -> FetchedBackup:
    """Fetch ``chain`` into the new folder ``dest`` as one backup to restore: the
    point's agents as stored, each agent an increment changed merged and staged
    whole, the increments' attachments; the manifest as the restore reads it
    (usage of every run, the newest erased list). A fetch that fails removes
    what it staged."""
    fetched = await reader.fetch(chain.point.backup_id, dest, keypair, decode_agents=False)
    if not chain.increments:
        return fetched
    try:
        await _merge_increments(reader, chain, fetched, keypair)
    except BaseException:
        await asyncio.to_thread(_cleanup, dest)
        raise
    return fetched


class BackupChains:
    """Plans, fetches and verifies chains on one target, for the engine.

    Increments' links are kept once known (made by this engine, or opened
    once): manifests are write-once, so a listing does not open every increment
    again; those pruned are dropped at the next listing.
    """

    def __init__(self, target: BackupTarget, reader: BackupReader) -> None:
        self._target = target
        self._reader = reader
        self._links: dict[str, Link] = {}

    def known(self, link: Link) -> None:
        """An increment the engine just committed."""
        self._links[link.backup_id] = link

    def _opener(self, keypair: BoxKeyPair | None) -> Opener:
        return lambda backup_id: self._reader.open(backup_id, keypair)

    def _linker(self, keypair: BoxKeyPair | None) -> Linker:
        async def link(backup_id: str) -> Link:
            if backup_id not in self._links:
                self._links[backup_id] = Link.of(await self._reader.open(backup_id, keypair))
            return self._links[backup_id]

        return link

    async def at(self, at: float | None, keypair: BoxKeyPair | None) -> Chain:
        """What a restore to ``at`` (None: the newest) restores (:func:`plan_chain`)."""
        listed = await self._target.list_manifests()
        return await plan_chain(listed, self._opener(keypair), self._linker(keypair), at)

    async def from_point(
        self, point_id: str, listed: Sequence[ManifestInfo], keypair: BoxKeyPair | None
    ) -> Chain:
        """The point ``point_id`` and every increment continuing it (of ``listed``)."""
        point = await self._reader.open(point_id, keypair)
        return await follow(point, listed, self._linker(keypair), float("inf"))

    async def for_id(self, backup_id: str, keypair: BoxKeyPair | None) -> Chain:
        """A point with every increment continuing it; an increment with its point
        and the increments before it (IntegrityError when it does not continue
        them: it is not restorable)."""
        listed = await self._target.list_manifests()
        if not is_increment(backup_id):
            return await self.from_point(backup_id, listed, keypair)
        at = id_time_ms(backup_id) / 1000 + 1
        chain = await plan_chain(listed, self._opener(keypair), self._linker(keypair), at)
        ids = [link.backup_id for link in chain.increments]
        if backup_id not in ids:
            raise IntegrityError(
                f"backup increment {backup_id}",
                "not restorable: it does not continue the backups before it",
            )
        return Chain(chain.point, chain.increments[: ids.index(backup_id) + 1])

    async def every(self, keypair: BoxKeyPair | None) -> dict[str, Chain]:
        """Each point that opens, with the increments continuing it (:func:`chains`)."""
        listed = await self._target.list_manifests()
        stored = {i.backup_id for i in listed}
        for gone in [b for b in self._links if b not in stored]:
            del self._links[gone]  # pruned
        return await chains(listed, self._opener(keypair), self._linker(keypair))

    async def fetch(self, chain: Chain, dest: Path, keypair: BoxKeyPair | None) -> FetchedBackup:
        """:func:`fetch_chain` on this target."""
        return await fetch_chain(self._reader, chain, dest, keypair)

    async def verify(self, chain: Chain, keypair: BoxKeyPair | None) -> VerifyResult:
        """Authenticate every segment of the point and of each of its increments."""
        started = time.monotonic()
        segments = plain = 0
        for backup_id in (chain.point.backup_id, *(i.backup_id for i in chain.increments)):
            done = await self._reader.verify(backup_id, keypair)
            segments, plain = segments + done.segments, plain + done.plain_bytes
        return VerifyResult(chain.backup_id, segments, plain, time.monotonic() - started)


async def _merge_increments(
    reader: BackupReader, chain: Chain, fetched: FetchedBackup, keypair: BoxKeyPair | None
) -> None:
    point = chain.point
    # Agents an increment changed: their files so far (None: removed).
    merged: dict[str, AgentSegment | None] = {}
    usage = {str(u.get("id")): u for u in point.usage}

    async def whole(agent_id: str) -> AgentSegment | None:
        if agent_id in fetched.stored_agents:
            ref, stored = fetched.stored_agents[agent_id]
            out = io.BytesIO()
            chunks = stored_chunks(stored)
            await asyncio.to_thread(decode_checked, ref, point.naming_key, chunks, out)
            return read_agent_segment(out.getvalue(), agent_id)
        if agent_id in fetched.agent_files:
            data = await asyncio.to_thread(fetched.agent_files[agent_id].read_bytes)
            return read_agent_segment(data, agent_id)
        return None

    last: BackupManifest | None = None
    for link in chain.increments:
        inc = last = await reader.open(link.backup_id, keypair)
        for ref in inc.segments:
            if ref.kind == "attachment":
                if ref.ref not in fetched.attachment_files:
                    path = fetched.folder / f"attachment-{ref.ref}"
                    await _attachment(reader, ref, inc.naming_key, path)
                    fetched.attachment_files[ref.ref] = path
                continue
            data = await reader.read_segment(ref, inc.naming_key)
            delta = read_agent_segment(data, ref.ref)
            earlier = merged[ref.ref] if ref.ref in merged else await whole(ref.ref)
            merged[ref.ref] = merge_delta(
                earlier, delta, base_seq=ref.base_seq, agent_id=ref.ref, increment=inc.backup_id
            )
        for agent_id in inc.removed:
            merged[agent_id] = None
        usage.update({str(u.get("id")): u for u in inc.usage})
    for agent_id, files in merged.items():
        fetched.stored_agents.pop(agent_id, None)
        fetched.agent_files.pop(agent_id, None)
        if files is None:
            continue
        path = fetched.folder / f"merged-{agent_id}"
        await asyncio.to_thread(_write_segment, path, agent_id, files)
        fetched.agent_files[agent_id] = path
    assert last is not None
    fetched.manifest = dataclasses.replace(
        point,
        backup_id=last.backup_id,
        created_at=last.created_at,
        usage=tuple(usage.values()),
        erased=last.erased,
        settings=last.settings,
    )


async def _attachment(reader: BackupReader, ref: SegmentRef, naming_key: bytes, path: Path) -> None:
    data = await reader.read_segment(ref, naming_key)
    await asyncio.to_thread(path.write_bytes, data)


def _write_segment(path: Path, agent_id: str, files: AgentSegment) -> None:
    with open(path, "wb") as out:
        write_tar(out, segment_entries(agent_id, files))


def _iso(at: float) -> str:
    moment = dt.datetime.fromtimestamp(at, dt.UTC)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def _cleanup(folder: Path) -> None:
    for p in folder.iterdir():
        with contextlib.suppress(OSError):
            p.unlink()
    with contextlib.suppress(OSError):
        os.rmdir(folder)
