"""Encoding and sending a backup's new segments: one pass over each plaintext, in windows.

For each agent whose segment must be made, its history is dumped (the
database reader), written as a tar straight into a
:class:`~machine.formats.backup.SegmentCompressor` (a worker thread) that
names and compresses it in the same pass; only the compressed bytes are
kept (in memory, or an unnamed temp file past a bound), and once the target
said which names it lacks, those are encrypted under their keys and sent.
Nothing is read twice and no plaintext copy of a segment is written.

Work goes in *windows* of agents: a window is named and compressed, the
target is asked once which of its names it has, and its missing segments
are sent while the next window is being compressed. Memory is bounded by
the window's in-memory budget (past it, compressed segments go to temp
files) and by the few agents in flight.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Set
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, Final, Protocol, TypeVar

from machine.backups.workers.segment_workers import MadeSegment
from machine.formats.backup import (
    SEGMENT_CHUNK,
    SegmentCompressor,
    SegmentRef,
    encode_segment,
    encrypt_segment,
    segment_key,
)
from shared.backup_packs import PackedSegment
from shared.backup_target import BackupTarget, PackTarget
from shared.crypto import KeyedHasher
from shared.errors import NotFound

__all__ = ["SegmentWriter", "WriteResult"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Agents dumped and compressed at once (a machine has few cores; each step
#: but the dump releases the GIL).
PARALLEL: Final = 3
#: Segments sent at once: a folder target's fsyncs overlap (the file system
#: commits concurrent fsyncs together), a remote one's round trips do.
UPLOADS: Final = 8
#: Segments per window: one ``have_segments`` question each.
WINDOW: Final = 256
#: Compressed bytes of a window kept in memory; past it they go to temp files.
WINDOW_MEMORY: Final = 16 * 1024 * 1024
#: One compressed segment in memory at most this big (then a temp file).
_SPOOL: Final = 1024 * 1024


class AgentWriter(Protocol):
    """Writes an agent's plaintext segment (``BackupSource.write_agent``)."""

    async def __call__(self, agent_id: str, out: BinaryIO) -> None: ...


class SegmentMaker(Protocol):
    """Makes whole agent segments elsewhere (workers.segment_workers.SegmentWorkers)."""

    parallel: int
    """Agents to have in hand at once."""

    async def __call__(self, agent_id: str) -> MadeSegment: ...


Tick = Callable[[str], None]


@dataclass(frozen=True)
class WriteResult:
    """The segments written (or found stored), and what was sent."""

    refs: list[SegmentRef]
    uploaded: int
    uploaded_bytes: int


@dataclass
class _Item:
    kind: str
    ref_id: str
    """Agent id, or attachment sha256."""
    path: Path | None = None
    """An attachment's file."""
    ref: SegmentRef | None = None
    compressed: tempfile.SpooledTemporaryFile[bytes] | None = None
    stored: bytes | tempfile.SpooledTemporaryFile[bytes] | None = None
    """Made elsewhere, already as stored (SegmentMaker)."""
    packed: PackedSegment | None = None
    """Made elsewhere and appended to a pack in the target (SegmentMaker)."""
    gone: bool = False
    """An agent erased or deleted after the backup listed it: not in this backup."""

    def close(self) -> None:
        for spool in (self.compressed, self.stored):
            if spool is not None and not isinstance(spool, bytes):
                spool.close()
        self.compressed = self.stored = None


def _spool_chunks(spool: IO[bytes]) -> Iterator[bytes]:
    spool.seek(0)
    while chunk := spool.read(SEGMENT_CHUNK):
        yield chunk


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(SEGMENT_CHUNK):
            yield chunk


def _hash_file(naming_key: bytes, path: Path) -> str:
    h = KeyedHasher(naming_key)
    for chunk in _file_chunks(path):
        h.update(chunk)
    return h.hexdigest()


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _athread(it: Iterator[bytes]) -> AsyncIterator[bytes]:
    """Drive a CPU-bound iterator (encryption) in a worker thread, chunk by chunk."""
    done = object()
    while True:
        chunk = await asyncio.to_thread(next, it, done)
        if chunk is done:
            return
        assert isinstance(chunk, bytes)
        yield chunk


