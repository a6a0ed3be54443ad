"""Packs: many sealed segments in one file of a folder backup target.

A full backup of a thousand agents made a thousand segment files, and
creating, syncing and renaming them was the largest cost left in the
daemon's process. The segment worker processes (machine.backups.workers.segment_workers)
instead append the segments they make to a pack, one open pack each, and the
target publishes a pack with its index at the backup's commit. Layout inside
a folder target, beside ``segments/`` (segments written one by one, which
every reader still reads)::

    packs/<pack id>            sealed segments back to back (a store object)
    packs/<pack id>.index      where each is: JSON, see encode_index

A pack holds sealed segments exactly as a segment file does: a manifest
authenticates each by its name and key, so neither a pack nor its index
needs a MAC; a tampered index points at bytes that do not authenticate.
A pack id starts with the time it was made (hex nanoseconds), so that of two
packs holding the same segment (a segment sent again to replace a damaged
copy, or a crash in the middle of a repack) the newer one is the one read and
kept.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from shared.errors import IntegrityError
from shared.object_file import PendingObject

__all__ = [
    "INDEX_SUFFIX",
    "PACKS",
    "PACK_BYTES",
    "PackEntry",
    "PackWriter",
    "PackedSegment",
    "debris_pack_id",
    "decode_index",
    "encode_index",
    "is_pack_id",
    "new_pack_id",
    "newest_pack_id",
    "temp_pack_id",
]

#: Inside a target: the packs and their indexes.
PACKS: Final = "packs/"
INDEX_SUFFIX: Final = ".index"
#: A pack is closed once it holds this many bytes. Small enough that a prune
#: rewriting the packs that hold a few dropped segments copies little; large
#: enough that a full backup makes tens of files, not thousands.
PACK_BYTES: Final = 4 * 1024 * 1024
_INDEX_VERSION: Final = 1
_PACK_ID: Final = re.compile(r"[0-9a-f]{32}")
_SEGMENT_NAME: Final = re.compile(r"[0-9a-f]{64}")
# A pack's temp file as PendingObject.create names it.
_TEMP: Final = re.compile(r"\.([0-9a-f]{32})\.[0-9a-f]{12}\.tmp")
# ... and an index's.
_DEBRIS: Final = re.compile(r"\.([0-9a-f]{32})(?:\.index)?\.[0-9a-f]{12}\.tmp")


def new_pack_id(after: str = "") -> str:
    """A new pack id: the time (hex nanoseconds, so ids sort by age), then random;
    greater than ``after`` (a pack id) even when the clock stepped back."""
    now = time.time_ns()
    if after:
        now = max(now, int(after[:16], 16) + 1)
    return f"{now:016x}{os.urandom(8).hex()}"


def newest_pack_id(folder: Path) -> str:
    """The greatest pack id in ``folder`` (published or being written), or "" (blocking).

    A new pack takes an id above it: of two packs holding one segment the
    newer is read, so a pack made after the clock stepped back must still
    sort after every pack already there.
    """
    newest = ""
    try:
        with os.scandir(folder) as scan:
            for entry in scan:
                pack = debris_pack_id(entry.name) or entry.name.removesuffix(INDEX_SUFFIX)
                if is_pack_id(pack) and pack > newest:
                    newest = pack
    except (FileNotFoundError, NotADirectoryError):
        pass
    return newest


def is_pack_id(value: str) -> bool:
    """Whether ``value`` is a pack id (32 lower-case hex characters)."""
    return _PACK_ID.fullmatch(value) is not None


def temp_pack_id(temp_name: str) -> str | None:
    """The pack id of a pack's temp file name, or None for any other name."""
    match = _TEMP.fullmatch(temp_name)
    return match.group(1) if match else None


def debris_pack_id(name: str) -> str | None:
    """The pack id of a pack's or an index's temp file name, or None."""
    match = _DEBRIS.fullmatch(name)
    return match.group(1) if match else None


