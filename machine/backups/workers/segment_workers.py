"""Agent segments made in worker processes, for a backup that reads many agents.

Making an agent's segment is a database dump (Python), a tar, a keyed hash and
zstd: in the daemon's process the dump trades the interpreter lock with the
threads that compress and send on every row (see :mod:`machine.backups.workers.pool`).
For a backup of :data:`MIN_AGENTS` agents or more, worker processes (entry
point :mod:`machine.backups.workers.segment_worker_main`) each open the database read-only and
make whole segments: one read transaction per agent, as the in-process path
does, and the same bytes (:func:`dump_agent_spooled` is both's), compressed and
encrypted under the segment's key; the daemon sends them as they are.

A request is ``{"agent": id}``; the answer ``{"name", "plain"}`` with the
stored bytes, or ``{"name", "plain", "path"}`` for a segment past
:data:`_IN_PIPE` written to a file in the backup's private stage folder, or
``{"refused": [field, reason]}`` / ``{"failed": message}``.
"""

from __future__ import annotations

import contextlib
import io
import os
import sqlite3
import tempfile
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

from machine.backups.workers.pool import Answer, Handler, WorkerGone, WorkerPool, processes, serve
from machine.core.agents import (
    SessionCapture,
    SessionHomes,
    capture_session_files,
    portable_settings,
)
from machine.formats.backup import SEGMENT_CHUNK, SegmentCompressor, encrypt_segment, segment_key
from machine.formats.export import AGENT_FILES, OPTIONAL_AGENT_FILES, SESSIONS, agent_path
from machine.storage import restored
from machine.storage.tables import export as store_export
from machine.storage.tables import restore_pending
from shared.archive import write_tar
from shared.atomic import FILE_MODE
from shared.backup_packs import PackedSegment, PackWriter
from shared.errors import InvalidArgument, NotFound, StoreError

__all__ = [
    "MIN_AGENTS",
    "MadeSegment",
    "SegmentWorkers",
    "processes",
    "dump_agent_spooled",
]

#: Agents to (re)encode from which a backup starts workers. Starting one (an
#: interpreter and its imports) costs about 0.2 s of CPU; below this a backup
#: takes well under a second in the daemon's process either way.
MIN_AGENTS: Final = 32
#: Compressed bytes a worker hands back through the pipe; past it, a file.
_IN_PIPE: Final = 8 * 1024 * 1024
#: A dumped export file kept in memory up to this size (then a temp file).
_SPOOL: Final = 1024 * 1024


@dataclass(frozen=True)
class MadeSegment:
    """One agent's segment as made: its name, plaintext size and stored bytes."""

    name: str
    plain_size: int
    stored: bytes | Path
    """Its bytes as stored (compressed and encrypted under its key), or a file of
    them (in the stage folder) that the caller now owns and removes."""
    packed: PackedSegment | None = None
    """Where it was appended to a pack in the target instead (``stored`` is empty)."""