async def _all(jobs: Iterable[Awaitable[T]]) -> list[T]:
    """Run ``jobs`` together; if any fails, let the others end, then raise the first
    failure (nothing is left running on what the caller is about to close)."""
    results = await asyncio.gather(*jobs, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


class SegmentWriter:
    """Makes and sends the segments of one backup that are not stored yet."""

    def __init__(
        self,
        write_agent: AgentWriter,
        target: BackupTarget,
        *,
        naming_key: bytes,
        work_dir: Path,
        tick: Tick,
        maker: SegmentMaker | None = None,
        replace: Set[str] = frozenset(),
        ask: bool = True,
    ) -> None:
        """``replace``: names sent even when the target has them (stored damaged).
        ``ask=False``: the target is not asked which names it has (an increment's
        deltas are new content: a question per increment would cost a listing of
        every stored segment); a segment stored already is kept by the put."""
        self._write_agent = write_agent
        self._maker = maker
        self._target = target
        self._naming_key = naming_key
        self._work = work_dir
        self._tick = tick
        self._replace = replace
        self._ask = ask
        self._packs = target if isinstance(target, PackTarget) else None
        self._cpu = asyncio.Semaphore(PARALLEL if maker is None else maker.parallel)
        self._io = asyncio.Semaphore(UPLOADS)
        self._uploaded = 0
        self._uploaded_bytes = 0

    async def write(self, agents: list[str], attachments: list[tuple[str, Path]]) -> WriteResult:
        """Make and send the segments of ``agents`` and ``attachments`` (sha256, file)."""
        items = [_Item("agent", a) for a in agents]
        items += [_Item("attachment", sha, path) for sha, path in attachments]
        refs: list[SegmentRef] = []
        sending: asyncio.Task[list[SegmentRef]] | None = None
        try:
            for start in range(0, len(items), WINDOW):
                window = items[start : start + WINDOW]
                await self._plan(window)
                if sending is not None:
                    refs += await sending
                # Sent while the next window is read and compressed.
                sending = asyncio.create_task(self._send(window))
            if sending is not None:
                refs += await sending
                sending = None
        finally:
            if sending is not None:
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
            for item in items:
                item.close()
        return WriteResult(refs, self._uploaded, self._uploaded_bytes)

    async def _plan(self, window: list[_Item]) -> None:
        in_memory = 0

        async def plan(item: _Item) -> None:
            try:
                await make(item)
            except (NotFound, FileNotFoundError) as e:
                if (item.kind == "agent") != isinstance(e, NotFound):
                    raise
                # Erased or deleted since the backup listed it (an attachment's file
                # goes with the last agent naming it): the backup holds what the
                # machine has now, and the rest of it goes on.
                logger.info("backup: %s %s went while it was backed up", item.kind, item.ref_id)
                item.close()
                item.gone = True
                self._tick("read")
                self._tick("upload")

        async def make(item: _Item) -> None:
            nonlocal in_memory
            async with self._cpu:
                if item.kind == "attachment":
                    assert item.path is not None
                    name = await asyncio.to_thread(_hash_file, self._naming_key, item.path)
                    plain = item.path.stat().st_size
                elif self._maker is not None:
                    made = await self._maker(item.ref_id)
                    name, plain = made.name, made.plain_size
                    if isinstance(made.stored, bytes):
                        in_memory += len(made.stored)
                    if made.packed is not None:
                        item.packed = made.packed
                    elif isinstance(made.stored, bytes) and in_memory <= WINDOW_MEMORY:
                        item.stored = made.stored  # kept as it came: no copy, no file
                    else:
                        item.stored = await asyncio.to_thread(self._take, made)
                else:
                    spool: tempfile.SpooledTemporaryFile[bytes] = tempfile.SpooledTemporaryFile(
                        max_size=_SPOOL, mode="w+b", dir=str(self._work)
                    )
                    item.compressed = spool
                    compressor = SegmentCompressor(self._naming_key, spool)
                    # A writable file object as far as a tar writer is concerned.
                    await self._write_agent(item.ref_id, compressor)  # type: ignore[arg-type]
                    name = await asyncio.to_thread(compressor.finish)
                    plain = compressor.plain_size
                    in_memory += spool.tell()
                    if in_memory > WINDOW_MEMORY:
                        await asyncio.to_thread(spool.rollover)
            key = segment_key(self._naming_key, name)
            item.ref = SegmentRef(name, key, item.kind, item.ref_id, 0, plain)
            self._tick("read")

        await _all(plan(item) for item in window)

    def _take(self, made: MadeSegment) -> tempfile.SpooledTemporaryFile[bytes]:
        """A made segment's stored bytes in an unnamed temp file (its own file removed)."""
        spool: tempfile.SpooledTemporaryFile[bytes] = tempfile.SpooledTemporaryFile(
            max_size=0, mode="w+b", dir=str(self._work)
        )
        try:
            if isinstance(made.stored, bytes):
                spool.write(made.stored)
            else:
                with open(made.stored, "rb") as f:
                    os.unlink(made.stored)
                    shutil.copyfileobj(f, spool, SEGMENT_CHUNK)
        except BaseException:
            spool.close()
            raise
        return spool

    async def _send(self, window: list[_Item]) -> list[SegmentRef]:
        window = [item for item in window if not item.gone]
        refs = [item.ref for item in window]
        assert all(ref is not None for ref in refs)
        names = {ref.name for ref in refs if ref is not None}
        have = await self._target.have_segments(names) if self._ask else {}

        async def send(item: _Item) -> SegmentRef:
            ref = item.ref
            assert ref is not None
            stored = ref.name in have and ref.name not in self._replace
            if item.packed is not None:
                # Written already: the target only learns whether to keep it.
                assert self._packs is not None
                self._packs.add_packed(ref.name, item.packed, keep=not stored)
            if stored:
                size = have[ref.name]
            elif item.packed is not None:
                size = item.packed.size
                self._uploaded += 1
                self._uploaded_bytes += size
            else:
                async with self._io:
                    size = await self._upload(item, ref)
                self._uploaded += 1
                self._uploaded_bytes += size
            item.close()  # the compressed copy goes as soon as it is sent
            self._tick("upload")
            return SegmentRef(ref.name, ref.key, ref.kind, ref.ref, size, ref.plain_size)

        return await _all(send(item) for item in window)

    async def _upload(self, item: _Item, ref: SegmentRef) -> int:
        if isinstance(item.stored, bytes):
            await self._target.put_segment(
                ref.name, _one(item.stored), replace=ref.name in self._replace
            )
            return len(item.stored)
        if item.stored is not None:
            stream = _spool_chunks(item.stored)
        elif item.compressed is not None:
            stream = encrypt_segment(_spool_chunks(item.compressed), name=ref.name, key=ref.key)
        else:
            assert item.path is not None
            stream = encode_segment(_file_chunks(item.path), name=ref.name, key=ref.key)
        sent = 0

        async def counted() -> AsyncIterator[bytes]:
            nonlocal sent
            async for chunk in _athread(stream):
                sent += len(chunk)
                yield chunk

        await self._target.put_segment(ref.name, counted(), replace=ref.name in self._replace)
        return sent
