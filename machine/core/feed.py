"""Live conversation feeds: readers wait here for events as they are stored.

The run engine publishes each event after its transaction commits. A feed
keeps a short ring of recent events so followers usually need no database
read; a follower that falls behind the ring reads from the database instead
(everything is stored there first), so a slow reader never blocks a run and
never loses an event.

When a run's final event cannot be stored, :meth:`FeedHub.fail` records it:
that run's followers then raise the storage error (StoreError, DiskFull...)
instead of waiting for ever.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable

from machine.models import StoredEvent
from shared.errors import AgentsError

__all__ = ["ConversationFeed", "FeedHub"]

logger = logging.getLogger(__name__)

_RING = 1024
# The ring is also bounded by (roughly) the bytes of its events: with large
# events it keeps fewer, and followers read the rest from the database.
_RING_BYTES = 4 * 1024 * 1024


def _size(ev: StoredEvent) -> int:
    """A cheap estimate of an event's payload size (its top-level values as text)."""
    return 64 + sum(len(v) if isinstance(v, str) else len(str(v)) for v in ev.payload.values())


def _fresh(error: AgentsError) -> AgentsError:
    """A new exception of the same class, message and attributes, with no traceback."""
    cls = type(error)
    copy = cls.__new__(cls)
    AgentsError.__init__(copy, error.message)
    copy.__dict__.update({k: v for k, v in error.__dict__.items() if k != "message"})
    return copy


class ConversationFeed:
    """One agent's recent events and a wake-up for readers."""

    def __init__(self) -> None:
        self._ring: deque[tuple[StoredEvent, int]] = deque()
        self._ring_bytes = 0
        self._last_seq = -1
        self._changed = asyncio.Event()
        self._failed: dict[str, AgentsError] = {}

    @property
    def last_seq(self) -> int:
        """Highest seq published since start (-1: none yet)."""
        return self._last_seq

    def publish(self, events: Iterable[StoredEvent]) -> None:
        """Add committed events (in seq order) and wake every reader."""
        added = False
        for ev in events:
            if ev.seq <= self._last_seq:
                continue
            size = _size(ev)
            self._ring.append((ev, size))
            self._ring_bytes += size
            while len(self._ring) > _RING or self._ring_bytes > _RING_BYTES:
                self._ring_bytes -= self._ring.popleft()[1]
            self._last_seq = ev.seq
            added = True
        if added:
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def fail(self, run_id: str, error: AgentsError) -> None:
        """Record that ``run_id`` will get no final event; wake its followers."""
        self._failed[run_id] = error
        self._wake()

    def clear_failure(self, run_id: str) -> None:
        """Forget a failure recorded for ``run_id`` (its run has now ended)."""
        self._failed.pop(run_id, None)

    def since(self, after_seq: int) -> list[StoredEvent] | None:
        """Events with seq > after_seq from the ring, or None when the ring cannot
        prove it holds all of them (the reader must use the database)."""
        if self._last_seq < 0:
            return None
        if after_seq >= self._last_seq:
            return []
        out = [ev for ev, _ in self._ring if ev.seq > after_seq]
        if not out or out[0].seq != after_seq + 1:
            return None
        for a, b in zip(out, out[1:], strict=False):
            if b.seq != a.seq + 1:
                return None
        return out

    async def wait_after(self, seq: int, run_id: str | None = None) -> None:
        """Return once an event with seq > ``seq`` has been published.

        With ``run_id``: raise the error that run was failed with (see :meth:`fail`).
        """
        while self._last_seq <= seq:
            failure = self._failed.get(run_id) if run_id is not None else None
            if failure is not None:
                # A fresh exception per follower: one shared instance would pile
                # up every follower's traceback.
                raise _fresh(failure)
            await self._changed.wait()


class FeedHub:
    """Feeds by agent id."""

    def __init__(self) -> None:
        self._feeds: dict[str, ConversationFeed] = {}

    def feed(self, agent_id: str) -> ConversationFeed:
        """The agent's feed (created on first use)."""
        feed = self._feeds.get(agent_id)
        if feed is None:
            feed = self._feeds[agent_id] = ConversationFeed()
        return feed

    def fail(self, agent_id: str, run_id: str, error: AgentsError) -> None:
        """Make the followers of ``run_id`` raise ``error`` (see ConversationFeed.fail)."""
        self.feed(agent_id).fail(run_id, error)

    def clear_failure(self, agent_id: str, run_id: str) -> None:
        """Forget the failure recorded for ``run_id``."""
        self.feed(agent_id).clear_failure(run_id)

    def publish(self, events: Iterable[StoredEvent]) -> None:
        """Route events to their agents' feeds."""
        by_agent: dict[str, list[StoredEvent]] = {}
        for ev in events:
            by_agent.setdefault(ev.agent_id, []).append(ev)
        for agent_id, evs in by_agent.items():
            self.feed(agent_id).publish(sorted(evs, key=lambda e: e.seq))
