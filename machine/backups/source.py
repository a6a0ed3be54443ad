"""What a backup reads from the machine: the :class:`BackupSource` contract and
:class:`DatabaseBackupSource`, the machine's database as one.

The engine (:mod:`machine.backups.engine`) reads only through this contract:
it knows nothing of SQL. A backup holds whole agents, so the database source
first loads the histories a restore left packed (:mod:`machine.storage.restored`)
and lists the agents from the same snapshot that says none is left to load; an
agent whose restored history did not load is backed up as it came. A backup of
many agents makes their segments in worker processes
(:mod:`machine.backups.workers.segment_workers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from machine.backups.workers import segment_workers
from machine.backups.workers.segment_workers import SegmentWorkers, dump_agent_spooled
from machine.backups.writer import SegmentMaker
from machine.core.agents import SessionHomes
from machine.storage import restored
from machine.storage.db import Database
from machine.storage.tables import erasures as store_erasures
from machine.storage.tables import export as store_export
from machine.storage.tables import restore_pending
from shared.archive import write_tar
from shared.atomic import ensure_private_dir

__all__ = ["AgentItem", "BackupSource", "DatabaseBackupSource"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentItem:
    """One agent to back up, and a marker that changes whenever its history does."""

    agent_id: str
    marker: str
    last_seq: int = 0
    """The agent's last event's seq when listed (a delta continues from it)."""


class BackupSource(Protocol):
    """What a backup reads from the machine (:class:`DatabaseBackupSource` reads machine.db)."""

    async def agents(self) -> list[AgentItem]:
        """Every agent to back up."""
        ...

    async def write_agent(self, agent_id: str, out: BinaryIO) -> None:
        """Write the agent's plaintext segment (export-format tar) to ``out``."""
        ...

    async def write_delta(
        self, agent_id: str, since_seq: int, out: BinaryIO, known: Mapping[str, str]
    ) -> dict[str, str]:
        """Write the agent's delta segment after event ``since_seq`` (an increment's:
        :mod:`machine.formats.backup_delta`) to ``out``; NotFound when it is gone.
        Its CLI session files go in only where their SHA-256 differs from ``known``
        (the chain's, by path); returns the hashes of all of them now."""
        ...

    async def usage_since(self, bases: dict[str, int]) -> list[dict[str, Any]]:
        """The usage rows of the runs of each agent's events after its seq in ``bases``."""
        ...

    def segment_maker(
        self, *, naming_key: bytes, work_dir: Path, agents: int, pack_folder: Path | None = None
    ) -> contextlib.AbstractAsyncContextManager[SegmentMaker | None]:
        """Makers of whole segments for a backup that reads ``agents`` agents
        (worker processes), or None: :meth:`write_agent` in this process. With
        ``pack_folder`` they may append segments to packs there (a
        :class:`~shared.backup_target.PackTarget`'s)."""
        ...

    async def attachments(self) -> list[tuple[str, Path]]:
        """(sha256, file) of every attachment some agent names."""
        ...

    async def usage(self) -> list[dict[str, Any]]:
        """The usage and time history, one row per run."""
        ...

    async def erased(self) -> list[dict[str, Any]]:
        """The erased list."""
        ...

    async def settings(self) -> dict[str, str]:
        """Settings that are not secrets."""
        ...


class DatabaseBackupSource:
    """The machine's data as a :class:`BackupSource`."""

    def __init__(
        self,
        db: Database,
        attachments_dir: Path,
        work_dir: Path,
        settings: Mapping[str, str] | None = None,
        homes: SessionHomes | None = None,
    ) -> None:
        self._db = db
        self._attachments = attachments_dir
        self._work = work_dir
        # The CLIs' homes, whose session files of each agent a backup carries.
        self._homes = homes
        # The machine's non-secret settings (MachineConfig.backup_settings).
        self._settings = dict(settings or {})

    async def agents(self) -> list[AgentItem]:
        # A backup holds whole agents: restored histories still packed load first
        # (again, should a restore commit more between the load and the listing).
        while True:
            await restored.ensure_loaded(self._db)
            rows, unloaded = await self._db.read(_markers, what="backup list agents")
            if not unloaded:
                return [AgentItem(a, m, store_export.marker_seq(m)) for a, m in rows]

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
            entries, _ = await self._db.read(
                lambda c: dump_agent_spooled(c, agent_id, stack, self._work, homes=self._homes),
                what=f"back up agent {agent_id}",
            )
            # The tar goes to ``out`` in a worker thread: a backup's ``out``
            # hashes and compresses what it is given (machine.backups.writer).
            await asyncio.to_thread(write_tar, out, entries)

    async def write_delta(
        self, agent_id: str, since_seq: int, out: BinaryIO, known: Mapping[str, str]
    ) -> dict[str, str]:
        # An agent is listed after its restored history loaded (agents()); the
        # delta is from machine.db, as a whole segment is.
        ensure_private_dir(self._work)
        with contextlib.ExitStack() as stack:
            entries, captured = await self._db.read(
                lambda c: dump_agent_spooled(
                    c,
                    agent_id,
                    stack,
                    self._work,
                    since_seq=since_seq,
                    homes=self._homes,
                    known=known,
                ),
                what=f"back up the changes of agent {agent_id}",
            )
            await asyncio.to_thread(write_tar, out, entries)
        return captured.hashes

    async def usage_since(self, bases: dict[str, int]) -> list[dict[str, Any]]:
        def rows(conn: Any) -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            for agent_id, since in bases.items():
                out += store_export.usage_rows_since(conn, agent_id, since)
            return out

        return await self._db.read(rows, what="backup usage of the changes")

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
            homes=self._homes,
        )

    async def attachments(self) -> list[tuple[str, Path]]:
        shas = await self._db.read(store_export.attachments_named, what="backup attachments")
        return [(s, self._attachments / s) for s in shas if (self._attachments / s).is_file()]

    async def usage(self) -> list[dict[str, Any]]:
        return await self._db.read(store_export.usage_rows, what="backup usage")

    async def erased(self) -> list[dict[str, Any]]:
        return await self._db.read(store_erasures.erased_rows, what="backup erased list")

    async def settings(self) -> dict[str, str]:
        return dict(self._settings)


def _markers(conn: Any) -> tuple[list[tuple[str, str]], int]:
    """Every agent's change marker, and how many restored histories are still to
    load (not counting those that did not load), from one snapshot."""
    rows = store_export.agent_markers(conn)
    return rows, restore_pending.loadable_count(conn)
