"""Tar archives that cannot hurt the reader: bounded, regular files only, staged.

Imports and restores read archives that came from somewhere else, so every
entry is checked before a byte of any is written: only regular files whose
path the caller expects; no absolute path, ``..``, link, device, FIFO or
sparse file; entry count, each entry's size, the total unpacked size and the
compression ratio are bounded (a gzip bomb stops at the bound, not at the
end of the disk). Sizes are counted as bytes are really read, never taken
from a header's word.

Extraction goes into a fresh staging folder that the caller commits (renames
or loads) only once the whole archive has been read: a bad archive leaves
nothing behind.

Writing is deterministic (fixed mtime, owner and mode), so the same content
makes the same archive.
"""

from __future__ import annotations

import gzip
import io
import logging
import os
import re
import shutil
import tarfile
import threading
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, Final

from shared.atomic import FILE_MODE, open_atomic
from shared.errors import InvalidArgument

__all__ = [
    "MAX_EXTENDED_HEADER",
    "ArchiveLimits",
    "BoundedTarInfo",
    "entry_kind",
    "extract_staged",
    "write_tar",
    "write_tar_gz",
]

logger = logging.getLogger(__name__)

#: Read and write in pieces of this size: memory stays flat for any entry size.
CHUNK: Final = 1024 * 1024
_GZIP_MAGIC: Final = b"\x1f\x8b"
#: One path component: printable, no separators; the caller's ``accept`` narrows it.
_COMPONENT: Final = re.compile(r"^[A-Za-z0-9._@+=-]{1,255}$")


#: The largest extended header (a PAX record or a GNU long name) a reader takes.
#: The paths of these formats are short; a writer needs a few hundred bytes.
MAX_EXTENDED_HEADER: Final = 1024 * 1024
_EXTENDED: Final = frozenset(
    {tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
     tarfile.SOLARIS_XHDTYPE}
)  # fmt: skip


class ExtendedHeaderTooLarge(tarfile.TarError):
    """An extended header over :data:`MAX_EXTENDED_HEADER` (read whole, it is no entry)."""


class BoundedTarInfo(tarfile.TarInfo):
    """Pass as ``tarinfo=`` to ``tarfile.open``: tarfile reads an extended header's
    payload whole into memory before any entry limit applies (a 150 MiB long name
    in a small archive took 470 MiB); one past :data:`MAX_EXTENDED_HEADER` is
    refused before it is read."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXTENDED and self.size > MAX_EXTENDED_HEADER:
            raise ExtendedHeaderTooLarge(
                f"an extended header of {self.size} bytes (the limit is {MAX_EXTENDED_HEADER})"
            )
        return super()._proc_member(tar)  # type: ignore[misc,no-any-return]


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds on one archive; anything beyond is refused before it is written."""

    max_entries: int = 100_000
    """Entries of any kind, counted as they are read."""
    max_entry_bytes: int = 1024**3
    """One file's size (its header's claim and its real length)."""
    max_total_bytes: int = 8 * 1024**3
    """Every file's bytes added up, as unpacked."""
    max_ratio: int = 200
    """Unpacked bytes per compressed byte, checked once past ``ratio_grace`` bytes."""
    ratio_grace: int = 16 * 1024 * 1024
    """Unpacked bytes read before the ratio counts (small archives compress well)."""


def _refuse(reason: str) -> InvalidArgument:
    return InvalidArgument("archive", reason)


class _Counted(io.RawIOBase):
    """A reader that counts the bytes it hands out and stops past a bound."""

    def __init__(self, inner: BinaryIO, limit: int, what: str) -> None:
        self._inner = inner
        self._limit = limit
        self._what = what
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self._inner.read(len(buffer))
        self.count += len(data)
        if self.count > self._limit:
            raise _refuse(f"{self._what} larger than the limit of {self._limit} bytes")
        buffer[: len(data)] = data
        return len(data)


class _Unpacked(io.RawIOBase):
    """Decompressed bytes, bounded in total and in ratio to the compressed bytes read."""

    def __init__(self, inner: BinaryIO, raw: _Counted, limits: ArchiveLimits) -> None:
        self._inner = inner
        self._raw = raw
        self._limits = limits
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self._inner.read(len(buffer))
        self.count += len(data)
        # Tar headers and padding ride on top of the files' bytes; a little slack
        # keeps an archive exactly at the file limit readable.
        if self.count > self._limits.max_total_bytes + 64 * 1024 * 1024:
            raise _refuse(f"unpacks to more than {self._limits.max_total_bytes} bytes")
        if self.count > self._limits.ratio_grace and self.count > self._limits.max_ratio * max(
            self._raw.count, 1
        ):
            raise _refuse(
                f"compression ratio above {self._limits.max_ratio}:1 (a decompression bomb?)"
            )
        buffer[: len(data)] = data
        return len(data)


