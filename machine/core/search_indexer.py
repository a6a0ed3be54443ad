"""The background search indexer: loads restored agents' histories, then puts
their conversations in the index.

A restore commits every agent's record at once, with its history packed
(:mod:`machine.storage.restored`), and queues each agent in the search backlog
(``machine/storage/tables/search_backlog.py``) in the same transaction; this task then
loads the histories one agent per write transaction and indexes them a few
megabytes of text per write transaction, so the restore itself is not held up
by either, and other writes are never held up for long.

Crash-safe by construction: the backlog is in the database, each batch's
search rows and backlog removals commit together, and the task drains the
backlog at start, so a daemon killed mid-way resumes where it was. Until the
backlog is empty, search answers with how many agents are still indexing.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge

from machine.storage import restored
from machine.storage.db import Database
from machine.storage.tables import restore_pending, search_backlog
from shared.errors import AgentsError
from shared.wakeups import wait_set

__all__ = ["SearchIndexer"]

logger = logging.getLogger(__name__)

#: How often an idle indexer looks at the backlog without being kicked (a
#: restore kicks it; this catches anything queued by another path).
IDLE_SECONDS: Final = 30.0
#: After a failed batch (a full disk, say), wait this long before trying again.
RETRY_SECONDS: Final = 10.0


class SearchIndexer:
    """Drains the search backlog; :meth:`run` is the daemon's background task."""

    def __init__(
        self,
        db: Database,
        *,
        registry: CollectorRegistry | None = None,
        after_load: Callable[[], None] | None = None,
    ) -> None:
        self._db = db
        self._after_load = after_load  # a test's fault point
        self._wake = asyncio.Event()
        self._backlog: Gauge | None = None
        self._indexed: Counter | None = None
        self._unloaded: Gauge | None = None
        self._failed: Gauge | None = None
        if registry is not None:
            self._unloaded = Gauge(
                "agents_machine_restore_histories_pending_agents",
                "Restored agents whose history is still packed, to be loaded into machine.db.",
                registry=registry,
            )
            self._failed = Gauge(
                "agents_machine_restore_histories_failed_agents",
                "Restored agents whose history did not load (each start tries again).",
                registry=registry,
            )
            self._backlog = Gauge(
                "agents_machine_search_backlog_agents",
                "Restored agents whose conversations are not in the search index yet.",
                registry=registry,
            )
            self._indexed = Counter(
                "agents_machine_search_backlog_indexed",
                "Restored agents the background indexer put in the search index.",
                registry=registry,
            )

    def kick(self) -> None:
        """Something was queued: index it now rather than at the next idle look."""
        self._wake.set()

    async def pending(self) -> int:
        """How many agents are still waiting to be indexed."""
        count = await self._db.read(search_backlog.backlog_count, what="search backlog")
        if self._backlog is not None:
            self._backlog.set(count)
        await self._count_unloaded()
        return count

    async def _count_unloaded(self) -> None:
        if self._unloaded is None or self._failed is None:
            return

        def counts(conn: sqlite3.Connection) -> tuple[int, int]:
            return restore_pending.loadable_count(conn), restore_pending.failed_count(conn)

        unloaded, failed = await self._db.read(counts, what="restored histories")
        self._unloaded.set(unloaded)
        self._failed.set(failed)

    async def drain(self) -> int:
        """Load every restored history still packed, then index everything queued;
        return how many agents were indexed."""
        started = time.monotonic()
        loaded = await restored.ensure_loaded(self._db, after_each=self._after_load)
        await self._count_unloaded()
        if loaded:
            logger.info(
                "restored histories: %d agents loaded in %.1f s",
                loaded,
                time.monotonic() - started,
            )
        total = 0
        started = time.monotonic()
        while True:
            done = await self._db.write(search_backlog.index_next, what="index restored agents")
            if not done:
                break
            total += len(done)
            if self._indexed is not None:
                self._indexed.inc(len(done))
            if self._backlog is not None:
                self._backlog.dec(len(done))
        if total:
            logger.info(
                "search index: %d restored agents indexed in %.1f s",
                total,
                time.monotonic() - started,
            )
        await self.pending()  # what is left: queued meanwhile (a failed history is not counted)
        return total

    async def run(self) -> None:
        """Drain the backlog now (resuming a killed daemon's), then whenever kicked."""
        while True:
            self._wake.clear()
            wait = IDLE_SECONDS
            try:
                if await self.pending():
                    await self.drain()
            except AgentsError as e:
                logger.warning("search index: indexing restored agents failed: %s", e)
                wait = RETRY_SECONDS
            except Exception:
                # Not ours to die of: log it, and try again later.
                logger.exception("search index: indexing restored agents failed")
                wait = RETRY_SECONDS
            await wait_set(self._wake, wait)
