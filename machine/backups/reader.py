"""Reading sealed backups: list, open, verify and fetch them from a target.

A :class:`BackupReader` opens manifests (with the machine's key, or a recovery
key) and downloads, authenticates and decodes the segments they name; it never
writes to the target. :class:`~machine.backups.engine.BackupEngine` makes one
over its own target and hands it every read.

What a target sends is not trusted. A segment's stored bytes are refused past
the most its manifest entry allows (before they fill the disk or the memory),
then authenticated whole and checked against its name (:func:`decode_checked`);
one the target lacks is an integrity failure (the backup does not restore
whole), not a NotFound. A segment of this machine's that fails is reported
(``on_damaged``) so the next backup sends it again. A fetch that fails removes
what it staged: nothing reads half a backup.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO, Final

from machine.formats.backup import (
    SEGMENT_CHUNK,
    BackupManifest,
    SegmentRef,
    decode_segment,
    open_manifest,
)
from shared.atomic import ensure_private_dir
from shared.backup_target import BackupTarget, LocalSegments, ManifestInfo
from shared.crypto import BoxKeyPair, KeyedHasher
from shared.errors import IntegrityError, InvalidArgument, NotFound

__all__ = [
    "NOT_OURS",
    "BackupReader",
    "FetchedBackup",
    "StoredSegment",
    "VerifyResult",
    "decode_checked",
    "key_refused",
    "file_chunks",
    "stored_chunks",
]

logger = logging.getLogger(__name__)

#: shared.crypto's reason when a sealed object names none of the opener's keys.
#: Why a sealed manifest does not open with a key that is not one of its recipients.
NOT_OURS: Final = "not sealed to this key"
#: Agents read, hashed, compressed and encrypted at once (a machine has few cores).
PARALLEL: Final = 3
_READ: Final = SEGMENT_CHUNK
#: A fetched segment up to this size is decoded from memory, not a temp file.
_HOLD: Final = 4 * 1024 * 1024


@dataclass(frozen=True)
class VerifyResult:
    """A backup opened and every segment authenticated."""

    backup_id: str
    segments: int
    plain_bytes: int
    seconds: float


@dataclass
class FetchedBackup:
    """A backup downloaded and decrypted into a staging folder."""

    manifest: BackupManifest
    folder: Path
    agent_files: dict[str, Path] = field(default_factory=dict)
    """agent id -> its plaintext segment (an export-format tar)."""
    attachment_files: dict[str, Path] = field(default_factory=dict)
    """sha256 -> the attachment's bytes."""
    stored_agents: dict[str, tuple[SegmentRef, StoredSegment]] = field(default_factory=dict)
    """agent id -> its segment as stored (still encrypted), when fetched with
    ``decode_agents=False``: whoever reads it decodes it (:func:`decode_checked`
    of :func:`stored_chunks`)."""


StoredSegment = Path | Callable[[], BinaryIO]
"""A stored segment: a downloaded copy, or an opener of it where it is stored
(a folder target's file, read in place)."""


def stored_chunks(source: StoredSegment) -> Iterator[bytes]:
    """The bytes of a stored segment in stored-chunk sized pieces."""
    if isinstance(source, Path):
        yield from file_chunks(source)
        return
    with source() as f:
        while chunk := f.read(_READ):
            yield chunk


def file_chunks(path: Path) -> Iterator[bytes]:
    """The bytes of the file at ``path`` in stored-chunk sized pieces."""
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            yield chunk


def decode_checked(
    ref: SegmentRef, naming_key: bytes, stored: Iterable[bytes], out: IO[bytes] | None
) -> int:
    """Authenticate and decode segment ``ref`` from its ``stored`` bytes into ``out``;
    check its size and name; return its size (blocking: call it in a worker thread)."""
    h = KeyedHasher(naming_key)
    total = 0
    for piece in decode_segment(stored, name=ref.name, key=ref.key, max_plain=ref.plain_size):
        h.update(piece)
        total += len(piece)
        if out is not None:
            out.write(piece)
    if total != ref.plain_size or h.hexdigest() != ref.name:
        raise IntegrityError(f"segment {ref.name[:16]}", "content does not match its name")
    return total