def _check_path(name: str) -> str:
    """The entry's path if it is a plain relative path; refuse anything else."""
    if not name or "\\" in name or "\x00" in name:
        raise _refuse(f"entry {name[:80]!r}: not a plain relative path")
    if name.startswith("/"):
        raise _refuse(f"entry {name[:80]!r}: absolute path")
    # What PurePosixPath(name).parts gives for a relative name (empty and "."
    # parts dropped), at a fraction of its cost per entry.
    parts = [part for part in name.split("/") if part and part != "."]
    if ".." in parts:
        raise _refuse(f"entry {name[:80]!r}: path escapes the archive")
    for part in parts:
        if not _COMPONENT.match(part):
            raise _refuse(f"entry {name[:80]!r}: not a plain relative path")
    return "/".join(parts)


def entry_kind(member: tarfile.TarInfo) -> str:
    """What a tar entry is, for an error: "file", "symbolic link", "device", ..."""
    if member.issym():
        return "symbolic link"
    if member.islnk():
        return "hard link"
    if member.ischr() or member.isblk():
        return "device"
    if member.isfifo():
        return "FIFO"
    if member.issparse():
        return "sparse file"
    if member.isdir():
        return "directory"
    if member.isreg():
        return "file"
    return "special entry"


def extract_staged(
    source: Path,
    dest: Path,
    *,
    accept: Callable[[str], bool],
    limits: ArchiveLimits | None = None,
    stop: threading.Event | None = None,
) -> list[str]:
    """Unpack the tar (or ``.tar.gz``) at ``source`` into the new folder ``dest``.

    ``accept(path)`` says whether a file path is one the caller expects;
    directory entries are passed over (folders are made as files need them).
    Returns the file paths in archive order. On any refusal, raises
    InvalidArgument (field ``archive``) naming the entry and the cause, and
    ``dest`` is removed: nothing half-unpacked is left. ``dest`` must not exist.

    The archive is read twice: once to check every entry, writing nothing, and
    only then to unpack it (checked again). A refused archive costs reading
    it, tens of microseconds an entry, and never a file: unpacking 100,000
    tiny files only to remove them took 12 s, and over 4 minutes on a busy disk.
    A write that fails in the second pass (a full disk) raises its OSError.

    Blocks for as long as the archive takes to read: call it off the event
    loop. ``stop``, once set (from another thread), ends it at the next entry
    or piece of one, as a refusal, with ``dest`` removed.
    """
    limits = limits or ArchiveLimits()
    if dest.exists():
        raise FileExistsError(dest)
    paths = _read(source, accept, limits, None, stop)
    # Staging needs no fsync: what it holds is committed elsewhere, or thrown away.
    os.makedirs(dest, mode=0o700)
    try:
        if _read(source, accept, limits, dest, stop) != paths:
            raise _refuse("changed while it was read")
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return paths


def _open_tar(f: BinaryIO, limits: ArchiveLimits) -> tarfile.TarFile:
    """A streaming tar reader over ``f`` (gzip or plain), bounded as the limits say."""
    compressed_limit = os.fstat(f.fileno()).st_size + 1
    raw = _Counted(f, compressed_limit, "archive")
    magic = f.read(2)
    f.seek(0)
    stream: BinaryIO
    if magic == _GZIP_MAGIC:
        unzipped = gzip.GzipFile(fileobj=io.BufferedReader(raw, CHUNK), mode="rb")
        stream = io.BufferedReader(_Unpacked(unzipped, raw, limits), CHUNK)  # type: ignore[arg-type]
    else:
        stream = io.BufferedReader(raw, CHUNK)
    try:
        return tarfile.open(fileobj=stream, mode="r|", tarinfo=BoundedTarInfo)
    except ExtendedHeaderTooLarge as e:
        raise _refuse(str(e)) from None
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise _refuse(f"not a tar archive ({e})") from None


