"""Prometheus helpers shared by both daemons.

Each daemon builds its own :class:`prometheus_client.CollectorRegistry` (no
global state, so tests can run several daemons in one process) and serves it
on ``/metrics``. Metric names start with the daemon's namespace
(``agents_machine`` or ``agents_cp``); labels never carry ids.
"""

from __future__ import annotations

import logging
import platform
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from shared.version import package_version

__all__ = ["MetricsServer", "build_info", "new_registry", "start_metrics_server"]

logger = logging.getLogger(__name__)


def new_registry() -> CollectorRegistry:
    """Return a fresh registry (with process and platform collectors)."""
    from prometheus_client import PLATFORM_COLLECTOR, PROCESS_COLLECTOR

    registry = CollectorRegistry(auto_describe=True)
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR):
        try:
            registry.register(collector)
        except ValueError:  # already registered on this registry
            pass
    return registry


def build_info(registry: CollectorRegistry, namespace: str) -> Gauge:
    """Register ``<namespace>_build_info`` on ``registry``: always 1, labelled with
    the platform's ``version`` (``"unknown"`` when not installed) and the
    ``python_version`` that runs it, so a dashboard can tell which build each
    daemon runs."""
    gauge = Gauge(
        f"{namespace}_build_info",
        "Always 1; the labels say which build of the daemon runs.",
        ["version", "python_version"],
        registry=registry,
    )
    gauge.labels(version=package_version(), python_version=platform.python_version()).set(1)
    return gauge


@dataclass
class MetricsServer:
    """A running ``/metrics`` HTTP endpoint."""

    host: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    def close(self) -> None:
        """Stop serving and join the thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(
    registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0
) -> MetricsServer:
    """Serve ``registry`` on ``http://host:port/metrics`` (port 0 picks a free one)."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    actual = server.server_address[1]
    logger.info("metrics on http://%s:%d/metrics", host, actual)
    return MetricsServer(host, int(actual), server, thread)
