"""Agents in and out of the machine: export, import, the backup source, restore.

Everything that comes in (an import archive, a fetched backup) is staged on
disk and committed in one database transaction: the commit point. An import
is checked whole before it; a restore's agent segments are authenticated as
they are loaded inside the transaction, which rolls back on the first one
refused. Attachment files are placed last in that transaction, before the
commit (content-addressed, checked against their hash, temp -> fsync ->
rename); a crash between the two leaves only files no conversation names,
which the retention sweep removes.

Agents already on the machine and agents on the erased list are skipped;
everything that comes in is archived, to read and search, never run until a
person unarchives it (and only its own machine may).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Final

from machine.backups import segment_workers
from machine.backups.engine import AgentItem, FetchedBackup, StoredSegment, stored_chunks
from machine.backups.segment_workers import SegmentWorkers, dump_agent_spooled
from machine.core.recorder import complete
from machine.formats.backup import SegmentRef
from machine.formats.export import (
    AGENT_FILES,
    OPTIONAL_AGENT_FILES,
    AgentEntry,
    ExportManifest,
    accept_path,
    agent_path,
    attachment_path,
    file_sha256,
    verify_staged,
)
from machine.formats.segment_files import open_segment
from machine.storage import restored
from machine.storage.db import Database
from machine.storage.tables import erasures as store_erasures
from machine.storage.tables import export as store_export
from machine.storage.tables import restore_pending, search_backlog
from shared.archive import ArchiveLimits, extract_staged, write_tar, write_tar_gz
from shared.atomic import ensure_private_dir, fsync_dir
from shared.errors import IntegrityError, InvalidArgument
from shared.ids import is_valid_id, validate_id

__all__ = [
    "DatabaseBackupSource",
    "InResult",
    "export_agents",
    "import_archive",
    "restore_fetched",
]

logger = logging.getLogger(__name__)

_COPY: Final = 1024 * 1024
#: A restore's agent segments decoded ahead of the one loading, and the threads doing it.
_AHEAD: Final = 3
_DECODERS: Final = 2

#: Bytes of one export file of an agent kept in memory while it is backed up.
_SPOOL: Final = 4 * 1024 * 1024


@dataclass(frozen=True)
class InResult:
    """What an import or a restore did."""

    restored: tuple[str, ...]
    skipped_existing: tuple[str, ...] = ()
    skipped_erased: tuple[str, ...] = ()
    attachments: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# -- out ---------------------------------------------------------------------


def _agent_files(folder: Path) -> list[str]:
    """The export files a dump wrote: every required one, and the optional ones present."""
    return [*AGENT_FILES, *(n for n in OPTIONAL_AGENT_FILES if (folder / n).is_file())]


async def _dump(db: Database, agent_id: str, folder: Path) -> dict[str, Any]:
    ensure_private_dir(folder)
    await restored.ensure_loaded(db, agent_id)
    return await db.read(
        lambda c: store_export.dump_agent(c, agent_id, folder), what=f"export agent {agent_id}"
    )


async def export_agents(
    db: Database,
    agent_ids: Iterable[str],
    dest: Path,
    *,
    machine_id: str,
    attachments_dir: Path,
    now: float,
) -> ExportManifest:
    """Write the agents to the ``.tar.gz`` ``dest`` (whole or absent); return its manifest."""
    ids = [validate_id("agent", a, "agent_id") for a in agent_ids]
    if not ids:
        raise InvalidArgument("agents", "name at least one agent to export")
    ensure_private_dir(dest.parent)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".export-") as tmp:
        work = Path(tmp)
        entries: list[tuple[str, bytes | Path]] = []
        agents: list[AgentEntry] = []
        shas: set[str] = set()
        for agent_id in ids:
            folder = work / agent_id
            record = await _dump(db, agent_id, folder)
            names = _agent_files(folder)
            files = {name: file_sha256(folder / name) for name in names}
            mine = sorted({a["sha256"] for a in record["attachments"]})
            agents.append(AgentEntry(agent_id, record["name"], files, tuple(mine)))
            entries += [(agent_path(agent_id, n), folder / n) for n in names]
            shas |= set(mine)
        for sha in sorted(shas):
            path = attachments_dir / sha
            if not path.is_file():
                raise IntegrityError(f"export attachment {sha[:16]}", "its file is missing")
            entries.append((attachment_path(sha), path))
        manifest = ExportManifest(machine_id, now, tuple(agents))
        entries.append(("manifest.json", manifest.to_json()))
        write_tar_gz(dest, entries)
    return manifest


_Spool = tempfile.SpooledTemporaryFile[bytes]


def _spool(folder: Path) -> _Spool:
    return tempfile.SpooledTemporaryFile(max_size=_SPOOL, mode="w+b", dir=str(folder))


class DatabaseBackupSource:
    """The machine's data as a :class:`~machine.backups.engine.BackupSource`."""

    def __init__(self, db: Database, attachments_dir: Path, work_dir: Path) -> None:
        self._db = db
        self._attachments = attachments_dir
        self._work = work_dir

    async def agents(self) -> list[AgentItem]:
        # A backup holds whole agents: restored histories still packed load first
        # (again, should a restore commit more between the load and the listing).
        while True:
            await restored.ensure_loaded(self._db)
            rows, unloaded = await self._db.read(_markers, what="backup list agents")
            if not unloaded:
                return [AgentItem(a, m) for a, m in rows]

    async def write_agent(self, agent_id: str, out: BinaryIO) -> None:
        failed = await self._db.read(
            lambda c: restore_pending.failed_history(c, agent_id), what=f"back up {agent_id}"
        )
        if failed is not None:  # kept as it came: the history that did not load
            folder = restored.pack_dir(self._db)
            await asyncio.to_thread(restored.write_failed, folder, failed, out)
            return
        ensure_private_dir(self._work)
        with contextlib.ExitStack() as stack:
            entries = await self._db.read(
                lambda c: dump_agent_spooled(c, agent_id, stack, self._work),
                what=f"back up agent {agent_id}",
            )
            # The tar goes to ``out`` in a worker thread: a backup's ``out``
            # hashes and compresses what it is given (machine.backups.writer).
            await asyncio.to_thread(write_tar, out, entries)

    def segment_maker(
        self, *, naming_key: bytes, work_dir: Path, agents: int, pack_folder: Path | None = None
    ) -> contextlib.AbstractAsyncContextManager[SegmentWorkers | None]:
        if agents < segment_workers.MIN_AGENTS:
            return contextlib.nullcontext(None)
        return SegmentWorkers(
            self._db.path,
            naming_key=naming_key,
            work_dir=work_dir,
            count=segment_workers.processes(),
            pack_folder=pack_folder,
        )

    async def attachments(self) -> list[tuple[str, Path]]:
        shas = await self._db.read(store_export.attachments_named, what="backup attachments")
        return [(s, self._attachments / s) for s in shas if (self._attachments / s).is_file()]

    async def usage(self) -> list[dict[str, Any]]:
        return await self._db.read(store_export.usage_rows, what="backup usage")

    async def erased(self) -> list[dict[str, Any]]:
        return await self._db.read(store_erasures.erased_rows, what="backup erased list")

    async def settings(self) -> dict[str, str]:
        return {}