@dataclass(frozen=True)
class PackedSegment:
    """A sealed segment a worker appended to a pack still being written."""

    pack: str
    temp: str
    """The pack's temp file name (in the target's packs folder)."""
    offset: int
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"pack": self.pack, "temp": self.temp, "offset": self.offset, "size": self.size}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PackedSegment:
        pack, temp = str(data["pack"]), str(data["temp"])
        offset, size = int(data["offset"]), int(data["size"])
        if temp_pack_id(temp) != pack or offset < 0 or size <= 0:
            raise ValueError(f"not a packed segment: {data!r}"[:200])
        return cls(pack, temp, offset, size)


@dataclass(frozen=True)
class PackEntry:
    """Where a pack holds one segment (offsets count from the pack's content)."""

    name: str
    offset: int
    size: int


class PackWriter:
    """Appends sealed segments to packs in ``folder`` (blocking; one per process).

    Each pack is written unsynced under a temp name and closed (its header
    finished and fsynced) once it holds :data:`PACK_BYTES`, or at
    :meth:`close`; the target publishes it under its id at the commit.
    """

    def __init__(self, folder: Path, *, limit: int = PACK_BYTES) -> None:
        self._folder = folder
        self._limit = limit
        self._pack: PendingObject | None = None
        self._id = ""

    def add(self, chunks: Iterable[bytes]) -> PackedSegment:
        """Append one sealed segment; where it went."""
        if self._pack is None:
            self._id = new_pack_id(max(self._id, newest_pack_id(self._folder)))
            self._pack = PendingObject.create(PACKS + self._id, self._folder / self._id)
        pack = self._pack
        offset = pack.size
        for chunk in chunks:
            pack.write(chunk)
        placed = PackedSegment(self._id, pack.temp.name, offset, pack.size - offset)
        if pack.size >= self._limit:
            self.close()
        return placed

    def close(self) -> None:
        """Finish the pack being written (fsynced), if any."""
        if self._pack is not None:
            pack, self._pack = self._pack, None
            pack.close(sync=True)

    def discard(self) -> None:
        """Drop the pack being written."""
        if self._pack is not None:
            pack, self._pack = self._pack, None
            pack.discard()


def encode_index(pack_size: int, entries: Iterable[PackEntry]) -> bytes:
    """A pack's index: its content size and, for each segment, name, offset, size."""
    rows = [[e.name, e.offset, e.size] for e in sorted(entries, key=lambda e: e.offset)]
    body = {"version": _INDEX_VERSION, "size": pack_size, "segments": rows}
    return json.dumps(body, separators=(",", ":")).encode()


def decode_index(data: bytes, pack_id: str, pack_size: int) -> list[PackEntry]:
    """The entries of a pack's index, checked against the pack's content size.

    IntegrityError for anything but a version-1 index of segment names whose
    ranges lie inside the pack and do not overlap.
    """

    def refuse(why: str) -> IntegrityError:
        return IntegrityError(f"backup pack {pack_id}", f"index {why}")

    try:
        body = json.loads(data)
    except ValueError:
        raise refuse("is not JSON") from None
    if not isinstance(body, dict) or body.get("version") != _INDEX_VERSION:
        raise refuse("has an unknown version")
    if body.get("size") != pack_size:
        raise refuse(f"names {body.get('size')!r} bytes; the pack holds {pack_size}")
    rows = body.get("segments")
    if not isinstance(rows, list):
        raise refuse("lists no segments")
    entries: list[PackEntry] = []
    end = 0
    for row in rows:
        if (
            not isinstance(row, list)
            or len(row) != 3
            or not isinstance(row[0], str)
            or _SEGMENT_NAME.fullmatch(row[0]) is None
            or type(row[1]) is not int
            or type(row[2]) is not int
        ):
            raise refuse("holds a malformed entry")
        name, offset, size = row
        if offset < end or size <= 0 or offset + size > pack_size:
            raise refuse(f"places segment {name[:16]} outside the pack or over another")
        end = offset + size
        entries.append(PackEntry(name, offset, size))
    return entries
