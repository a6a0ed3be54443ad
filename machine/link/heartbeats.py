"""What the machine reports about itself on the Connect stream.

``hello`` and every heartbeat carry the number of agents and the soonest
schedule fire (so the control plane can wake a stopped machine for it). The
roster (the agents' ids and active/archived, never names) goes once the
stream is up, then with any heartbeat that finds it changed, and once more
before a clean goodbye: the control plane refuses prompts for unknown or
archived agents while the machine is offline. A failing count or roster
query never ends the stream: the last count is sent again, the roster is
skipped until the next heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

from prometheus_client import Counter

from machine.link.client import AgentRoster, ControlStream

__all__ = ["Heartbeats"]

logger = logging.getLogger(__name__)

_UINT32_MAX: Final = 2**32 - 1


class Heartbeats:
    """Sends hello, the heartbeats and the roster on each stream (see the module docstring).

    ``heartbeats`` counts the heartbeats sent; ``roster`` None sends none.
    """

    def __init__(
        self,
        *,
        agent_count: Callable[[], Awaitable[int]],
        next_fire: Callable[[], float | None],
        roster: Callable[[], Awaitable[AgentRoster]] | None,
        heartbeats: Counter,
    ) -> None:
        self._agent_count = agent_count
        self._next_fire = next_fire
        self._roster = roster
        self._heartbeats = heartbeats
        self._sent_roster: AgentRoster | None = None
        self._last_agent_count = 0
        # Held across each write: a stopping link takes it before cancelling the
        # beat, because a task cancelled inside a write may cancel the whole call
        # (and with it the last roster and the goodbye).
        self.writing = asyncio.Lock()

    async def hello(self, stream: ControlStream, version: str) -> None:
        """Open ``stream`` with hello."""
        await stream.hello(version, await self._count_agents(), self._next_fire())

    async def welcomed(self, stream: ControlStream) -> None:
        """The stream is up: send the whole roster."""
        self._sent_roster = None  # each stream starts with the whole roster
        await self.send_roster(stream)

    async def run(self, stream: ControlStream, interval: float) -> None:
        """Send a heartbeat every ``interval`` seconds until cancelled."""
        # Ticks are scheduled on a fixed grid so a slow send does not drift the beat.
        next_at = time.monotonic() + interval
        while True:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at = max(next_at + interval, time.monotonic())
            count = await self._count_agents()
            async with self.writing:
                await stream.heartbeat(count, self._next_fire())
                self._heartbeats.inc()
                await self.send_roster(stream)

    async def send_roster(self, stream: ControlStream) -> None:
        """Send the agent roster when it changed since the last one sent on ``stream``
        (the caller holds :attr:`writing` when another task may write meanwhile)."""
        if self._roster is None:
            return
        try:
            roster = await self._roster()
        except Exception:  # the link must not die with the roster query
            logger.exception("agent roster failed; not sent")
            return
        if roster != self._sent_roster:
            await stream.roster(roster)
            self._sent_roster = roster

    async def _count_agents(self) -> int:
        try:
            count = int(await self._agent_count())
        except Exception:  # a heartbeat must not die with the counter
            logger.exception("agent count failed; sending the last known value")
            return self._last_agent_count
        self._last_agent_count = max(0, min(count, _UINT32_MAX))
        return self._last_agent_count