def _read(
    source: Path,
    accept: Callable[[str], bool],
    limits: ArchiveLimits,
    dest: Path | None,
    stop: threading.Event | None,
) -> list[str]:
    """Check every entry of ``source``; with ``dest``, also write each file there.

    Returns the file paths in archive order.
    """
    seen: list[str] = []
    names: set[str] = set()
    total = 0
    count = 0
    with open(source, "rb") as f, _open_tar(f, limits) as tar:
        try:
            while (member := tar.next()) is not None:
                # A stream is never read back: tarfile's list of the members read so
                # far (not in its typed surface) would only grow, some 50 MB by the
                # entry limit.
                tar.members.clear()  # type: ignore[attr-defined]
                if stop is not None and stop.is_set():
                    raise _refuse("stopped before it was read whole")
                count += 1
                if count > limits.max_entries:
                    raise _refuse(f"more than {limits.max_entries} entries")
                path = _check_path(member.name)
                kind = entry_kind(member)
                if kind == "directory":
                    continue
                if kind != "file":
                    raise _refuse(f"entry {path!r}: a {kind}; only regular files are allowed")
                if not accept(path):
                    raise _refuse(f"entry {path!r}: not a path this format has")
                if path in names:
                    raise _refuse(f"entry {path!r}: appears twice")
                if member.size > limits.max_entry_bytes:
                    raise _refuse(
                        f"entry {path!r}: claims {member.size} bytes, "
                        f"over the limit of {limits.max_entry_bytes}"
                    )
                total += member.size
                if total > limits.max_total_bytes:
                    raise _refuse(f"files add up to more than {limits.max_total_bytes} bytes")
                names.add(path)
                seen.append(path)
                if dest is not None:
                    _write_entry(tar, member, dest / path, path, stop)
        except ExtendedHeaderTooLarge as e:
            raise _refuse(str(e)) from None
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise _refuse(f"damaged or truncated ({e})") from None
        except OSError as e:
            if dest is not None:
                # These bytes were read whole once already: an OSError now is the
                # disk's (full, gone read-only), not the archive's.
                raise
            raise _refuse(f"damaged or truncated ({e})") from None
    return seen


def _write_entry(
    tar: tarfile.TarFile,
    member: tarfile.TarInfo,
    target: Path,
    path: str,
    stop: threading.Event | None,
) -> None:
    os.makedirs(target.parent, mode=0o700, exist_ok=True)
    reader = tar.extractfile(member)
    if reader is None:  # pragma: no cover - isreg() members always have data
        raise _refuse(f"entry {path!r}: has no data")
    written = 0
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    with os.fdopen(fd, "wb") as out, reader:
        while chunk := reader.read(CHUNK):
            if stop is not None and stop.is_set():
                raise _refuse("stopped before it was read whole")
            written += len(chunk)
            out.write(chunk)
    if written != member.size:
        raise _refuse(f"entry {path!r}: truncated ({written} of {member.size} bytes)")


#: Every entry's mtime: archives of the same content are byte-equal.
FIXED_MTIME: Final = 0


def write_tar(out: BinaryIO, entries: Iterable[tuple[str, bytes | Path | IO[bytes]]]) -> None:
    """Write ``entries`` (path, bytes, a file to copy, or an open file read from its
    start to its end) as a plain tar stream to ``out``.

    Deterministic: fixed mtime, owner and mode, so the same entries make the
    same bytes (backup segments are named by a hash of them). Paths are
    checked as on reading.

    The bytes are those ``tarfile`` writes in ``"w|"`` PAX mode (its headers,
    512-byte padding and 10 KiB record end), written here without its stream
    buffer: ``tarfile`` hands ``out`` 10 KiB at a time through copies, and a
    backup's ``out`` hashes and compresses what it is given, so whole files
    (or 1 MiB pieces) in one call are most of the saving on a full backup.
    """
    offset = 0
    for name, data in entries:
        info = tarfile.TarInfo(_check_path(name))
        info.mtime = FIXED_MTIME
        info.mode = FILE_MODE
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        if isinstance(data, bytes):
            info.size = len(data)
            offset += _put_entry(out, info, data)
        elif isinstance(data, Path):
            with open(data, "rb") as src:
                info.size = os.fstat(src.fileno()).st_size
                offset += _put_entry(out, info, src)
        else:
            info.size = data.seek(0, os.SEEK_END)
            data.seek(0)
            offset += _put_entry(out, info, data)
    end = tarfile.BLOCKSIZE * 2
    offset += end
    end += -offset % tarfile.RECORDSIZE
    out.write(tarfile.NUL * end)


def _put_entry(out: BinaryIO, info: tarfile.TarInfo, data: bytes | IO[bytes]) -> int:
    """One entry's header, its ``info.size`` bytes from ``data`` and its padding;
    returns the bytes written."""
    header = info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
    out.write(header)
    if isinstance(data, bytes):
        out.write(data)
    else:
        left = info.size
        while left:
            piece = data.read(min(CHUNK, left))
            if not piece:
                raise OSError(f"tar entry {info.name!r}: its file ended {left} bytes early")
            out.write(piece)
            left -= len(piece)
    pad = -info.size % tarfile.BLOCKSIZE
    if pad:
        out.write(tarfile.NUL * pad)
    return len(header) + info.size + pad


def write_tar_gz(
    dest: Path,
    entries: Iterable[tuple[str, bytes | Path]],
    *,
    level: int = 6,
) -> int:
    """Write ``entries`` (path, bytes or a file to copy) as a ``.tar.gz`` at ``dest``.

    The archive is written to a temp file, fsynced and renamed: ``dest`` is
    either absent or whole. Returns the archive's size in bytes.
    """
    with (
        open_atomic(dest) as out,
        gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=level, mtime=0) as gz,
    ):
        write_tar(gz, entries)  # type: ignore[arg-type]
    return dest.stat().st_size
