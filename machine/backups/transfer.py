"""Agents in and out of the machine: export, import, and the one commit every
arrival goes through (a restore's too, :mod:`machine.backups.restore`).

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
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from machine.core.agents import (
    ArrivingSettings,
    SessionHomes,
    SettingsNote,
    capture_session_files,
    portable_settings,
    restore_session_tar,
)
from machine.formats.export import (
    AGENT_FILES,
    OPTIONAL_AGENT_FILES,
    SESSIONS,
    AgentEntry,
    ExportManifest,
    accept_path,
    agent_path,
    attachment_path,
    file_sha256,
    verify_staged,
)
from machine.storage import restored
from machine.storage.db import Database
from machine.storage.tables import erasures as store_erasures
from machine.storage.tables import export as store_export
from shared.archive import ArchiveLimits, extract_staged, write_tar_gz
from shared.atomic import ensure_private_dir, fsync_dir
from shared.errors import IntegrityError, InvalidArgument
from shared.ids import validate_id

__all__ = [
    "ArrivingSessions",
    "InResult",
    "SettingDiff",
    "SettingsNote",
    "settings_differ",
    "commit_staged",
    "export_agents",
    "import_archive",
]

logger = logging.getLogger(__name__)

_COPY: Final = 1024 * 1024


@dataclass(frozen=True)
class SettingDiff:
    """A setting the restored backup's machine had with another value than this one."""

    name: str
    in_backup: str
    here: str


def settings_differ(
    in_backup: Mapping[str, str], here: Mapping[str, str]
) -> tuple[SettingDiff, ...]:
    """The settings a backup carries with another value than ``here``, by name
    (only the names this machine carries too: a newer machine's others mean
    nothing here)."""
    return tuple(
        SettingDiff(name, in_backup[name], here[name])
        for name in sorted(in_backup)
        if name in here and in_backup[name] != here[name]
    )


@dataclass(frozen=True)
class InResult:
    """What an import or a restore did."""

    restored: tuple[str, ...]
    skipped_existing: tuple[str, ...] = ()
    skipped_erased: tuple[str, ...] = ()
    attachments: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    settings: tuple[SettingDiff, ...] = ()
    """A restore's: the backed-up machine's settings that differ from this one's
    (nothing puts them back: machine.toml is the operator's)."""
    agent_settings: tuple[SettingsNote, ...] = ()
    """The agents that came in without all of their runtime settings: values a
    runtime withheld (secrets), or settings it refused. ``agent configure`` sets them."""
    sessions: tuple[str, ...] = ()
    """What putting the agents' CLI session files back said: a file kept here
    because it changed after the copy that came in, one line each."""


class ArrivingSessions:
    """Puts the CLI session files of the agents that come in back under the CLIs'
    homes (``machine.runtimes.session_files``), inside the commit's transaction
    like the attachments: a crash before the commit leaves only files no agent
    here names. Without ``homes`` they are dropped."""

    def __init__(self, homes: SessionHomes | None, settings: ArrivingSettings) -> None:
        self._homes = homes
        # The session id each agent loaded with: only that session's files come back.
        self._settings = settings
        self._notes: dict[str, tuple[str, ...]] = {}

    def __call__(self, agent_id: str, data: bytes) -> None:
        if self._homes is None:
            return
        done = restore_session_tar(
            self._homes,
            data,
            self._settings.session_id(agent_id),
            f"agent {agent_id}/{SESSIONS}",
        )
        self._notes[agent_id] = tuple(
            f"{agent_id}: session file {name} changed here since the copy was made: kept"
            for name in done.kept_newer
        )

    def notes(self, agent_ids: Iterable[str]) -> tuple[str, ...]:
        """What came back for ``agent_ids`` that a person should know, one line each."""
        return tuple(line for a in agent_ids for line in self._notes.get(a, ()))


# -- out ---------------------------------------------------------------------


def _agent_files(folder: Path) -> list[str]:
    """The export files a dump wrote: every required one, and the optional ones present."""
    return [*AGENT_FILES, *(n for n in OPTIONAL_AGENT_FILES if (folder / n).is_file())]


async def _dump(
    db: Database, agent_id: str, folder: Path, homes: SessionHomes | None
) -> dict[str, Any]:
    ensure_private_dir(folder)
    await restored.ensure_loaded(db, agent_id)
    record = await db.read(
        lambda c: store_export.dump_agent(c, agent_id, folder, portable=portable_settings),
        what=f"export agent {agent_id}",
    )
    if homes is not None:
        await asyncio.to_thread(_dump_sessions, homes, record, folder / SESSIONS)
    return record


