"""Restore: a fetched backup's agents committed to machine.db, archived.

The agents, the erased list and the attachments the backup holds are committed
in one transaction (:func:`machine.backups.transfer.commit_staged`, the commit
point), skipping agents already here or erased. Each agent's stored segment is
decoded in worker threads a few ahead of the one loading, authenticated and
checked, and packed (:mod:`machine.storage.restored`) inside that transaction:
a refused one rolls it back. The pack is fsynced before the
commit and removed when the transaction did not commit; once written, the
transaction is waited for even by a cancelled caller, so a committed row never
names a pack that is gone. Histories load into machine.db after the commit.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from machine.backups.reader import FetchedBackup, StoredSegment, stored_chunks
from machine.backups.transfer import ArrivingSessions, InResult, commit_staged
from machine.core.agents import ArrivingSettings, SessionHomes
from machine.core.recorder import complete
from machine.formats.backup import SegmentRef
from machine.formats.export import SESSIONS
from machine.formats.segment_files import open_segment
from machine.storage import restored
from machine.storage.db import Database
from machine.storage.tables import export as store_export
from machine.storage.tables import restore_pending, search_backlog
from shared.ids import is_valid_id

__all__ = ["restore_fetched"]

logger = logging.getLogger(__name__)

#: A restore's agent segments decoded ahead of the one loading, and the threads doing it.
_AHEAD: Final = 3
_DECODERS: Final = 2

#: Bytes of a decoded agent segment kept in memory (past them it spills to disk).
_SPOOL: Final = 4 * 1024 * 1024


_Spool = tempfile.SpooledTemporaryFile[bytes]


def _spool(folder: Path) -> _Spool:
    return tempfile.SpooledTemporaryFile(max_size=_SPOOL, mode="w+b", dir=str(folder))


async def restore_fetched(
    db: Database,
    fetched: FetchedBackup,
    *,
    attachments_dir: Path,
    erased: set[str],
    now: float | None = None,
    after_load: Callable[[], None] | None = None,
    in_commit: Callable[[Any], None] | None = None,
    homes: SessionHomes | None = None,
) -> InResult:
    """Restore a fetched backup's agents (archived), skipping existing and erased ones.

    ``in_commit(conn)`` writes with them in the restore's one transaction
    (:func:`~machine.backups.transfer.commit_staged`).

    Each stored agent segment is authenticated, checked and packed
    (:mod:`machine.storage.restored`), and its record committed in the one transaction
    with where its history lies; histories are loaded into machine.db after the
    commit (then indexed for search), or at once for an agent someone reads.
    Segments fetched decoded (``fetch(decode_agents=True)``) are loaded whole.
    The agents' CLI session files go back under ``homes`` (none: dropped).
    """
    queued_at = time.time() if now is None else now
    usage = fetched.manifest.usage
    runs = store_export.usage_by_run(usage)
    usage_of: dict[str, list[dict[str, Any]]] = {}
    for row in usage:
        usage_of.setdefault(str(row.get("agent_id")), []).append(row)
    pack = restored.PackWriter(restored.pack_dir(db), fetched.manifest.backup_id)
    ahead = _DecodeAhead(fetched.stored_agents, fetched.manifest.naming_key, fetched.folder)
    arriving = ArrivingSettings()
    sessions = ArrivingSessions(homes, arriving)

    def load_whole(conn: Any, agent_id: str, segment: Path) -> str:
        with open_segment(segment, agent_id) as files:
            return store_export.load_agent_files(
                conn,
                agent_id,
                files.open,
                optional=files.open_optional,
                runs=runs,
                index=False,
                now=queued_at,
                settings_of=arriving,
                sessions=sessions,
            )

    def load(conn: Any, agent_id: str) -> str:
        if agent_id not in fetched.stored_agents:
            return load_whole(conn, agent_id, fetched.agent_files[agent_id])
        with ahead.take(agent_id) as decoded:
            record = store_export.parse_record(decoded.record, agent_id)
            if record["agent_id"] != agent_id:
                return str(record["agent_id"])  # refused by the caller
            store_export.insert_record(conn, record, agent_id, settings_of=arriving)
            if decoded.sessions is not None:
                sessions(agent_id, decoded.sessions)
            offset, length = pack.append(decoded.packed)
        restore_pending.queue(
            conn, agent_id, pack.name, offset, length, usage_of.get(agent_id, ()), queued_at
        )
        search_backlog.queue_for_index(conn, agent_id, queued_at)
        return agent_id

    # Stored agents are read by ``load``, not from a folder: their value is unused.
    agents = {**fetched.agent_files, **dict.fromkeys(fetched.stored_agents, fetched.folder)}
    committed = False
    restored.restore_started(db)
    # Once written, the transaction may commit whatever the caller does: a
    # cancelled caller (a client gone, a daemon stopping) waits for its end, or
    # the pack its rows name could be removed under them.
    commit = asyncio.ensure_future(
        commit_staged(
            db,
            agents,
            dict(fetched.attachment_files),
            attachments_dir,
            usage=[],
            erased=erased,
            what=f"restore {fetched.manifest.backup_id}",
            erased_entries=_erased_entries(fetched.manifest.erased),
            load=load,
            start=ahead.start,
            whole=False,
            after_load=after_load,
            before_commit=pack.sync,
            in_commit=in_commit,
            arriving=arriving,
            sessions=sessions,
        )
    )
    try:
        result = await complete(commit)
        committed = True
        return result
    finally:
        committed = committed or (
            commit.done() and not commit.cancelled() and commit.exception() is None
        )
        restored.restore_ended(db)
        await asyncio.to_thread(ahead.close)
        if committed:
            pack.close()
        else:
            pack.discard()


@dataclass
class _Decoded:
    """An agent's segment, authenticated and checked: its compressed plaintext
    (to pack) and its record."""

    packed: _Spool
    record: bytes
    sessions: bytes | None = None
    """Its ``sessions.tar``, if any: put back when the record is inserted."""

    def __enter__(self) -> _Decoded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.packed.close()


class _DecodeAhead:
    """Decodes a restore's stored agent segments in worker threads, a few ahead of
    the agent the writer thread is packing.

    Decrypting, decompressing and hashing let go of the GIL, so they run on the
    other core while the writer packs and inserts records. A segment is handed
    out only once authenticated whole, checked against its name and its tar
    walked (:func:`machine.storage.restored.decode_for_pack`); a refused one raises in
    the writer, and the restore's transaction rolls back.
    """

    def __init__(
        self, segments: dict[str, tuple[SegmentRef, StoredSegment]], naming_key: bytes, work: Path
    ) -> None:
        self._segments = segments
        self._key = naming_key
        self._work = work
        self._pool = ThreadPoolExecutor(max_workers=_DECODERS, thread_name_prefix="restore-decode")
        self._order: list[str] = []
        self._next = 0
        self._futures: dict[str, Future[_Decoded]] = {}

    def start(self, order: list[str]) -> None:
        """The agents to be taken, in order: start decoding the first ones."""
        self._order = [a for a in order if a in self._segments]
        self._fill()

    def _fill(self) -> None:
        while self._next < len(self._order) and len(self._futures) < _AHEAD:
            agent_id = self._order[self._next]
            self._next += 1
            self._futures[agent_id] = self._pool.submit(self._decode, agent_id)

    def _decode(self, agent_id: str) -> _Decoded:
        ref, stored = self._segments[agent_id]
        out = _spool(self._work)
        kept: dict[str, bytes] = {}
        try:
            record = restored.decode_for_pack(
                ref, self._key, stored_chunks(stored), out, agent_id, kept
            )
        except BaseException:
            out.close()
            raise
        return _Decoded(out, record, kept.get(SESSIONS))

    def take(self, agent_id: str) -> _Decoded:
        """The agent's checked segment (close it after packing)."""
        future = self._futures.pop(agent_id, None)
        self._fill()
        return future.result() if future is not None else self._decode(agent_id)

    def close(self) -> None:
        """Stop decoding; drop what was decoded and not taken."""
        for future in self._futures.values():
            future.cancel()
        self._pool.shutdown(wait=True)
        for future in self._futures.values():
            if not future.cancelled() and future.exception() is None:
                future.result().packed.close()
        self._futures.clear()


def _erased_entries(rows: Iterable[dict[str, Any]]) -> list[tuple[str, float]]:
    """The backup's erased list, each entry checked (a malformed one is dropped)."""
    out = []
    for row in rows:
        agent_id, at = row.get("agent_id"), row.get("erased_at")
        if not isinstance(agent_id, str) or not is_valid_id("agent", agent_id):
            logger.warning("backup erased list: dropping a malformed agent id")
            continue
        if not isinstance(at, int | float) or isinstance(at, bool):
            logger.warning("backup erased list: dropping %s (no time)", agent_id)
            continue
        out.append((agent_id, float(at)))
    return out