def _stored_bound(plain_size: int) -> int:
    """The most a segment of ``plain_size`` bytes can take stored: zstd's bound for
    incompressible input, plus the encryption's header and per-chunk overhead."""
    compressed = plain_size + plain_size // 128 + 4096
    return compressed + (compressed // SEGMENT_CHUNK + 2) * 64 + 1024


def _missing(name: str) -> IntegrityError:
    """A segment a backup names that its target does not have: the backup does not
    restore whole (an integrity failure, not a request for something unknown)."""
    return IntegrityError(f"segment {name[:16]}", "missing from where the backup is stored")


def _cleanup(folder: Path) -> None:
    for p in folder.iterdir():
        with contextlib.suppress(OSError):
            p.unlink()
    with contextlib.suppress(OSError):
        os.rmdir(folder)


class BackupReader:
    """Opens and reads one machine's backups on one target (see the module docstring)."""

    def __init__(
        self,
        target: BackupTarget,
        *,
        machine_id: str,
        naming_key: bytes,
        keypair: BoxKeyPair,
        work_dir: Path,
        on_damaged: Callable[[str], None],
    ) -> None:
        """``on_damaged`` is told the name of each segment of this machine's (named
        with ``naming_key``) that failed to authenticate where it is stored."""
        self._target = target
        self._machine_id = machine_id
        self._naming_key = naming_key
        self._keypair = keypair
        self._work = work_dir
        self._on_damaged = on_damaged

    async def list_described(
        self, keypair: BoxKeyPair | None = None
    ) -> list[tuple[ManifestInfo, BackupManifest | None, str]]:
        """As :meth:`list`, with why each backup that does not open fails ("" when
        it opens): ``another key``, or ``refused: <reason>`` (forged, altered).
        ``keypair``: a recovery key to open them with (default: the machine's)."""
        out: list[tuple[ManifestInfo, BackupManifest | None, str]] = []
        for info in await self._target.list_manifests():
            if info.increment:
                continue  # opened only to restore or verify (machine.backups.chain)
            try:
                out.append((info, await self.open(info.backup_id, keypair), ""))
            except IntegrityError as e:
                logger.warning("backup %s does not open: %s", info.backup_id, e)
                reason = getattr(e, "reason", "") or e.message
                problem = "another key" if reason == NOT_OURS else f"refused: {reason}"
                out.append((info, None, problem))
        return out

    async def list(self) -> list[tuple[ManifestInfo, BackupManifest | None]]:
        """Every stored daily point, oldest first, with its manifest when it opens
        (increments: :mod:`machine.backups.chain`)."""
        return [(info, manifest) for info, manifest, _ in await self.list_described()]

    async def open(self, backup_id: str, keypair: BoxKeyPair | None = None) -> BackupManifest:
        """Open one manifest (with the machine's key, or a recovery key)."""
        blob = await self._target.get_manifest(backup_id)
        return open_manifest(
            blob, keypair or self._keypair, machine_id=self._machine_id, backup_id=backup_id
        )

    async def read_segment(self, ref: SegmentRef, naming_key: bytes) -> bytes:
        """Download, authenticate and decode one (small) segment whole: a delta."""
        ensure_private_dir(self._work)
        out = io.BytesIO()
        await self._segment_to(ref, naming_key, self._work, out)
        return out.getvalue()

    async def _segment_to(
        self, ref: SegmentRef, naming_key: bytes, work: Path, out: BinaryIO | None
    ) -> int:
        """Download, authenticate and decode one segment; check its name; return its size.

        A small segment (as its manifest entry says) is held in memory; a larger
        one goes to a temp file first, so memory stays at one chunk.
        """
        try:
            if ref.size <= _HOLD:
                held = [chunk async for chunk in self._bounded(ref)]
                return await asyncio.to_thread(decode_checked, ref, naming_key, iter(held), out)
            # A name of its own: two verifies of one backup (the CLI's and the
            # nightly check's) must not write into each other's copy.
            fd, name = tempfile.mkstemp(dir=work, prefix=f".{ref.name[:16]}-", suffix=".download")
            raw = Path(name)
            try:
                with open(fd, "wb") as f:
                    async for chunk in self._bounded(ref):
                        f.write(chunk)
                stored = file_chunks(raw)
                return await asyncio.to_thread(decode_checked, ref, naming_key, stored, out)
            finally:
                raw.unlink(missing_ok=True)
        except IntegrityError:
            if naming_key == self._naming_key:  # this machine's segment: it can send it again
                self._on_damaged(ref.name)
            raise

    async def _bounded(self, ref: SegmentRef) -> AsyncIterator[bytes]:
        """The stored bytes of ``ref``, refused past the size its manifest names (a
        target that sends more must not fill the disk or the memory first)."""
        size = 0
        # The size the backup recorded, or more if the segment was made again
        # since (mended: another zstd may have compressed it a little worse).
        limit = max(ref.size, _stored_bound(ref.plain_size))
        try:
            async for chunk in self._target.get_segment(ref.name):
                size += len(chunk)
                if size > limit:
                    raise IntegrityError(
                        f"segment {ref.name[:16]}",
                        f"longer than the {ref.size} bytes its backup names",
                    )
                yield chunk
        except NotFound:
            raise _missing(ref.name) from None

    async def _download(self, ref: SegmentRef, path: Path) -> None:
        """Store segment ``ref`` as it is stored (encrypted) at ``path``."""
        with open(path, "wb") as f:
            async for chunk in self._bounded(ref):
                f.write(chunk)

    async def verify(self, backup_id: str, keypair: BoxKeyPair | None = None) -> VerifyResult:
        """Open a backup and authenticate every segment (nothing is written)."""
        started = time.monotonic()
        manifest = await self.open(backup_id, keypair)
        ensure_private_dir(self._work)
        plain = 0
        for ref in manifest.segments:
            plain += await self._segment_to(ref, manifest.naming_key, self._work, None)
        return VerifyResult(backup_id, len(manifest.segments), plain, time.monotonic() - started)

    async def fetch(
        self,
        backup_id: str,
        dest: Path,
        keypair: BoxKeyPair | None = None,
        *,
        decode_agents: bool = True,
    ) -> FetchedBackup:
        """Download and decode a whole backup into the new folder ``dest`` (staging).

        With ``decode_agents=False`` the agents' segments are only downloaded
        (:attr:`FetchedBackup.stored_agents`): a restore then decodes them while
        it loads the ones before, on another core, and writes no plaintext. From
        a target on this machine (:class:`~shared.backup_target.LocalSegments`)
        they are not even copied: the restore reads them where they are (a
        segment gone meanwhile fails the restore, which then commits nothing).
        """
        manifest = await self.open(backup_id, keypair)
        ensure_private_dir(dest)
        fetched = FetchedBackup(manifest, dest)
        sem = asyncio.Semaphore(PARALLEL)

        local = self._target if isinstance(self._target, LocalSegments) else None
        if local is not None and not decode_agents:
            stored = [r.name for r in manifest.segments if r.kind == "agent"]
            have = await self._target.have_segments(stored)
            if missing := [n for n in stored if n not in have]:
                raise _missing(missing[0])

        async def one(ref: SegmentRef) -> None:
            path = dest / f"{ref.kind}-{ref.ref}"
            if ref.kind == "agent" and not decode_agents and local is not None:
                fetched.stored_agents[ref.ref] = (
                    ref,
                    functools.partial(local.segment_reader, ref.name),
                )
                return
            if ref.kind == "agent" and not decode_agents:
                async with sem:
                    await self._download(ref, path)
                fetched.stored_agents[ref.ref] = (ref, path)
                return
            async with sem:
                with open(path, "wb") as out:
                    await self._segment_to(ref, manifest.naming_key, dest, out)
            if ref.kind == "agent":
                fetched.agent_files[ref.ref] = path
            else:
                fetched.attachment_files[ref.ref] = path

        failed: list[BaseException] = []

        async def guarded(ref: SegmentRef) -> None:
            if failed:
                return  # one segment failed: the fetch fails, fetch no more
            try:
                await one(ref)
            except Exception as e:
                failed.append(e)

        try:
            # A few segments at once: downloading, decrypting and decompressing
            # release the GIL. Those in flight when one fails end normally (their
            # downloads close their streams), then the first failure is raised.
            await asyncio.gather(*(guarded(ref) for ref in manifest.segments))
            if failed:
                raise failed[0]
        except BaseException:
            _cleanup(dest)
            raise
        return fetched


@contextlib.contextmanager
def key_refused(recovery: BoxKeyPair | None) -> Iterator[None]:
    """A backup not sealed to the key it was opened with is the caller's input (the
    wrong key, or none for another machine's backup), not damage: INVALID_ARGUMENT."""
    try:
        yield
    except IntegrityError as e:
        if e.reason != NOT_OURS:
            raise
        detail = (
            "the recovery key given is not the one of the machine or account that made it"
            if recovery is not None
            else "another machine made it: give its or its account's recovery key"
        )
        raise InvalidArgument("recovery_key", f"{e.what}: {NOT_OURS} ({detail})") from None