def _dump_sessions(homes: SessionHomes, record: dict[str, Any], path: Path) -> None:
    """The agent's CLI session files as ``sessions.tar`` (none: no file)."""
    with open(path, "wb") as f:
        capture_session_files(
            homes,
            record["runtime_settings"],
            record["session_id"],
            f,
            label=str(record["agent_id"]),
        )
        empty = f.tell() == 0
    if empty:
        path.unlink()


async def export_agents(
    db: Database,
    agent_ids: Iterable[str],
    dest: Path,
    *,
    machine_id: str,
    attachments_dir: Path,
    now: float,
    homes: SessionHomes | None = None,
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
            record = await _dump(db, agent_id, folder, homes)
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


# -- in ----------------------------------------------------------------------


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


async def commit_staged(
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
    in_commit: Callable[[Any], None] | None = None,
    arriving: ArrivingSettings | None = None,
    sessions: ArrivingSessions | None = None,
) -> InResult:
    """Skip existing and erased agents, then load the rest and place attachments in
    one transaction; ``load(conn, agent_id)`` loads one (default: from its folder,
    its settings through ``arriving`` and its session files through ``sessions``,
    whose notes the result carries),
    ``start`` is told which agents will be loaded, in order, before the first;
    ``in_commit(conn)`` runs first inside the transaction, its writes committed
    with the agents (a take-over's adopted machine id) and its refusal rolling
    everything back; ``before_commit`` runs last inside it (a restore's pack fsync);
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
    arriving = arriving or ArrivingSettings()
    sessions = sessions or ArrivingSessions(None, arriving)

    def load_folder(conn: Any, agent_id: str) -> str:
        return store_export.load_agent(
            conn,
            folders[agent_id],
            runs=runs,
            not_from=not_from,
            settings_of=arriving,
            sessions=sessions,
        )

    def commit(conn: Any) -> None:
        if in_commit is not None:
            in_commit(conn)
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

    if todo or erased_entries or in_commit is not None:
        # The commit point: every agent or none.
        await db.write(commit, what=what, bulk=True)
    skipped_existing = tuple(sorted(a for a in folders if a in existing))
    skipped_erased = tuple(sorted(a for a in folders if a in erased and a not in existing))
    logger.info(
        "%s: %d agents in, %d skipped", what, len(loaded_ids), len(folders) - len(loaded_ids)
    )
    return InResult(
        tuple(loaded_ids),
        skipped_existing,
        skipped_erased,
        len(sizes),
        agent_settings=arriving.notes(loaded_ids),
        sessions=sessions.notes(loaded_ids),
    )


async def _extract_in_thread(archive: Path, stage: Path, limits: ArchiveLimits | None) -> list[str]:
    """:func:`extract_staged` in a worker thread: checking an archive takes seconds
    (100,000 entries) to minutes (8 GiB), and the daemon answers meanwhile.

    Cancelled, it stops the thread and waits for it: the thread removes what it
    wrote, and nothing it writes lands after the caller removed ``stage``.
    """
    stop = threading.Event()
    work = asyncio.ensure_future(
        asyncio.to_thread(
            extract_staged, archive, stage, accept=accept_path, limits=limits, stop=stop
        )
    )
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        stop.set()  # seen at its next entry or 1 MiB piece
        with contextlib.suppress(BaseException):  # its refusal; or a second cancel
            await work
        raise


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
    homes: SessionHomes | None = None,
) -> InResult:
    """Import an export ``.tar.gz``: checked whole, then committed whole or not at all.
    The agents' CLI session files go back under ``homes`` (none: dropped).

    An agent whose origin is one of ``own_ids`` (this machine's) is refused: an
    import never brings an agent that could run here.
    """
    ensure_private_dir(staging_dir)
    arriving = ArrivingSettings()
    stage = Path(tempfile.mkdtemp(dir=staging_dir, prefix=".import-"))
    os.rmdir(stage)  # extract_staged makes it, and removes it on refusal
    try:
        paths = await _extract_in_thread(archive, stage, limits)
        # Hashes every file (up to 8 GiB): off the event loop too.
        manifest = await asyncio.to_thread(verify_staged, stage, paths)
        folders = {a.agent_id: stage / "agents" / a.agent_id for a in manifest.agents}
        files = {
            sha: stage / attachment_path(sha) for a in manifest.agents for sha in a.attachments
        }
        return await commit_staged(
            db,
            folders,
            files,
            attachments_dir,
            usage=[],
            erased=erased,
            what=f"import {archive.name}",
            not_from=own_ids,
            after_load=after_load,
            arriving=arriving,
            sessions=ArrivingSessions(homes, arriving),
        )
    finally:
        shutil.rmtree(stage, ignore_errors=True)
