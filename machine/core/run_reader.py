"""Reading runs and their events: a replay from the database, then live ones.

Events are read back in seq order, from the in-memory
:class:`~machine.core.feed.FeedHub` ring when it still holds them and from the
database otherwise, so a follower never misses one and never sees one twice.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

from machine.core.feed import FeedHub
from machine.models import MachineIds, RunRecord, StoredEvent
from machine.storage import restored, tables
from machine.storage.db import Database
from shared.errors import InvalidArgument, NotFound
from shared.ids import validate_id

__all__ = ["RunReader"]

_READ_BATCH = 500
# A follower holds at most one batch: bounded by bytes too, so large events
# (a long prompt, a big tool output) do not make a batch hundreds of MiB.
_READ_BYTES = 256 * 1024


class RunReader:
    """Runs and their event streams, validated, for the engine and its servicer."""

    def __init__(self, db: Database, feeds: FeedHub, *, ids: MachineIds) -> None:
        self._db = db
        self._feeds = feeds
        self._ids = ids

    async def follow_run(
        self, agent_id: str, run_id: str, after: int
    ) -> AsyncIterator[StoredEvent]:
        """The events of one run after seq ``after``, until its last one."""
        async for ev in self.follow(agent_id, after, follow=True, run_id=run_id):
            if ev.run_id != run_id:
                continue
            yield ev
            if ev.terminal:
                return

    async def follow(
        self, agent_id: str, after_seq: int, *, follow: bool, run_id: str | None = None
    ) -> AsyncIterator[StoredEvent]:
        """Stored events with seq > after_seq; with ``follow``, then every new one.

        With ``run_id``, once every stored event has been yielded, raise the
        StoreError recorded for that run if its final event could not be stored.
        """
        feed = self._feeds.feed(agent_id)
        last = after_seq
        while True:
            ring = feed.since(last)
            if ring is not None:
                batch = ring
            else:
                batch = await self._db.read(
                    functools.partial(
                        tables.read_events,
                        agent_id=agent_id,
                        after_seq=last,
                        limit=_READ_BATCH,
                        max_bytes=_READ_BYTES,
                    ),
                    what=f"replay agent {agent_id}",
                )
            for ev in batch:
                if ev.seq <= last:
                    continue
                yield ev
                last = ev.seq
            if batch:
                continue
            if not follow:
                return
            await feed.wait_after(last, run_id)

    async def replay(
        self, agent_id: str, after_seq: int = 0, *, follow: bool = False
    ) -> AsyncIterator[StoredEvent]:
        """Validate, then stream the agent's events (see :meth:`follow`)."""
        validate_id("agent", agent_id, "agent_id")
        if after_seq < 0:
            raise InvalidArgument("after_seq", "must not be negative")
        await self._db.read(
            lambda c: tables.get_agent(c, agent_id, self._ids.own), what=f"replay agent {agent_id}"
        )
        await restored.ensure_loaded(self._db, agent_id)
        return self.follow(agent_id, after_seq, follow=follow)

    async def get_run(self, run_id: str) -> RunRecord:
        """One run."""
        validate_id("run", run_id, "run_id")
        what = f"get run {run_id}"
        try:
            return await self._db.read(lambda c: tables.get_run(c, run_id), what=what)
        except NotFound:
            # A restored agent's run, maybe, its history not loaded yet (a run of
            # this machine's own is found at once: a cancel never waits for this).
            await restored.ensure_loaded(self._db)
        return await self._db.read(lambda c: tables.get_run(c, run_id), what=what)

    async def list_runs(self, agent_id: str, limit: int = 100) -> list[RunRecord]:
        """An agent's runs, newest first."""
        validate_id("agent", agent_id, "agent_id")
        if not 0 <= limit <= 1000:
            raise InvalidArgument("limit", "must be 0 to 1000")
        what = f"list runs of agent {agent_id}"
        await self._db.read(lambda c: tables.get_agent(c, agent_id, self._ids.own), what=what)
        await restored.ensure_loaded(self._db, agent_id)
        return await self._db.read(lambda c: tables.list_runs(c, agent_id, limit or 100), what=what)
