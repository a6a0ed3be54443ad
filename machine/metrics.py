"""The machine daemon's Prometheus metrics (prefix ``agents_machine_``, no ids as labels)."""

from __future__ import annotations

import logging

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.call_metrics import CallCounter
from shared.metrics import build_info

__all__ = ["MachineMetrics"]

logger = logging.getLogger(__name__)


class MachineMetrics:
    """Every metric the machine daemon exports, registered on one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.build_info = build_info(registry, "agents_machine")
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

        self.db_checks = Counter(
            "agents_machine_db_checks",
            "Integrity checks of machine.db, by kind (quick at start or just after it,"
            " full on the timer or on demand) and result (ok, damaged).",
            ["kind", "result"],
            registry=registry,
        )
        self.db_check_seconds = Histogram(
            "agents_machine_db_check_seconds",
            "Time one integrity check of machine.db took.",
            buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0),
            registry=registry,
        )
        self.db_opens = Counter(
            "agents_machine_db_opens",
            "Opens of machine.db by the check before its first write: quick (read every"
            " page), skipped (exactly as a clean stop left it), none (a new file).",
            ["start_check"],
            registry=registry,
        )
        self.start_seconds = Gauge(
            "agents_machine_start_seconds",
            "Seconds each step of the last start took, until the daemon could answer.",
            ["step"],
            registry=registry,
        )
        self.db_damaged = Gauge(
            "agents_machine_db_damaged",
            "1 once machine.db is known to be damaged (writes are refused), else 0.",
            registry=registry,
        )
        self.storage_faults = Counter(
            "agents_machine_storage_faults",
            "Storage faults met while using the data folder, by kind (disk_full, damaged).",
            ["kind"],
            registry=registry,
        )
        self.streams_open = Gauge(
            "agents_machine_streams_open",
            "Prompt and Replay streams being served.",
            registry=registry,
        )
        self.streams_refused = Counter(
            "agents_machine_streams_refused",
            "Prompt and Replay streams refused with RESOURCE_EXHAUSTED, by the limit hit"
            " (client, total).",
            ["limit"],
            registry=registry,
        )

        self.calls = Counter(
            "agents_machine_calls",
            "MachineService calls (streams included), by method and status code.",
            ["method", "code"],
            registry=registry,
        )

        self.schedule_fires = Counter(
            "agents_machine_schedule_fires",
            "Schedule fires, by result (fired, caught_up: a missed fire run once at"
            " start, refused: the agent could not run).",
            ["result"],
            registry=registry,
        )
        self.schedule_missed = Counter(
            "agents_machine_schedule_missed_fires",
            "Fire times that passed while the daemon was down or busy (one of them"
            " may be caught up, by the schedule's missed-run policy).",
            registry=registry,
        )
        self.schedule_lag = Histogram(
            "agents_machine_schedule_start_delay_seconds",
            "Time from a schedule's fire time to its run starting.",
            buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 60.0, 300.0, 3600.0),
            registry=registry,
        )
        self.schedules_enabled = Gauge(
            "agents_machine_schedules_enabled",
            "Enabled schedules of active agents.",
            registry=registry,
        )
        self.erasure_queue_length = Gauge(
            "agents_machine_erasure_queue_length",
            "Runtime erasures of deleted agents waiting (at most 1,000).",
            registry=registry,
        )
        self.erasure_queue_oldest_age = Gauge(
            "agents_machine_erasure_queue_oldest_age_seconds",
            "Age of the oldest runtime erasure still waiting; 0 when none waits.",
            registry=registry,
        )
        self.erasures = Counter(
            "agents_machine_erasures",
            "Runtime erasures that reached a result (done, unsupported, failed: given up).",
            ["result"],
            registry=registry,
        )
        self.erasure_failures = Counter(
            "agents_machine_erasure_failures",
            "Runtime erasure attempts that failed (the runtime did not start or answer).",
            registry=registry,
        )

    def observe_fault(self, kind: str) -> None:
        """Record a storage fault (called from the database's threads)."""
        self.storage_faults.labels(kind).inc()
        if kind == "damaged":
            self.db_damaged.set(1)

    def observe_check(self, kind: str, ok: bool, seconds: float) -> None:
        """Record one integrity check."""
        self.db_checks.labels(kind, "ok" if ok else "damaged").inc()
        self.db_check_seconds.observe(seconds)

    def observe_commit(self, batch: int, seconds: float) -> None:
        """Record one committed batch (called from the writer thread)."""
        self.commit_batch_size.observe(batch)
        self.commit_seconds.observe(seconds)

    def call_counters(self, service: str) -> dict[str, CallCounter]:
        """What :class:`~shared.call_metrics.CallsInterceptor` counts: every call of
        ``service`` by method and the code its caller saw."""

        def count(method: str, code: grpc.StatusCode) -> None:
            self.calls.labels(method, code.name).inc()

        return {service: count}
