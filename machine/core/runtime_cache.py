"""The runtimes of a machine's agents: one per agent, kept between its runs.

A runtime may hold a process (an ACP agent) that is costly to start, so it is
created for the agent's first run and kept until the agent is archived or
erased (:meth:`RuntimeCache.release`) or the daemon stops.
"""

from __future__ import annotations

import logging
from pathlib import Path

from machine.models import AgentRecord
from machine.runtimes import RuntimeRegistry
from machine.runtimes.base import Runtime

__all__ = ["RuntimeCache"]

logger = logging.getLogger(__name__)


class RuntimeCache:
    """Creates each agent's runtime from the registry once and keeps it."""

    def __init__(self, registry: RuntimeRegistry) -> None:
        self._registry = registry
        self._runtimes: dict[str, Runtime] = {}

    def available(self, kind: str) -> bool:
        """Whether runtime ``kind`` exists on this machine."""
        return kind in self._registry.kinds

    def get(self, agent: AgentRecord) -> Runtime:
        """The agent's runtime, created now if it has none yet."""
        runtime = self._runtimes.get(agent.id)
        if runtime is None:
            runtime = self._registry.create(
                agent.runtime, agent_id=agent.id, folder=Path(agent.folder), settings=agent.settings
            )
            self._runtimes[agent.id] = runtime
        return runtime

    async def release(self, agent_id: str) -> None:
        """Stop the agent's runtime (its process, if any) and forget it."""
        runtime = self._runtimes.pop(agent_id, None)
        if runtime is not None:
            await runtime.close()

    async def close(self) -> None:
        """Stop every runtime; one failing to stop does not keep the others running."""
        for runtime in self._runtimes.values():
            try:
                await runtime.close()
            except Exception:
                logger.exception("closing runtime %s failed", runtime.name)
        self._runtimes.clear()
