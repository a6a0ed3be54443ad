"""The control plane's Prometheus metrics (prefix ``agents_cp_``; no ids as labels)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from shared.call_metrics import CallCounter
from shared.metrics import build_info
from shared.store.causes import OTHER

__all__ = ["STORE_CAUSES", "ControlMetrics"]

logger = logging.getLogger(__name__)

#: The causes ``agents_cp_store_requests_total`` counts store requests under
#: (shared.store.causes; docs/metrics.md says what each covers). Every entry
#: point names one; a request made outside all of them counts as ``other``.
STORE_CAUSES: Final = frozenset(
    {
        "admin",  # Admin RPCs but those below
        "backups",  # the MachineLink backup RPCs
        "clock",  # the clock check against the store's Date
        "deletion",  # account deletions (the RPC and its background run)
        "heartbeat",  # a heartbeat's own handling (none while nothing changed)
        "intents",  # finishing abandoned multi-object changes (self-check tick, start)
        "join",  # the Join RPC
        "link",  # a Connect stream's opening: authorisation, a join's confirmation
        "offline",  # the machines-offline gauge (its fleet listing)
        "presence",  # last-seen writes, an offline machine's stored presence
        "provider",  # asking a machine's provider to start it
        "queue",  # prompts: send, list, deliver, acknowledge, expire
        "retention",  # the audit records' retention sweep
        "renewal",  # certificate renewals
        "roster",  # agent rosters machines report
        "rotation",  # key rotations
        "self_check",  # the per-tick deployment marker and epoch check
        "startup",  # serve's start: epoch, key bundle, recovery
        "wake",  # the schedule waker (its fleet listing, offline presence)
        OTHER,
    }
)

# The MachineLink backup RPCs, counted in agents_cp_backup_calls (docs/metrics.md).
BACKUP_METHODS = (
    "HaveSegments",
    "PutSegment",
    "PutManifest",
    "ListBackups",
    "GetManifest",
    "GetSegment",
    "Prune",
)


class ControlMetrics:
    """Every metric the daemon exports besides the store's own."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.build_info = build_info(registry, "agents_cp")
        self.machines_online = Gauge(
            "agents_cp_machines_online", "Machines with a live Connect stream.", registry=registry
        )
        self.connects = Counter(
            "agents_cp_connects",
            "Connect streams opened, by outcome (ok, refused, bad_hello).",
            ["outcome"],
            registry=registry,
        )
        self.disconnects = Counter(
            "agents_cp_disconnects",
            "Connect streams ended, by reason (closed, timeout, replaced, shutdown, broken, "
            "revoked, account_deleted).",
            ["reason"],
            registry=registry,
        )
        self.replays = Counter(
            "agents_cp_store_replays_refused",
            "Records found older than the create-only marker that outlives them (an older "
            "genuine copy put back in the bucket), by record (account, machine, token).",
            ["record"],
            registry=registry,
        )
        for record in ("account", "machine", "token"):  # controlplane.integrity.replays
            self.replays.labels(record)
        self.joins = Counter(
            "agents_cp_joins",
            "Join attempts, by outcome (ok, or the lower-case gRPC status of the refusal).",
            ["outcome"],
            registry=registry,
        )
        self.renewals = Counter(
            "agents_cp_cert_renewals",
            "Certificate renewals, by outcome (ok, or the lower-case gRPC status).",
            ["outcome"],
            registry=registry,
        )
        self.key_rotations = Counter(
            "agents_cp_key_rotations",
            "Key rotations, by kind (server, ca_rollover, ca_retire) and result "
            "(ok, refused, error).",
            ["kind", "result"],
            registry=registry,
        )
        self.admin_calls = Counter(
            "agents_cp_admin_calls",
            "Admin RPCs, by method and status code.",
            ["method", "code"],
            registry=registry,
        )
        self.account_deletions = Counter(
            "agents_cp_account_deletions",
            "Account deletion runs, by result (ok; failed: interrupted, resumed later).",
            ["result"],
            registry=registry,
        )
        self.account_deletion_objects = Counter(
            "agents_cp_account_deletion_objects",
            "Objects deleted from the store by account deletions.",
            registry=registry,
        )
        self.audit_records_removed = Counter(
            "agents_cp_audit_records_removed",
            "Audit records removed by the retention sweep (audit_retention_days).",
            registry=registry,
        )
        self.backup_calls = Counter(
            "agents_cp_backup_calls",
            "MachineLink backup RPCs, by method and status code.",
            ["method", "code"],
            registry=registry,
        )
        self.backup_stored_bytes = Counter(
            "agents_cp_backup_stored_bytes",
            "Sealed backup bytes machines stored (segments and manifests), by kind.",
            ["kind"],
            registry=registry,
        )
        self.backup_stored_objects = Counter(
            "agents_cp_backup_stored_objects",
            "Sealed backup objects machines stored (segment, manifest), by kind.",
            ["kind"],
            registry=registry,
        )
        self.backup_served_bytes = Counter(
            "agents_cp_backup_served_bytes",
            "Sealed backup bytes sent back to machines (restores, verifies).",
            registry=registry,
        )
        self.machines_offline = Gauge(
            "agents_cp_machines_offline",
            "Paired, unrevoked machines without a live link (none is stopped on purpose "
            "by a provider); refreshed every minute.",
            registry=registry,
        )
        self.queue_depth = Gauge(
            "agents_cp_prompt_queue_depth",
            "Prompts waiting in the store for their machines (all machines).",
            registry=registry,
        )
        self.queue_oldest_age = Gauge(
            "agents_cp_prompt_queue_oldest_age_seconds",
            "Seconds the oldest queued prompt has waited (0 with none).",
            registry=registry,
        )
        self.provider_starts = Counter(
            "agents_cp_provider_starts",
            "Start requests to machine providers, by result (ok, error).",
            ["result"],
            registry=registry,
        )
        self.schedule_wakes = Counter(
            "agents_cp_schedule_wakes",
            "Offline machines whose provider was asked to start them for a schedule due.",
            registry=registry,
        )
        self.prompts = Counter(
            "agents_cp_prompts",
            "Prompts by outcome (queued, replayed, refused, acknowledged, refused_by_machine, "
            "expired).",
            ["outcome"],
            registry=registry,
        )
        self.clock_skew = Gauge(
            "agents_cp_clock_skew_seconds",
            "Seconds this control plane's clock is ahead of the store's (its Date "
            "header; negative: behind) at the last check. Expiries wait while it is "
            "beyond clock_skew_bound_seconds.",
            registry=registry,
        )
        self.epoch = Gauge(
            "agents_cp_epoch",
            "The fencing epoch this process holds in cp/epoch.json (0: none yet).",
            registry=registry,
        )
        self.key_bundle_sealed = Gauge(
            "agents_cp_key_bundle_sealed",
            "1 when cp/keys.sealed held this home's keys at the last reseal, else 0 "
            "(the deployment cannot be restored from its store).",
            registry=registry,
        )

        # Replicas (serve --cluster, controlplane.cluster); never set by a lone process.
        self.cluster_routed = Counter(
            "agents_cp_cluster_routed",
            "Notices for a machine linked to another replica, sent over NATS, by outcome "
            "(delivered, not_linked, unavailable).",
            ["outcome"],
            registry=registry,
        )
        self.lease_held = Gauge(
            "agents_cp_lease_held",
            "1 while this replica holds the periodic jobs' lease (0 otherwise).",
            registry=registry,
        )
        self.singleton_runs = Counter(
            "agents_cp_singleton_runs",
            "Periodic jobs run by this replica under the lease, by job (wake, audit_retention).",
            ["job"],
            registry=registry,
        )

    def watch_queue(self, depth: Callable[[], float], oldest_age: Callable[[], float]) -> None:
        """Read the prompt queue's gauges from it at each scrape."""
        self.queue_depth.set_function(depth)
        self.queue_oldest_age.set_function(oldest_age)

    def prompt_outcome(self, outcome: str) -> None:
        """Count one prompt outcome (queued, replayed, refused, acknowledged, ...)."""
        self.prompts.labels(outcome).inc()

    def provider_start(self, result: str) -> None:
        """Count one provider start request by result."""
        self.provider_starts.labels(result).inc()

    def call_counters(self, admin_service: str, link_service: str) -> dict[str, CallCounter]:
        """What :class:`~shared.call_metrics.CallsInterceptor` counts: every Admin call
        by method and code, joins and renewals by outcome (ok, or the lower-case code),
        the backup calls (streams included) by method and code."""

        def admin(method: str, code: grpc.StatusCode) -> None:
            self.admin_calls.labels(method, code.name).inc()

        def outcome(counter: Counter) -> CallCounter:
            def count(method: str, code: grpc.StatusCode) -> None:
                counter.labels("ok" if code is grpc.StatusCode.OK else code.name.lower()).inc()

            return count

        def backup(method: str, code: grpc.StatusCode) -> None:
            self.backup_calls.labels(method, code.name).inc()

        return {
            admin_service: admin,
            f"{link_service}/Join": outcome(self.joins),
            f"{link_service}/RenewCertificate": outcome(self.renewals),
            **{f"{link_service}/{method}": backup for method in BACKUP_METHODS},
        }