def dump_agent_spooled(
    conn: sqlite3.Connection,
    agent_id: str,
    stack: contextlib.ExitStack,
    work_dir: Path,
    *,
    since_seq: int = 0,
    homes: SessionHomes | None = None,
    known: Mapping[str, str] | None = None,
) -> tuple[list[tuple[str, IO[bytes]]], SessionCapture]:
    """Dump ``agent_id`` (one read of ``conn``: call it inside one read transaction)
    into spooled files closed with ``stack``; return them as its segment's tar
    entries, and what of its CLI session files they hold.

    Spooled (in memory, on disk past :data:`_SPOOL`) because a tar header names
    its file's size before the file. Write the entries with
    :func:`shared.archive.write_tar`: that is the agent's plaintext segment
    (with ``since_seq``, its delta: see ``store_export.dump_agent_to``). With
    ``homes`` the agent's session files under the CLIs' homes go in as
    ``sessions.tar`` (with ``known``, the chain's hashes of them, only those
    that changed: ``machine.runtimes.session_files``).
    """
    spools: dict[str, IO[bytes]] = {}

    def spool(name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        # Made when the dump opens the file: optional files only when written.
        if name not in spools:
            spools[name] = stack.enter_context(
                tempfile.SpooledTemporaryFile(max_size=_SPOOL, mode="w+b", dir=str(work_dir))
            )
        return contextlib.nullcontext(spools[name])

    record = store_export.dump_agent_to(
        conn, agent_id, spool, portable=portable_settings, since_seq=since_seq
    )
    captured = SessionCapture()
    if homes is not None:
        with spool(SESSIONS) as f:
            captured = capture_session_files(
                homes,
                record["runtime_settings"],
                record["session_id"],
                f,
                known=known,
                label=agent_id,
            )
        if f.tell() == 0:  # nothing to carry: no file, so the segment reads as before
            del spools[SESSIONS]
    names = [*AGENT_FILES, *(n for n in OPTIONAL_AGENT_FILES if n in spools)]
    return [(agent_path(agent_id, n), spools[n]) for n in names], captured


# -- in the worker process ---------------------------------------------------


class _Maker:
    """A worker's handler: makes the segment of each agent asked for."""

    def __init__(self, settings: dict[str, Any]) -> None:
        uri = f"file:{urllib.parse.quote(settings['db'])}?mode=ro"
        self._conn = sqlite3.connect(uri, uri=True, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA busy_timeout = 30000")
        self._naming_key = bytes.fromhex(settings["naming_key"])
        self._work = Path(settings["work"])
        self._restored = Path(settings["db"]).parent / restored.PACK_DIR
        self._homes = SessionHomes(
            Path(settings["claude_home"]) if settings.get("claude_home") else None,
            Path(settings["codex_home"]) if settings.get("codex_home") else None,
        )
        folder = settings.get("packs")
        self._packs = PackWriter(Path(folder)) if folder else None

    def __call__(self, request: dict[str, Any]) -> Answer:
        agent_id = str(request["agent"])
        return _make(
            self._conn,
            agent_id,
            self._naming_key,
            self._work,
            self._restored,
            self._packs,
            self._homes,
        )

    def close(self) -> None:
        """Finish the pack being written: the daemon publishes it once we are gone."""
        if self._packs is not None:
            self._packs.close()


def _make(
    conn: sqlite3.Connection,
    agent_id: str,
    naming_key: bytes,
    work: Path,
    restored_dir: Path,
    writer: PackWriter | None = None,
    homes: SessionHomes | None = None,
) -> Answer:
    compressed = io.BytesIO()
    compressor = SegmentCompressor(naming_key, compressed)
    try:
        with contextlib.ExitStack() as stack:
            conn.execute("BEGIN")
            try:
                failed = restore_pending.failed_history(conn, agent_id)
                entries = (
                    []
                    if failed
                    else dump_agent_spooled(conn, agent_id, stack, work, homes=homes)[0]
                )
            finally:
                conn.execute("COMMIT")
            if failed is not None:  # kept as it came: a restored history that did not load
                restored.write_failed(restored_dir, failed, compressor)  # type: ignore[arg-type]
            else:
                write_tar(compressor, entries)  # type: ignore[arg-type]
        name = compressor.finish()
    except NotFound:
        return {"missing": agent_id}, b""
    except InvalidArgument as e:
        return {"refused": [e.field, e.reason]}, b""
    except (sqlite3.Error, OSError) as e:
        return {"failed": f"{type(e).__name__}: {e}"}, b""
    key = segment_key(naming_key, name)
    view = compressed.getbuffer()  # no copy of the compressed bytes
    pieces = (view[i : i + SEGMENT_CHUNK] for i in range(0, len(view), SEGMENT_CHUNK))
    stored = encrypt_segment(pieces, name=name, key=key)  # a chunk at a time
    if writer is not None:
        placed = writer.add(stored)
        return {"name": name, "plain": compressor.plain_size, "packed": placed.to_json()}, b""
    # Encryption adds a header and 17 bytes a chunk: well inside the margin.
    if len(view) <= _IN_PIPE - 64 * 1024:
        return {"name": name, "plain": compressor.plain_size}, b"".join(stored)
    fd, path = tempfile.mkstemp(dir=work, prefix=".made-")
    with open(fd, "wb") as f:
        os.fchmod(f.fileno(), FILE_MODE)
        for chunk in stored:
            f.write(chunk)
    return {"name": name, "plain": compressor.plain_size, "path": path}, b""


def main() -> None:
    """Serve one backup's agents on stdin/stdout (see the module doc)."""
    makers: list[_Maker] = []

    def start(settings: dict[str, Any]) -> Handler:
        makers.append(_Maker(settings))
        return makers[-1]

    serve(start)
    for maker in makers:  # the end of stdin: the daemon waits for us to exit
        maker.close()


# -- in the daemon -----------------------------------------------------------


def _drop(answer: dict[str, Any]) -> None:
    """A made segment nobody waits for: its file must not stay behind."""
    if "path" in answer:
        Path(answer["path"]).unlink(missing_ok=True)


class SegmentWorkers:
    """Worker processes making agent segments; ``async with`` it, then call it."""

    def __init__(
        self,
        db_path: Path,
        *,
        naming_key: bytes,
        work_dir: Path,
        count: int,
        pack_folder: Path | None = None,
        homes: SessionHomes | None = None,
    ) -> None:
        """With ``pack_folder`` (a folder target's, see shared.backup_packs) the
        workers append the segments to packs there, and answer where; with
        ``homes`` they add the agents' CLI session files (as the daemon does)."""
        settings = {
            "db": str(db_path),
            "naming_key": naming_key.hex(),
            "work": str(work_dir),
            "packs": str(pack_folder) if pack_folder else "",
            "claude_home": str(homes.claude) if homes and homes.claude else "",
            "codex_home": str(homes.codex) if homes and homes.codex else "",
        }
        self._pool = WorkerPool(
            "machine.backups.workers.segment_worker_main", settings, count=count, dropped=_drop
        )
        #: Agents to have in hand at once: one in each worker, one waiting each.
        self.parallel = 2 * count

    async def __aenter__(self) -> SegmentWorkers:
        await self._pool.__aenter__()
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await self._pool.__aexit__(exc_type, exc, tb)

    async def __call__(self, agent_id: str) -> MadeSegment:
        """Make ``agent_id``'s segment in the least busy worker."""
        try:
            answer, data = await self._pool.request({"agent": agent_id})
        except WorkerGone as e:
            raise WorkerGone(f"back up agent {agent_id}: {e}") from None
        if "missing" in answer:
            raise NotFound("agent", agent_id)  # erased or deleted since the backup began
        if "refused" in answer:
            raise InvalidArgument(*answer["refused"])
        if "failed" in answer:
            raise StoreError(f"back up agent {agent_id}: {answer['failed']}")
        if "packed" in answer:
            placed = PackedSegment.from_json(answer["packed"])
            return MadeSegment(answer["name"], answer["plain"], b"", placed)
        stored = Path(answer["path"]) if "path" in answer else data
        return MadeSegment(answer["name"], answer["plain"], stored)
