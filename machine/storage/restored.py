"""Restored agents' histories, packed at the restore and loaded after its commit.

Parsing every line of every conversation and inserting it into machine.db
is most of a restore's work (bench/backup.py: SQLite alone copying the rows
takes about restic's whole restore, the Python parse of the lines twice that
again). So a restore does only what must be
done before its commit point: each agent's segment is authenticated whole,
checked against its name, its tar walked (only the agent's files, regular,
bounded) and its record checked; the segment's still-compressed plaintext is
appended to one pack file per restore, ``<data>/restored/<name>.pack``,
fsync'd; then one transaction commits every agent's record (archived) with a
``restore_pending`` row saying where its history lies. The conversations,
runs, summaries, tool logs and schedules are loaded from the pack afterwards,
one agent per write transaction (:func:`ensure_loaded`): by the background
indexer (``machine/core/search_indexer.py``), or at once for an agent someone
reads, exports, unarchives or deletes, and for every agent before a backup.

Crash-safe by construction: the pack is durable before the commit that names
it; each agent's rows and the removal of its pending row commit together; a
pack no row names (a restore killed before its commit, a loader killed
between its last commit and the file's removal) is removed at start
(:func:`sweep_packs`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import shutil
import sqlite3
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, Final

import zstandard

from machine.formats.backup import IterReader, SegmentRef, decompress_segment, decrypt_segment
from machine.formats.export import AGENT_FILES, OPTIONAL_AGENT_FILES, SESSIONS
from machine.formats.segment_files import SegmentFiles, open_segment
from machine.storage.db import Database
from machine.storage.tables import restore_pending
from machine.storage.tables.export import MAX_RECORD
from shared.atomic import ensure_private_dir, fsync_dir
from shared.crypto import KeyedHasher
from shared.errors import (
    DatabaseDamaged,
    DiskFull,
    IntegrityError,
    InvalidArgument,
    StoreError,
    TransientError,
)

__all__ = [
    "PACK_DIR",
    "PackWriter",
    "decode_for_pack",
    "ensure_loaded",
    "failed_pack",
    "forget_failed",
    "write_failed",
    "pack_dir",
    "restore_ended",
    "restore_started",
    "sweep_packs",
]

logger = logging.getLogger(__name__)

#: The folder, beside machine.db, that holds restores' packs.
PACK_DIR: Final = "restored"
_SUFFIX: Final = ".pack"
_READ: Final = 1024 * 1024
#: A segment up to this size (plaintext) is checked whole in memory, not streamed.
_WHOLE: Final = 16 * 1024 * 1024
#: Histories loaded per write transaction (each commit is an fsync): at most this
#: many agents, and no more once this many packed bytes are in.
_BATCH_AGENTS: Final = 64
_BATCH_BYTES: Final = 4 * 1024 * 1024

# Databases known to hold no history still to load: the readers' fast path (no
# query). Only a restore in this process adds some: while one runs no reader
# marks the database loaded, and its end bumps the generation, so that a reader
# that looked before its commit cannot mark it loaded after
# (:func:`restore_started`, :func:`restore_ended`).
_LOADED: weakref.WeakSet[Database] = weakref.WeakSet()
_GENERATION: weakref.WeakKeyDictionary[Database, int] = weakref.WeakKeyDictionary()
_RESTORING: weakref.WeakKeyDictionary[Database, int] = weakref.WeakKeyDictionary()


def pack_dir(db: Database) -> Path:
    """Where ``db``'s restores keep their packs."""
    return db.path.parent / PACK_DIR


# -- at the restore ------------------------------------------------------------


def decode_for_pack(
    ref: SegmentRef,
    naming_key: bytes,
    stored: Iterable[bytes],
    out: IO[bytes],
    agent_id: str,
    kept: dict[str, bytes] | None = None,
) -> bytes:
    """Authenticate agent segment ``ref`` from its ``stored`` bytes, write its
    compressed plaintext to ``out``, check its plaintext against its name and
    size and walk its tar; return the agent's ``record.json`` (blocking: call
    it in a worker thread). IntegrityError for anything wrong. ``kept`` gets
    the optional files that do not go into machine.db (``sessions.tar``), by name."""
    for piece in decrypt_segment(stored, name=ref.name, key=ref.key):
        out.write(piece)
    out.seek(0)
    if ref.plain_size <= _WHOLE:
        whole = b"".join(decompress_segment(_pieces(out), name=ref.name, max_plain=ref.plain_size))
        _check_name(ref, naming_key, whole, len(whole))
        with open_segment(whole, agent_id) as files:
            record = _walk(files, kept)
        out.seek(0)
        return record
    h = KeyedHasher(naming_key)
    total = 0

    def plain() -> Iterator[bytes]:
        nonlocal total
        for piece in decompress_segment(_pieces(out), name=ref.name, max_plain=ref.plain_size):
            h.update(piece)
            total += len(piece)
            yield piece

    reader = io.BufferedReader(IterReader(plain()), _READ)
    with open_segment(reader, agent_id) as files:
        record = _walk(files, kept)
    while reader.read(_READ):  # the tar's end padding: part of what is named
        pass
    _check_name(ref, naming_key, h, total)
    out.seek(0)
    return record