# -- in ----------------------------------------------------------------------


def _markers(conn: Any) -> tuple[list[tuple[str, str]], int]:
    """Every agent's change marker, and how many restored histories are still to
    load (not counting those that did not load), from one snapshot."""
    rows = store_export.agent_markers(conn)
    return rows, restore_pending.loadable_count(conn)


def _place_attachment(src: Path, sha: str, attachments_dir: Path) -> int:
    """Copy an attachment into place after checking its hash; return its size."""
    final = attachments_dir / sha
    if final.is_file():
        return final.stat().st_size
    h = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=attachments_dir, prefix=".restore-", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
            while chunk := f.read(_COPY):
                h.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if h.hexdigest() != sha:
            raise IntegrityError(f"attachment {sha[:16]}", "content does not match its name")
        os.chmod(tmp, 0o600)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(attachments_dir)
    return final.stat().st_size


async def _commit(
    db: Database,
    folders: dict[str, Path],
    attachment_files: dict[str, Path],
    attachments_dir: Path,
    *,
    usage: list[dict[str, Any]],
    erased: set[str],
    what: str,
    erased_entries: list[tuple[str, float]] | None = None,
    load: Callable[[Any, str], str] | None = None,
    start: Callable[[list[str]], None] | None = None,
    whole: bool = True,
    not_from: frozenset[str] = frozenset(),
    after_load: Callable[[], None] | None = None,
    before_commit: Callable[[], None] | None = None,
) -> InResult:
    """Skip existing and erased agents, then load the rest and place attachments in
    one transaction; ``load(conn, agent_id)`` loads one (default: from its folder),
    ``start`` is told which agents will be loaded, in order, before the first;
    ``before_commit`` runs last inside the transaction (a restore's pack fsync);
    ``whole`` refuses an attachment a conversation names and the archive lacks
    (an export always holds them; a backup of a machine that lost one does not)."""

    def known(conn: Any) -> tuple[set[str], set[str]]:
        return (
            store_export.existing_agents(conn, folders),
            store_erasures.erased_among(conn, folders),
        )

    existing, erased_here = await db.read(known, what=f"{what}: existing agents")
    # The machine's own erased list, the caller's and the backup's: all are skipped.
    erased = erased | erased_here | {a for a, _ in erased_entries or ()}
    todo = [a for a in folders if a not in existing and a not in erased]
    if start is not None:
        start(todo)
    ensure_private_dir(attachments_dir)
    sizes: dict[str, int] = {}
    loaded_ids: list[str] = []

    runs = store_export.usage_by_run(usage)

    def load_folder(conn: Any, agent_id: str) -> str:
        return store_export.load_agent(conn, folders[agent_id], runs=runs, not_from=not_from)

    def commit(conn: Any) -> None:
        # Looked at again inside the transaction: an import or an erasure that
        # committed since the look above must not be overwritten or brought back.
        existing.update(store_export.existing_agents(conn, todo))
        erased.update(store_erasures.erased_among(conn, todo))
        for agent_id in todo:
            if agent_id in existing or agent_id in erased:
                continue
            try:
                loaded = (load or load_folder)(conn, agent_id)
            except sqlite3.IntegrityError as e:
                # A run or tool call id another agent here has (the loader checks the
                # rest): refused whole, as any other malformed input.
                raise InvalidArgument(
                    "archive", f"agent {agent_id}: an id it holds is already on this machine ({e})"
                ) from None
            if loaded != agent_id:
                raise InvalidArgument("archive", f"agent {agent_id}: its record names {loaded}")
            loaded_ids.append(agent_id)
            if after_load is not None:
                after_load()  # a test's fault point: inside the transaction
        # Placed once every agent loaded (a restore authenticates each segment as it
        # loads it): a refused one leaves no file behind. Before the commit point, as
        # a conversation must never name a file that is not there. Only the files the
        # loaded agents name: a skipped (erased) agent's files stay out.
        for sha in sorted(store_export.attachments_of(conn, loaded_ids)):
            path = attachment_files.get(sha)
            if path is None:
                if (attachments_dir / sha).is_file():
                    continue  # already here (another agent's)
                if not whole:
                    # The machine backed up had lost the file: everything else of
                    # a lost machine still comes back.
                    logger.warning("%s: attachment %s is not in the backup", what, sha[:16])
                    continue
                raise InvalidArgument(
                    "archive", f"attachment {sha[:16]}: named by a conversation, not in the archive"
                )
            sizes[sha] = _place_attachment(path, sha, attachments_dir)
            store_export.set_attachment_size(conn, sha, sizes[sha])
        # A restore brings the erased list back (a new machine must skip them too).
        entries = erased_entries or []
        here = store_export.existing_agents(conn, [a for a, _ in entries])
        for agent_id, erased_at in entries:
            if agent_id not in here:
                store_erasures.add_erased(conn, agent_id, erased_at)
        if before_commit is not None:
            before_commit()

    if todo or erased_entries:
        # The commit point: every agent or none.
        await db.write(commit, what=what, bulk=True)
    skipped_existing = tuple(sorted(a for a in folders if a in existing))
    skipped_erased = tuple(sorted(a for a in folders if a in erased and a not in existing))
    logger.info(
        "%s: %d agents in, %d skipped", what, len(loaded_ids), len(folders) - len(loaded_ids)
    )
    return InResult(tuple(loaded_ids), skipped_existing, skipped_erased, len(sizes))


