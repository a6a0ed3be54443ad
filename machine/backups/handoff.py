"""Exports and imports on disk: ``Outgoing/`` and ``Incoming/`` in the data folder.

An export is written whole into ``Outgoing/`` and streamed to the person; an
import is received into ``Incoming/`` and then imported. Each file goes as
soon as it was read or imported, or after an hour untouched (a daemon killed
mid-stream leaves one): :meth:`Handoff.sweep` runs at start and on the prune
timer, with an injectable clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Final

from machine.backups.transfer import InResult, export_agents, import_archive
from machine.core.agents import SessionHomes
from machine.formats.export import ExportManifest
from machine.storage.db import Database
from machine.storage.faults import disk_full_named
from machine.storage.tables import export as store_export
from shared.archive import ArchiveLimits
from shared.atomic import ensure_private_dir
from shared.errors import InvalidArgument

__all__ = ["MAX_AGE_SECONDS", "MAX_IMPORT_BYTES", "Handoff", "read_chunks"]

logger = logging.getLogger(__name__)

#: A file in Outgoing/ or Incoming/ untouched this long is removed.
MAX_AGE_SECONDS: Final = 3600.0
#: The largest import archive received (compressed bytes).
MAX_IMPORT_BYTES: Final = ArchiveLimits().max_total_bytes


async def read_chunks(path: Path, size: int = 1024 * 1024) -> AsyncIterator[bytes]:
    """The bytes of ``path`` in pieces, read off the event loop."""
    with open(path, "rb") as f:
        while chunk := await asyncio.to_thread(f.read, size):
            yield chunk


class Handoff:
    """Makes exports in ``outgoing``, imports from ``incoming``, and sweeps both."""

    def __init__(
        self,
        db: Database,
        *,
        machine_id: str,
        attachments_dir: Path,
        outgoing: Path,
        incoming: Path,
        erased: Callable[[], set[str]] = set,
        clock: Callable[[], float] = time.time,
        own_ids: frozenset[str] = frozenset(),
        after_load: Callable[[], None] | None = None,
        homes: SessionHomes | None = None,
    ) -> None:
        self._db = db
        # The CLIs' homes: an export carries its agents' session files, an import
        # puts them back.
        self._homes = homes
        self._after_load = after_load  # a test's fault point (machine.backups.transfer)
        self._machine_id = machine_id
        # Every id this machine has had: an import of an agent from one is refused.
        self._own = own_ids | {machine_id}
        self._attachments = attachments_dir
        self.outgoing = outgoing
        self.incoming = incoming
        self._erased = erased
        self._clock = clock

    async def export(self, agent_ids: list[str], folder: str = "") -> tuple[Path, ExportManifest]:
        """Write an export of the agents (or every agent of ``folder``) into Outgoing/.

        The caller streams the file and then calls :meth:`done` with it.
        """
        ids = list(agent_ids)
        if folder:
            where = os.path.normpath(folder)  # as agents are stored (machine.core.agents)
            ids += await self._db.read(
                lambda c: store_export.agents_in_folder(c, where), what="export folder"
            )
            if not ids:
                raise InvalidArgument("folder", f"no agent works in {folder[:200]!r}")
        ids = list(dict.fromkeys(ids))
        now = self._clock()
        dest = self.outgoing / f"export-{int(now)}-{secrets.token_hex(8)}.tar.gz"
        manifest = await export_agents(
            self._db,
            ids,
            dest,
            machine_id=self._machine_id,
            attachments_dir=self._attachments,
            now=now,
            homes=self._homes,
        )
        return dest, manifest

    def incoming_file(self) -> Path:
        """A fresh path in Incoming/ to receive an import into."""
        path = self.incoming / f"import-{int(self._clock())}-{secrets.token_hex(8)}.tar.gz"
        with self._full_disk(path):
            ensure_private_dir(self.incoming)
        return path

    def _full_disk(self, path: Path) -> contextlib.AbstractContextManager[None]:
        # Incoming/ is in the data folder; the commit's DiskFull (machine.db's
        # writer) names the same folder and the same operation.
        return disk_full_named(f"import {path.name}", self.incoming.parent)

    async def import_file(self, path: Path) -> InResult:
        """Import the archive at ``path`` (in Incoming/), then remove it, whatever happened.

        A full disk met while it is unpacked raises DiskFull naming the data folder.
        """
        try:
            with self._full_disk(path):
                return await import_archive(
                    self._db,
                    path,
                    staging_dir=self.incoming,
                    attachments_dir=self._attachments,
                    erased=self._erased(),
                    own_ids=self._own,
                    after_load=self._after_load,
                    homes=self._homes,
                )
        finally:
            self.done(path)

    async def receive(self, chunks: AsyncIterator[bytes]) -> InResult:
        """Receive an archive into Incoming/ (bounded), import it, remove it.

        A full disk met while it is received raises DiskFull naming the data folder.
        """
        path = self.incoming_file()
        received = 0
        try:
            with self._full_disk(path), open(path, "xb") as out:
                os.chmod(path, 0o600)
                async for chunk in chunks:
                    received += len(chunk)
                    if received > MAX_IMPORT_BYTES:
                        raise InvalidArgument(
                            "archive", f"larger than {MAX_IMPORT_BYTES // 1024**3} GiB"
                        )
                    await asyncio.to_thread(out.write, chunk)
        except BaseException:
            self.done(path)
            raise
        if not received:
            self.done(path)
            raise InvalidArgument("archive", "empty: send the .tar.gz's bytes")
        return await self.import_file(path)

    def done(self, path: Path) -> None:
        """The file was read or imported: it goes."""
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def _sweep(self) -> int:
        cutoff = self._clock() - MAX_AGE_SECONDS
        removed = 0
        for folder in (self.outgoing, self.incoming):
            if not folder.is_dir():
                continue
            for entry in folder.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    if entry.lstat().st_mtime >= cutoff:
                        continue
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        os.unlink(entry)
                    removed += 1
        if removed:
            logger.info("removed %d export/import file(s) untouched for an hour", removed)
        return removed

    async def sweep(self) -> int:
        """Remove files in Outgoing/ and Incoming/ untouched for an hour; return how many."""
        return await asyncio.to_thread(self._sweep)