def _check_name(ref: SegmentRef, naming_key: bytes, plain: bytes | KeyedHasher, size: int) -> None:
    if isinstance(plain, bytes):
        h = KeyedHasher(naming_key)
        h.update(plain)
    else:
        h = plain
    if size != ref.plain_size or h.hexdigest() != ref.name:
        raise IntegrityError(f"segment {ref.name[:16]}", "content does not match its name")


def _walk(files: SegmentFiles, kept: dict[str, bytes] | None = None) -> bytes:
    """Read every file of the segment in order (the tar's checks), keep the record
    (and, into ``kept``, the session files)."""
    with files.open(AGENT_FILES[0]) as f:
        record = f.read(MAX_RECORD + 1)
    for name in AGENT_FILES[1:]:
        with files.open(name) as f:
            _drain(f)
    for name in OPTIONAL_AGENT_FILES:
        with files.open_optional(name) as found:
            if found is not None:
                if kept is not None and name == SESSIONS:
                    kept[name] = found.read()
                else:
                    _drain(found)
    return record


def _drain(f: IO[bytes]) -> None:
    while f.read(_READ):
        pass


def _pieces(f: IO[bytes]) -> Iterator[bytes]:
    while piece := f.read(_READ):
        yield piece


class PackWriter:
    """One restore's pack: agents' compressed segments one after the other.

    Made at the first :meth:`append`; :meth:`sync` before the commit that names
    it; :meth:`discard` when that commit did not happen.
    """

    def __init__(self, folder: Path, label: str) -> None:
        self._folder = folder
        self.name = f"{label}-{os.getpid()}-{os.urandom(4).hex()}{_SUFFIX}"
        self._file: IO[bytes] | None = None
        self._size = 0

    def append(self, segment: IO[bytes]) -> tuple[int, int]:
        """Copy ``segment`` (from its start) to the pack's end; return its offset
        and length."""
        if self._file is None:
            ensure_private_dir(self._folder)
            self._file = open(self._folder / self.name, "xb")  # noqa: SIM115 - kept open
        offset = self._size
        segment.seek(0)
        shutil.copyfileobj(segment, self._file, _READ)
        self._size = self._file.tell()
        return offset, self._size - offset

    def sync(self) -> None:
        """Make the pack durable (before the commit that names it)."""
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        fsync_dir(self._folder)

    def close(self) -> None:
        """Close the file (it stays)."""
        if self._file is not None:
            self._file.close()

    def discard(self) -> None:
        """Close and remove the pack (no commit names it)."""
        self.close()
        if self._file is not None:
            with contextlib.suppress(FileNotFoundError):
                (self._folder / self.name).unlink()


def restore_started(db: Database) -> None:
    """A restore may commit histories to load: readers look until it ended."""
    _RESTORING[db] = _RESTORING.get(db, 0) + 1
    _LOADED.discard(db)


def restore_ended(db: Database) -> None:
    """The restore of :func:`restore_started` committed or gave up (call it once
    its write is over either way)."""
    _RESTORING[db] = _RESTORING.get(db, 1) - 1
    _GENERATION[db] = _GENERATION.get(db, 0) + 1
    _LOADED.discard(db)


# -- after the restore ---------------------------------------------------------


class _Bounded(io.RawIOBase):
    """``length`` bytes of ``f`` from where it stands."""

    def __init__(self, f: IO[bytes], length: int) -> None:
        self._f = f
        self._left = length

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._left <= 0:
            return 0
        data = self._f.read(min(len(buffer), self._left))
        self._left -= len(data)
        buffer[: len(data)] = data
        return len(data)