async def import_archive(
    db: Database,
    archive: Path,
    *,
    staging_dir: Path,
    attachments_dir: Path,
    erased: set[str],
    limits: ArchiveLimits | None = None,
    own_ids: frozenset[str] = frozenset(),
    after_load: Callable[[], None] | None = None,
) -> InResult:
    """Import an export ``.tar.gz``: checked whole, then committed whole or not at all.

    An agent whose origin is one of ``own_ids`` (this machine's) is refused: an
    import never brings an agent that could run here.
    """
    ensure_private_dir(staging_dir)
    stage = Path(tempfile.mkdtemp(dir=staging_dir, prefix=".import-"))
    os.rmdir(stage)  # extract_staged makes it, and removes it on refusal
    try:
        paths = extract_staged(archive, stage, accept=accept_path, limits=limits)
        manifest = verify_staged(stage, paths)
        folders = {a.agent_id: stage / "agents" / a.agent_id for a in manifest.agents}
        files = {
            sha: stage / attachment_path(sha) for a in manifest.agents for sha in a.attachments
        }
        return await _commit(
            db,
            folders,
            files,
            attachments_dir,
            usage=[],
            erased=erased,
            what=f"import {archive.name}",
            not_from=own_ids,
            after_load=after_load,
        )
    finally:
        shutil.rmtree(stage, ignore_errors=True)


