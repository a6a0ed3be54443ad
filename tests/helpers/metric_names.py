"""Every metric name each daemon registers, as Prometheus scrapes it.

Each daemon's metric classes are built on a fresh registry from
:func:`shared.metrics.new_registry` (so the process and platform collectors
are there too, as in a running daemon); no daemon runs. A name comes out as a
query spells it: a counter as ``NAME_total`` (and ``NAME_created``), a
histogram as ``NAME_bucket``, ``NAME_sum``, ``NAME_count``.
"""

from __future__ import annotations

from typing import Any, cast

from prometheus_client import CollectorRegistry

from shared.metrics import new_registry

__all__ = ["control_registry", "exposed_names", "machine_registry"]

#: The sample names the text exposition gives a metric family of each type.
_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def exposed_names(registry: CollectorRegistry) -> set[str]:
    """The sample names ``registry`` can expose, labelled metrics with no child yet included."""
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


def machine_registry() -> CollectorRegistry:
    """A registry with every metric ``agents-machine serve`` registers (a joined machine's)."""
    from machine.backups.service import BackupMetrics
    from machine.core.search_indexer import SearchIndexer
    from machine.link.connection import _Metrics as LinkMetrics
    from machine.metrics import MachineMetrics

    registry = new_registry()
    MachineMetrics(registry)
    BackupMetrics(registry)
    LinkMetrics(registry)  # registered only once the machine has joined
    SearchIndexer(cast(Any, None), registry=registry)  # the database is not touched here
    return registry


def control_registry() -> CollectorRegistry:
    """A registry with every metric ``agents-control serve`` registers."""
    from controlplane.integrity.trusted import refused_counter
    from controlplane.metrics import ControlMetrics
    from shared.store.memory import MemoryStore
    from shared.store.wrappers import MeteredStore

    registry = new_registry()
    ControlMetrics(registry)
    refused_counter(registry)
    MeteredStore(MemoryStore(), "agents_cp", registry)  # as open_store wraps the store
    return registry