@contextlib.contextmanager
def _open_packed(folder: Path, pending: restore_pending.Pending) -> Iterator[SegmentFiles]:
    what = f"restored agent {pending.agent_id}"
    try:
        f = open(folder / pending.pack, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        raise IntegrityError(what, f"its pack {pending.pack} is gone") from None
    except OSError as e:  # no file handle, a read error: tried again later
        raise StoreError(f"read {what}: its pack {pending.pack}: {e}") from None
    with f:
        f.seek(pending.offset)
        compressed = io.BufferedReader(_Bounded(f, pending.length), _READ)
        try:
            with zstandard.ZstdDecompressor().stream_reader(compressed) as plain:
                with open_segment(plain, pending.agent_id) as files:
                    yield files
        except zstandard.ZstdError as e:
            raise IntegrityError(what, f"its packed segment does not decode ({e})") from None


async def ensure_loaded(
    db: Database, agent_id: str | None = None, *, after_each: Callable[[], None] | None = None
) -> int:
    """Load the packed history of ``agent_id`` (None: of every restored agent)
    into machine.db now, if it is not loaded yet; return how many agents loaded.

    IntegrityError when ``agent_id``'s history did not load (why is logged at
    the failure, and kept); loading every agent skips those. ``after_each`` is a
    test's fault point, called after each transaction's commit.
    """
    if db in _LOADED:
        return 0
    folder = pack_dir(db)
    loaded = 0
    one_by_one = 0  # after a batch failed: its agents again, one per transaction
    while True:
        generation = _GENERATION.get(db, 0)
        many = _BATCH_AGENTS if one_by_one == 0 else 1
        batch, failed, none_left = await db.read(
            functools.partial(_look, agent_id=agent_id, many=many), what="restored agents to load"
        )
        if none_left and _GENERATION.get(db, 0) == generation and not _RESTORING.get(db):
            _LOADED.add(db)
        if failed is not None:
            raise IntegrityError(
                f"agent {agent_id}", f"its restored history did not load ({failed})"
            )
        if not batch:
            return loaded
        one_by_one = max(0, one_by_one - 1)
        what = f"load restored agent {batch[0].agent_id}" + (
            f" and {len(batch) - 1} more" if len(batch) > 1 else ""
        )
        try:
            freed = await db.write(
                functools.partial(_load, batch=batch, folder=folder), what=what, bulk=True
            )
        except (DiskFull, DatabaseDamaged, StoreError, TransientError):
            raise  # the machine's trouble, not the history's: tried again later
        except Exception as e:
            # The history's: malformed in some way its authentication cannot see.
            if len(batch) > 1:
                one_by_one = len(batch)  # which one it is: one per transaction
                continue
            logger.error("%s: its history does not load, kept as its record alone: %s", what, e)
            fail = functools.partial(_fail, pending=batch[0], reason=str(e), folder=folder)
            for pack in await db.write(fail, what=what):
                _remove(folder, pack)
            continue
        loaded += len(batch)
        for pack in freed:
            _remove(folder, pack)
        if after_each is not None:
            after_each()


def _look(
    conn: sqlite3.Connection, agent_id: str | None, many: int
) -> tuple[list[restore_pending.Pending], str | None, bool]:
    batch = restore_pending.next_pending(conn, agent_id, max_agents=many, max_bytes=_BATCH_BYTES)
    failed = None if agent_id is None else restore_pending.failed_reason(conn, agent_id)
    none_left = not batch and restore_pending.pending_count(conn) == 0
    return batch, failed, none_left


def _remove(folder: Path, pack: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (folder / pack).unlink()
    logger.info("restored pack %s: no history to load is in it; removed", pack)


def failed_pack(agent_id: str) -> str:
    """The pack holding ``agent_id``'s history alone once it did not load."""
    return f"failed-{agent_id}{_SUFFIX}"


def _fail(
    conn: sqlite3.Connection, pending: restore_pending.Pending, reason: str, folder: Path
) -> set[str]:
    """Mark ``pending`` failed, its history copied to a pack of its own (so that
    the restore's pack, holding other agents' plaintext, goes once they load);
    return the packs now unused. In the writer thread, inside the transaction."""
    own = failed_pack(pending.agent_id)
    if pending.pack != own:
        temp = folder / f".{own}.tmp"
        with open(folder / pending.pack, "rb") as src, open(temp, "wb") as dst:
            src.seek(pending.offset)
            left = pending.length
            while left > 0 and (piece := src.read(min(_READ, left))):
                dst.write(piece)
                left -= len(piece)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(temp, folder / own)
        fsync_dir(folder)
    restore_pending.mark_failed(conn, pending.agent_id, reason, own, pending.length)
    if pending.pack != own and not restore_pending.pack_in_use(conn, pending.pack):
        return {pending.pack}
    return set()


def write_failed(folder: Path, pending: restore_pending.Pending, out: IO[bytes]) -> None:
    """Write the plaintext segment of a history that did not load to ``out`` (a
    backup keeps it as it came, rather than the record alone)."""
    with open(folder / pending.pack, "rb") as f:
        f.seek(pending.offset)
        compressed = io.BufferedReader(_Bounded(f, pending.length), _READ)
        with zstandard.ZstdDecompressor().stream_reader(compressed) as plain:
            shutil.copyfileobj(plain, out, _READ)


def forget_failed(db: Database, agent_id: str) -> None:
    """``agent_id`` was deleted: remove its failed history's pack, if any."""
    path = pack_dir(db) / failed_pack(agent_id)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
        logger.info("removed %s with its deleted agent", path.name)


def _load(conn: sqlite3.Connection, batch: list[restore_pending.Pending], folder: Path) -> set[str]:
    try:
        return restore_pending.load(conn, batch, lambda p: _open_packed(folder, p))
    except sqlite3.IntegrityError as e:
        raise InvalidArgument(
            "archive", f"restored history: an id it holds is already on this machine ({e})"
        ) from None


async def sweep_packs(db: Database) -> int:
    """Remove packs no agent's history is in (a restore killed before its commit,
    a loader killed before removing one); return how many. At start only: it
    also lets the histories that did not load be tried once more."""
    await db.write(restore_pending.retry_failed, what="restored histories to retry")
    folder = pack_dir(db)
    if not folder.is_dir():
        return 0
    in_use = await db.read(restore_pending.packs_in_use, what="restored packs")
    removed = 0
    for path in folder.iterdir():
        if path.name in in_use:
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
            logger.info("removed %s: no restored agent's history is in it", path.name)
    return removed