async def restore_fetched(
    db: Database,
    fetched: FetchedBackup,
    *,
    attachments_dir: Path,
    erased: set[str],
    now: float | None = None,
    after_load: Callable[[], None] | None = None,
) -> InResult:
    """Restore a fetched backup's agents (archived), skipping existing and erased ones.

    Each stored agent segment is authenticated, checked and packed
    (:mod:`machine.storage.restored`), and its record committed in the one transaction
    with where its history lies; histories are loaded into machine.db after the
    commit (then indexed for search), or at once for an agent someone reads.
    Segments fetched decoded (``fetch(decode_agents=True)``) are loaded whole.
    """
    queued_at = time.time() if now is None else now
    usage = fetched.manifest.usage
    runs = store_export.usage_by_run(usage)
    usage_of: dict[str, list[dict[str, Any]]] = {}
    for row in usage:
        usage_of.setdefault(str(row.get("agent_id")), []).append(row)
    pack = restored.PackWriter(restored.pack_dir(db), fetched.manifest.backup_id)
    ahead = _DecodeAhead(fetched.stored_agents, fetched.manifest.naming_key, fetched.folder)

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
            )

    def load(conn: Any, agent_id: str) -> str:
        if agent_id not in fetched.stored_agents:
            return load_whole(conn, agent_id, fetched.agent_files[agent_id])
        with ahead.take(agent_id) as decoded:
            record = store_export.parse_record(decoded.record, agent_id)
            if record["agent_id"] != agent_id:
                return str(record["agent_id"])  # refused by the caller
            store_export.insert_record(conn, record, agent_id)
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
        _commit(
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
        try:
            record = restored.decode_for_pack(ref, self._key, stored_chunks(stored), out, agent_id)
        except BaseException:
            out.close()
            raise
        return _Decoded(out, record)

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
