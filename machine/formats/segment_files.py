"""An agent's backup segment (a plain export-format tar) read in place, front to back.

A restore used to unpack each fetched segment into a folder of four files and
then read them back; reading the tar as a stream while the rows go in saves
writing, reading and deleting the whole plaintext once more. The segment was
authenticated and checked against its name before a restore reads it, but it
is still read as untrusted input: exactly the agent's four files, in the
format's order, then its optional files (schedules), regular files only, each
bounded.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Final

from machine.formats.export import AGENT_FILES, OPTIONAL_AGENT_FILES, agent_path
from shared.archive import BoundedTarInfo, entry_kind
from shared.errors import IntegrityError

__all__ = ["MAX_FILE_BYTES", "SegmentFiles", "open_segment"]

logger = logging.getLogger(__name__)

#: One file inside a segment (as shared.archive's default entry limit).
MAX_FILE_BYTES: Final = 1024**3
_READ: Final = 1024 * 1024
#: A file up to this size is read into memory in one piece.
_IN_MEMORY: Final = 8 * 1024 * 1024


class SegmentFiles:
    """Opens the agent's files one after the other, in :data:`AGENT_FILES` order.

    Pass :meth:`open` to ``machine.storage.tables.export.load_agent_files``. Any other
    entry, order, kind or size is an IntegrityError naming the agent.
    """

    def __init__(self, tar: tarfile.TarFile, agent_id: str) -> None:
        self._tar = tar
        self._members = iter(tar)
        self._agent_id = agent_id
        self._next = 0
        # A member read ahead by open_optional that was not the file it asked for.
        self._peeked: tarfile.TarInfo | None = None
        self._optional_read: set[str] = set()

    def _refuse(self, why: str) -> IntegrityError:
        return IntegrityError(f"backup agent {self._agent_id}", f"segment {why}")

    def _next_member(self) -> tarfile.TarInfo | None:
        if self._peeked is not None:
            member, self._peeked = self._peeked, None
            return member
        try:
            return next(self._members, None)
        except (tarfile.TarError, EOFError, OSError) as e:
            raise self._refuse(f"is damaged ({e})") from None

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        """The file ``name`` of the agent, which must be the next one in the segment."""
        if self._next >= len(AGENT_FILES) or AGENT_FILES[self._next] != name:
            raise self._refuse(f"read out of order ({name})")
        self._next += 1
        member = self._next_member()
        if member is None:
            raise self._refuse(f"ends before {name}")
        with self._read(member, name) as reader:
            yield reader

    @contextlib.contextmanager
    def open_optional(self, name: str) -> Iterator[IO[bytes] | None]:
        """The optional file ``name`` (after every required one), or None when the
        segment does not hold it (an agent without schedules)."""
        if name not in OPTIONAL_AGENT_FILES or self._next != len(AGENT_FILES):
            raise self._refuse(f"read out of order ({name})")
        if name in self._optional_read:
            raise self._refuse(f"read {name} twice")
        self._optional_read.add(name)
        member = self._next_member()
        if member is None or member.name != agent_path(self._agent_id, name):
            self._peeked = member  # not ours: finish() judges it
            yield None
            return
        with self._read(member, name) as reader:
            yield reader

    @contextlib.contextmanager
    def _read(self, member: tarfile.TarInfo, name: str) -> Iterator[IO[bytes]]:
        expected = agent_path(self._agent_id, name)
        if member.name != expected:
            raise self._refuse(f"holds {member.name!r} where {expected!r} belongs")
        if not member.isreg():
            target = f" to {member.linkname!r}" if member.issym() or member.islnk() else ""
            kind = entry_kind(member)
            raise self._refuse(f"holds {name} as a {kind}{target}, not as a regular file")
        if member.size > MAX_FILE_BYTES:
            raise self._refuse(f"claims {member.size} bytes for {name}")
        reader = self._tar.extractfile(member)
        if reader is None:  # pragma: no cover - regular members always have data
            raise self._refuse(f"has no data for {name}")
        try:
            with reader:
                if member.size <= _IN_MEMORY:
                    # Read whole: lines then come from a BytesIO (C), not through
                    # the tar stream's Python layers, line by line.
                    data = reader.read(member.size + 1)
                    if len(data) != member.size:
                        raise self._refuse(f"holds {len(data)} bytes for {name}, not {member.size}")
                    yield io.BytesIO(data)
                    return
                yield reader
                # Read what the loader left (nothing, for well-formed JSON Lines), so
                # the stream stands at the next member and a short file is noticed.
                while reader.read(_READ):
                    pass
        except (tarfile.TarError, EOFError) as e:
            raise self._refuse(f"is damaged ({e})") from None

    def finish(self) -> None:
        """Check that every file was read and nothing follows them."""
        if self._next != len(AGENT_FILES):
            raise self._refuse("was not read whole")
        extra = self._next_member()
        if extra is not None:
            raise self._refuse(f"holds an extra entry {extra.name!r}")


@contextlib.contextmanager
def open_segment(source: Path | IO[bytes] | bytes, agent_id: str) -> Iterator[SegmentFiles]:
    """Read the plaintext segment at ``source`` (an agent's export-format tar: a
    path, a binary file open for reading, or the whole of it in memory)."""
    # In memory the tar reads its members in place (a stream's buffering, in
    # Python, is most of the cost of walking a small segment).
    in_memory = isinstance(source, bytes)
    opened: contextlib.AbstractContextManager[IO[bytes]]
    if isinstance(source, bytes):
        opened = contextlib.nullcontext(io.BytesIO(source))
    elif isinstance(source, Path):
        opened = open(source, "rb")
    else:
        opened = contextlib.nullcontext(source)
    with opened as f:
        try:
            if in_memory:
                tar = tarfile.open(fileobj=f, mode="r:", tarinfo=BoundedTarInfo)
            else:
                tar = tarfile.open(fileobj=f, mode="r|", tarinfo=BoundedTarInfo)
        except (tarfile.TarError, EOFError, OSError) as e:
            what = f"backup agent {agent_id}"
            raise IntegrityError(what, f"segment is not a tar ({e})") from None
        with tar:
            files = SegmentFiles(tar, agent_id)
            yield files
            files.finish()
