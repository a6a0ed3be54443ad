"""The machine daemon's Prometheus metrics (prefix ``agents_machine_``, no ids as labels)."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["MachineMetrics"]

logger = logging.getLogger(__name__)


class MachineMetrics:
    """Every metric the machine daemon exports, registered on one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.runs_started = Counter(
            "agents_machine_runs_started", "Runs that started.", registry=registry
        )
        self.runs_finished = Counter(
            "agents_machine_runs_finished",
            "Runs that ended, by outcome (finished, failed, interrupted, cancelled).",
            ["outcome"],
            registry=registry,
        )
        self.events_appended = Counter(
            "agents_machine_events_appended",
            "Conversation events stored durably.",
            ["kind"],
            registry=registry,
        )
        self.commit_seconds = Histogram(
            "agents_machine_db_commit_seconds",
            "Time to run and commit (fsync) one batch of database writes.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=registry,
        )
        self.append_seconds = Histogram(
            "agents_machine_event_append_seconds",
            "Time from asking to store an event to it being durable.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=registry,
        )
        self.commit_batch_size = Histogram(
            "agents_machine_db_commit_batch_size",
            "Writes committed together in one transaction (group commit).",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=registry,
        )
        self.prompts_queued = Gauge(
            "agents_machine_prompts_queued",
            "Prompts waiting for an earlier run of the same agent.",
            registry=registry,
        )
        self.runs_open = Gauge(
            "agents_machine_runs_open",
            "Runs queued, running or waiting for a person.",
            registry=registry,
        )

    def observe_commit(self, batch: int, seconds: float) -> None:
        """Record one committed batch (called from the writer thread)."""
        self.commit_batch_size.observe(batch)
        self.commit_seconds.observe(seconds)
