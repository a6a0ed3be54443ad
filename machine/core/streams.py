"""Bounds on the Prompt and Replay streams a machine serves at once.

Each open stream holds a database batch and gRPC send buffers, so their
number is capped per client and in total; beyond either cap a new stream is
refused with QuotaExceeded (RESOURCE_EXHAUSTED) instead of growing memory.
A client is the transport's peer address: every caller on the Unix socket
(one local user: the socket is 0600) is one client, each TCP connection is
another.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from machine.metrics import MachineMetrics
from shared.errors import QuotaExceeded

__all__ = ["StreamLimits"]

logger = logging.getLogger(__name__)


class StreamLimits:
    """Counts open streams per client and in total (single event loop, no locking)."""

    def __init__(
        self, *, per_client: int, total: int, metrics: MachineMetrics | None = None
    ) -> None:
        self.per_client = per_client
        self.total = total
        self._metrics = metrics
        self._open = 0
        self._by_client: dict[str, int] = {}

    @property
    def open_streams(self) -> int:
        """Streams being served now."""
        return self._open

    def _refuse(self, limit: str, what: str, count: int) -> QuotaExceeded:
        if self._metrics is not None:
            self._metrics.streams_refused.labels(limit).inc()
        logger.warning("refused a stream: %s (%d open)", what, count)
        return QuotaExceeded(what, count)

    @contextlib.contextmanager
    def opened(self, client: str) -> Iterator[None]:
        """Hold one stream slot for ``client`` while the block runs."""
        if self._open >= self.total:
            raise self._refuse("total", "open stream: streams served by this machine", self.total)
        mine = self._by_client.get(client, 0)
        if mine >= self.per_client:
            raise self._refuse("client", "open stream: streams of this client", self.per_client)
        self._open += 1
        self._by_client[client] = mine + 1
        self._gauge()
        try:
            yield
        finally:
            self._open -= 1
            left = self._by_client[client] - 1
            if left:
                self._by_client[client] = left
            else:
                del self._by_client[client]
            self._gauge()

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.streams_open.set(self._open)
