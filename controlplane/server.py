"""The daemon: wires store, keys and domain services into one gRPC server.

Two TLS listeners serve the same services (gRPC's TLS server cannot make a
client certificate optional): the public one without client certificates
(Join, Admin, health) and the link one that requires a certificate from our CA
(every other MachineLink RPC; the servicer refuses them without one).

Under systemd (``Type=notify``, shared.sd_notify), :func:`run_daemon` sends
``READY=1`` once both listeners serve and the store was verified as this
deployment's (and our epoch taken), ``WATCHDOG=1`` from the event loop while it
serves, and ``STOPPING=1`` when the drain begins; :class:`ControlPlane` sends a
``STATUS=`` line at each step of its start.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Final, Self

import grpc
import grpc.aio
from grpc_health.v1._async import HealthServicer

from controlplane.access.accounts import AccountService
from controlplane.api.admin import AdminServicer
from controlplane.api.causes import CauseInterceptor, rpc_causes
from controlplane.api.link import LinkServicer
from controlplane.config import ControlConfig, cluster_servers, parse_hostport
from controlplane.deletion.service import AccountDeletion, DeletionHooks
from controlplane.integrity.audit import AUDIT_SWEEP_INTERVAL, AuditRetention
from controlplane.integrity.clock import ClockCheck
from controlplane.integrity.intents import Intents
from controlplane.integrity.keys import KeyRing, load_home_keys
from controlplane.integrity.records import Machine
from controlplane.integrity.trusted import DeploymentGuard, TrustedStore, open_trusted_store
from controlplane.machines.alive import AliveStamps
from controlplane.machines.backups import MachineBackups
from controlplane.machines.fleet import FleetView
from controlplane.machines.presence import (
    PresenceRegistry,
    RenewNowNotice,
    ReplicasChangedNotice,
)
from controlplane.machines.registry import MachineRegistry
from controlplane.machines.rosters import AgentRosters
from controlplane.metrics import ControlMetrics
from controlplane.queue.delivery import PromptDelivery
from controlplane.queue.prompts import PromptQueue, QueueLimits
from controlplane.queue.starter import MachineStarter
from controlplane.queue.wake import ScheduleWaker
from controlplane.recovery.fencing import Fence, lock_home, take_epoch
from controlplane.recovery.keybundle import reseal_key_bundle
from controlplane.recovery.rotation import KeyRotation
from controlplane.services import Services
from shared.atomic import write_atomic
from shared.call_metrics import CallsInterceptor
from shared.errors import (
    AgentsError,
    IntegrityError,
    InvalidState,
    StoreFenced,
)
from shared.limits import LINK_MAX_MESSAGE
from shared.metrics import MetricsServer, new_registry, start_metrics_server
from shared.outage import OutageLog
from shared.pb.control.v1 import admin_pb2, admin_pb2_grpc, link_pb2, link_pb2_grpc
from shared.rpc import (
    NO_REUSEPORT,
    ErrorInterceptor,
    check_can_listen,
    serve_health_and_reflection,
)
from shared.sd_notify import Notifier
from shared.store.causes import OTHER, set_cause, store_cause

if TYPE_CHECKING:
    from controlplane.cluster.lease import JobLease
    from controlplane.cluster.replica import Replica

__all__ = ["ControlPlane", "run_daemon"]

logger = logging.getLogger(__name__)

#: Seconds between two counts of offline machines.
OFFLINE_COUNT_INTERVAL = 60.0
#: Most link addresses handed to a machine: the most its link.json keeps
#: (machine.link.identity.MAX_CONTROL_ADDRESSES).
MAX_CONTROL_ADDRESSES: Final = 16
#: Largest gRPC message accepted (prompts and segments are chunked below this).
MAX_MESSAGE_BYTES = LINK_MAX_MESSAGE
#: The gRPC server's options (bench/bare_link.py serves its floor with the same).
SERVER_OPTIONS: Final = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Machines ping every 30 s to notice a vanished control plane
    # (machine/link/connection.py); the default floor would GOAWAY them.
    ("grpc.http2.min_ping_interval_without_data_ms", 20_000),
    # TLS records of at most 4 KiB (16 KiB by default): each connection keeps a
    # buffer of that size for as long as it lives, and a link's messages are
    # small. Measured: 5 KiB less per link; a backup's 1 MiB chunk goes as 256
    # records instead of 64.
    ("grpc.tsi.max_frame_size", 4096),
    # No BDP probing: it answers data with a PING (the probe), and with a link's
    # sparse heartbeats that is most heartbeats: a PING out and its ACK in, one
    # more write and read each. Measured (python -m bench.bare_link, 500 links,
    # a heartbeat a second): 128-145 us of CPU per heartbeat with it, 93-102 without.
    ("grpc.http2.bdp_probe", 0),
    # What the probe would grow the receive window to (gRPC's cap on it, 4 MiB),
    # fixed instead: a backup's uploads over a slow, distant link keep their
    # pace. A window is a permit, not a buffer: it costs nothing until used.
    ("grpc.http2.lookahead_bytes", 4 * 1024 * 1024),
    NO_REUSEPORT,
)
LINK_SERVICE = link_pb2.DESCRIPTOR.services_by_name["MachineLink"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


class ControlPlane:
    """A running control plane: ``async with ControlPlane(cfg) as cp: await cp.wait()``."""

    def __init__(self, cfg: ControlConfig) -> None:
        self.cfg = cfg
        self.registry = new_registry()
        self.metrics = ControlMetrics(self.registry)
        self.notifier = Notifier(cfg.notify)
        """systemd's notify socket (nothing is sent when ``cfg.notify`` is off)."""
        self._store: TrustedStore | None = None
        self._checker: asyncio.Task[None] | None = None
        self._waker: asyncio.Task[None] | None = None
        self._clocks: asyncio.Task[None] | None = None
        self._audit_sweep: asyncio.Task[None] | None = None
        self._clock_check: ClockCheck | None = None
        self._offline: asyncio.Task[None] | None = None
        self._stamps: asyncio.Task[None] | None = None
        self._health: HealthServicer | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics_server: MetricsServer | None = None
        self._presence: PresenceRegistry | None = None
        self._deletion: AccountDeletion | None = None
        self._prompts: PromptDelivery | None = None
        self._starter: MachineStarter | None = None
        self._replica: Replica | None = None
        self._cluster_tasks: list[asyncio.Task[None]] = []
        self._route_here: Callable[[str, str, dict[str, str]], Awaitable[bool]] | None = None
        self._lease: JobLease | None = None
        self.public_port = 0
        self.link_port = 0
        self._serve_info: dict[str, object] = {}
        self._keyring: KeyRing | None = None
        self._stopped = asyncio.Event()
        self._home_lock: int | None = None
        self._wrote_serve_info = False
        self.fence: Fence | None = None
        self.fenced: StoreFenced | None = None
        """Set when a newer control plane took the store over: the daemon stops."""

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.stop(0)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop(5)

    async def start(self) -> None:
        """Bind both listeners and /metrics, then open the store and take the epoch,
        then serve and write serve.json.

        Bind first, fence second: a start that cannot bind (ports in use, e.g. a
        copied home started by mistake beside the live one) fails before it has
        touched the store, so the live control plane keeps its epoch. Taking the
        epoch is the last step that can refuse the start for the store's sake.
        """
        with store_cause("startup"):
            await self._start()

    async def _start(self) -> None:
        cfg = self.cfg
        status = self.notifier.status
        # A second serve of this very home folder stops here, before anything else.
        self._home_lock = lock_home(cfg.home, "serve")
        keys = load_home_keys(cfg.home)
        keyring = KeyRing(keys)
        status("starting: binding the listeners")
        server = self._bind(keyring)
        if cfg.metrics_listen:
            mhost, mport = parse_hostport(cfg.metrics_listen, "metrics_listen")
            self._metrics_server = start_metrics_server(self.registry, mhost, mport)
        status("starting: opening and verifying the store")
        self._store = trusted = await open_trusted_store(cfg, keys, self.registry)
        # Refuse a store that is not this deployment's before anything is served.
        await trusted.guard.verify()
        trusted.guard.check()
        # The epoch before any write: a superseded home stops here having written
        # nothing, and from now on every write first checks that we still own it.
        status("starting: taking the deployment epoch")
        # Replicas of one home join its epoch rather than fence each other.
        self.fence = await take_epoch(
            cfg.home,
            trusted.authenticated,
            trusted.where,
            self._fenced,
            replica=bool(cfg.cluster_url),
        )
        trusted.set_fence(self.fence)
        self.metrics.epoch.set(self.fence.epoch)
        self.metrics.key_bundle_sealed.set(1 if await _reseal(cfg, trusted) else 0)
        # Our clock against the store's before anything expires (integrity.clock).
        self._clock_check = clock_check = ClockCheck(
            trusted.store, bound=cfg.clock_skew_bound_seconds, on_skew=self.metrics.clock_skew.set
        )
        await clock_check.check()
        services = Services(
            cfg,
            trusted.store,
            keys,
            trusted.backups,
            keyring=keyring,
            on_replay=lambda record: self.metrics.replays.labels(record).inc(),
            clock_check=clock_check,
        )
        # The earlier processes' alive stamps before this one's first (machines.alive).
        alive = AliveStamps(trusted.store, self.fence.epoch)
        await alive.load()
        await alive.stamp()
        presence = PresenceRegistry(
            trusted.store,
            write_interval=cfg.presence_write_interval,
            on_change=self.metrics.machines_online.set,
            epoch=self.fence.epoch,
            alive=alive,
        )
        # One listing of the fleet for the periodic checks (machines.fleet).
        fleet = FleetView(services.machines)

        def deleted(result: str) -> None:
            self.metrics.account_deletions.labels(result).inc()
            fleet.changed()  # its machines are gone from the store

        # Before recovery: it resumes tombstoned deletions, in the background.
        self._deletion = services.deletion
        services.deletion.run_in_background(
            DeletionHooks(
                close_links=presence.close_account,
                finished=deleted,
                objects=self.metrics.account_deletion_objects.inc,
            )
        )
        rosters = AgentRosters(trusted.store)
        if cfg.cluster_url:
            # Before recovery: a live replica's unfinished changes are its own.
            status("starting: joining the other replicas over NATS")
            self._replica = await _join_replicas(
                cfg, self.fence.home_id, services.intents, self, self._link_address()
            )
            presence.set_peers(self._replica)

            def changed_elsewhere(machine_id: str) -> None:
                # Another replica rewrote its presence record (and maybe roster); it
                # may have joined, revoked or deleted it too: the fleet is listed again.
                presence.forget_stored(machine_id)
                rosters.forget(machine_id)
                fleet.changed()

            self._replica.board.on_machine_changed = changed_elsewhere
        status("starting: finishing changes a previous run left unfinished")
        recovered = await services.intents.recover()
        if recovered:
            logger.warning("rolled back %d change(s) a previous run left unfinished", recovered)
        services.machines.on_revoke(presence.kick)
        self._presence = presence
        prompt_queue = PromptQueue(
            trusted.store,
            services.machines,
            services.auditor,
            limits=QueueLimits(
                max_depth=cfg.prompt_queue_depth,
                max_prompt_bytes=cfg.prompt_max_bytes,
                ttl=dt.timedelta(seconds=cfg.prompt_ttl_seconds),
            ),
            on_outcome=self.metrics.prompt_outcome,
            rosters=rosters,
            may_expire=clock_check.may_expire,
        )
        self.metrics.watch_queue(prompt_queue.depth, prompt_queue.oldest_age)

        async def prompts_wait(machine: Machine) -> bool:
            # Offline, with a prompt in its queue (as this process knows it).
            return not presence.online(machine.machine_id) and await prompt_queue.waiting(machine)

        self._starter = starter = MachineStarter(
            trusted.store,
            services.machines,
            services.auditor,
            keys.secrets_key,
            log_dir=cfg.home / "providers",
            on_result=self.metrics.provider_start,
            waiting=prompts_wait,
        )
        waker = ScheduleWaker(
            fleet,
            presence,
            starter,
            lead=cfg.wake_lead_seconds,
            interval=cfg.wake_check_seconds,
            on_wake=self.metrics.schedule_wakes.inc,
        )
        self._prompts = prompts = PromptDelivery(
            prompt_queue, presence, on_queued=starter.request, on_connected=starter.connected
        )

        host, _ = parse_hostport(cfg.listen, "listen")
        lhost, _ = parse_hostport(cfg.link_listen, "link_listen")
        advertise = cfg.advertise_host or host
        if advertise in ("0.0.0.0", "::"):
            logger.warning("listening on all interfaces; set advertise_host for join commands")
        link = LinkServicer(
            pairing=services.pairing,
            machines=services.machines,
            presence=presence,
            metrics=self.metrics,
            heartbeat_interval=cfg.heartbeat_interval,
            renew_threshold=cfg.renew_threshold,
            link_port=self.link_port,
            link_host=cfg.advertise_host,
            backups=_machine_backups(trusted, services.machines, services.accounts),
            deliveries=prompts,
            rosters=rosters,
            control_addresses=self._control_addresses,
        )
        rotation = KeyRotation(
            home=cfg.home,
            server_names=cfg.server_names,
            keyring=services.keyring,
            machines=services.machines,
            presence=presence,
            auditor=services.auditor,
            marker_store=trusted.authenticated,
            bundle_store=trusted.store,
            on_result=self._rotated,
            on_resealed=lambda sealed: self.metrics.key_bundle_sealed.set(1 if sealed else 0),
        )
        admin = AdminServicer(
            accounts=services.accounts,
            credentials=services.credentials,
            tokens=services.tokens,
            machines=services.machines,
            presence=presence,
            deletion=services.deletion,
            ca_hash=keys.ca_hash,
            join_address=f"{_bracket(advertise)}:{self.public_port}",
            prompts=prompts,
            starter=starter,
            waker=waker,
            rotation=rotation,
            # Each replica's keys are its home's: a rotation would reach only one.
            rotation_refused=(
                "key rotation is refused while serving as one of several replicas: it "
                "would change this replica's home only; stop the replicas, rotate with one "
                "plain serve, copy its home to the others (docs/controlplane.md, Replicas)"
                if cfg.cluster_url
                else ""
            ),
        )
        link_pb2_grpc.add_MachineLinkServicer_to_server(link, server)
        admin_pb2_grpc.add_AdminServicer_to_server(admin, server)
        status("starting: starting the listeners")
        self._health = await serve_health_and_reflection(server, [LINK_SERVICE, ADMIN_SERVICE])
        # Each call runs in a task that copies this context: none starts as "startup"
        # (api.causes names each call's cause), and so do the loops below.
        with store_cause(OTHER):
            await server.start()
        self._offline = asyncio.create_task(
            _count_offline(presence, fleet, self.metrics), name="machines-offline"
        )
        self._clocks = asyncio.create_task(
            clock_check.run(cfg.clock_check_seconds), name="clock-check"
        )
        retention = AuditRetention(
            trusted.store,
            dt.timedelta(days=cfg.audit_retention_days),
            on_removed=self.metrics.audit_records_removed.inc,
            may_expire=clock_check.may_expire,
        )
        if self._replica is None:
            self._waker = asyncio.create_task(waker.run(), name="schedule-waker")
            self._audit_sweep = asyncio.create_task(retention.run(), name="audit-retention")
            self._stamps = asyncio.create_task(
                alive.keep(cfg.presence_write_interval), name="alive-stamps"
            )
        else:
            # One replica at a time runs the jobs on shared state, once per due time
            # (cluster.lease). The self-check's marker and epoch reads and the clock
            # check stay on every replica: each is this process's own stop condition
            # or clock; the offline count is a gauge each replica exports.
            await self._start_singletons(
                self._replica,
                services.intents,
                [
                    _Job("wake", cfg.wake_check_seconds, "wake", waker.check),
                    _Job("audit_retention", AUDIT_SWEEP_INTERVAL, "retention", retention.sweep),
                    # Replicas share the epoch: one stamp per interval says it is alive.
                    _Job("alive_stamps", cfg.presence_write_interval, "presence", alive.stamp),
                ],
            )

            async def routed(machine_id: str, kind: str, fields: dict[str, str]) -> bool:
                if presence.session(machine_id) is None:
                    return False
                if kind == "revoked":
                    await presence.kick("", machine_id, fields.get("reason", "revoked"))
                    return True
                if kind == "renew_now":
                    return presence.notify(machine_id, RenewNowNotice(fields.get("reason", "")))
                if kind == "drain":
                    return prompts.drain_now(machine_id)
                return False

            self._route_here = routed
        self._checker = asyncio.create_task(
            _self_check(trusted.guard, services.intents, cfg.heartbeat_interval, self.fence),
            name="store-self-check",
        )
        metrics_addr = ""
        if self._metrics_server is not None:
            metrics = self._metrics_server
            metrics_addr = f"{_bracket(metrics.host)}:{metrics.port}"
        info = {
            "pid": os.getpid(),
            "public": f"{_bracket(host)}:{self.public_port}",
            "link": f"{_bracket(lhost)}:{self.link_port}",
            "join_address": f"{_bracket(advertise)}:{self.public_port}",
            "metrics": metrics_addr,
            "ca_hash": keys.ca_hash,
        }
        self._serve_info = info
        self._keyring = services.keyring
        self._write_serve_info()
        logger.info(
            "serving: public %s, link %s, metrics %s", info["public"], info["link"], metrics_addr
        )

    def _link_address(self) -> str:
        """The address machines dial this process's link listener at: the advertised
        host (else the listener's) and the link port; "" when the listener is on
        every interface and no host is advertised (the machine then uses the
        host it joined through, as the join reply's empty link_host says)."""
        lhost, _ = parse_hostport(self.cfg.link_listen, "link_listen")
        host = self.cfg.advertise_host or lhost
        if host in ("", "0.0.0.0", "::"):
            return ""
        return f"{_bracket(host)}:{self.link_port}"

    def _control_addresses(self) -> tuple[str, ...]:
        """The link addresses a machine is given at join and each welcome: every
        live replica's, this one's first (a lone process: its own only)."""
        if self._replica is not None:
            return self._replica.link_addresses(MAX_CONTROL_ADDRESSES)
        own = self._link_address()
        return (own,) if own else ()

    def holds_lease(self) -> bool:
        """Whether this replica runs the periodic jobs now (False for a lone process:
        it runs them without a lease)."""
        return self._lease is not None and self._lease.held

    async def _routed(self, machine_id: str, kind: str, fields: dict[str, str]) -> bool:
        """A notice another replica routed here (none is taken before serving)."""
        if self._route_here is None:
            return False
        return await self._route_here(machine_id, kind, fields)

    async def _start_singletons(self, replica: Replica, intents: Intents, jobs: list[_Job]) -> None:
        # Imported here: a lone process never loads NATS.
        from controlplane.cluster.lease import LEASE_TTL, JobLease

        assert replica.js_kv is not None
        metrics = self.metrics

        def held(now: bool) -> None:
            metrics.lease_held.set(1 if now else 0)
            if now:
                intents.mark_changed()  # a dead replica's changes are ours to finish

        lease = JobLease(
            await replica.js_kv("lease", LEASE_TTL),
            await replica.js_kv("jobs", None),
            replica.replica_id,
            on_held=held,
            on_run=lambda job: metrics.singleton_runs.labels(job).inc(),
        )
        self._lease = lease
        self._cluster_tasks = [asyncio.create_task(lease.run(), name="jobs-lease")]
        for job in jobs:
            self._cluster_tasks.append(
                asyncio.create_task(lease.every(job.name, job.period, job.once), name=job.name)
            )

    def _bind(self, keyring: KeyRing) -> grpc.aio.Server:
        """The gRPC server with both listeners bound (not started yet): RuntimeError
        (gRPC's "failed to bind") when a port is in use."""
        cfg = self.cfg
        server = grpc.aio.server(
            # The cause first: every store request of the call counts under it.
            # Counting next: it wraps the error mapping and so sees the final code.
            interceptors=[
                CauseInterceptor(rpc_causes(ADMIN_SERVICE, LINK_SERVICE)),
                CallsInterceptor(self.metrics.call_counters(ADMIN_SERVICE, LINK_SERVICE)),
                ErrorInterceptor(),
            ],
            options=list(SERVER_OPTIONS),
        )
        self._server = server
        # The chain carries the CA too: a joining machine checks it against the
        # pinned hash before it sends its token (kubeadm-style discovery).
        # Both are read from the key ring at each handshake, so a rotation reaches
        # new connections without a restart (controlplane.recovery.rotation).
        public_creds = _dynamic_credentials(keyring, client_auth=False)
        link_creds = _dynamic_credentials(keyring, client_auth=True)
        host, port = parse_hostport(cfg.listen, "listen")
        lhost, lport = parse_hostport(cfg.link_listen, "link_listen")
        check_can_listen(host, port, "listen")
        check_can_listen(lhost, lport, "link_listen")
        self.public_port = server.add_secure_port(f"{_bracket(host)}:{port}", public_creds)
        self.link_port = server.add_secure_port(f"{_bracket(lhost)}:{lport}", link_creds)
        return server

    def _fenced(self, problem: StoreFenced) -> None:
        self.fenced = problem
        self.request_stop()

    def _write_serve_info(self) -> None:
        self._wrote_serve_info = True
        write_atomic(
            self.cfg.serve_path,
            json.dumps(self._serve_info, indent=2).encode() + b"\n",
            mode=0o600,
        )

    def _rotated(self, kind: str, result: str) -> None:
        """A key rotation ended: count it; serve.json names the CA joins pin now."""
        self.metrics.key_rotations.labels(kind, result).inc()
        if result == "ok" and self._serve_info and self._keyring is not None:
            self._serve_info["ca_hash"] = self._keyring.keys.ca_hash
            self._write_serve_info()

    async def wait(self) -> None:
        """Wait until :meth:`stop` is called."""
        await self._stopped.wait()

    def request_stop(self) -> None:
        """Ask :meth:`wait` to return (signal handlers call this)."""
        self._stopped.set()

    async def stop(self, grace: float) -> None:
        """Drain for ``grace`` seconds, then close the server, /metrics and the store."""
        self._stopped.set()
        for task in self._cluster_tasks:
            task.cancel()
        await asyncio.gather(*self._cluster_tasks, return_exceptions=True)
        self._cluster_tasks = []
        if self._offline is not None:
            offline, self._offline = self._offline, None
            offline.cancel()
            await asyncio.gather(offline, return_exceptions=True)
        if self._stamps is not None:
            stamps, self._stamps = self._stamps, None
            stamps.cancel()
            await asyncio.gather(stamps, return_exceptions=True)
        if self._waker is not None:
            waker, self._waker = self._waker, None
            waker.cancel()
            await asyncio.gather(waker, return_exceptions=True)
        if self._clocks is not None:
            clocks, self._clocks = self._clocks, None
            clocks.cancel()
            await asyncio.gather(clocks, return_exceptions=True)
        if self._audit_sweep is not None:
            sweep, self._audit_sweep = self._audit_sweep, None
            sweep.cancel()
            await asyncio.gather(sweep, return_exceptions=True)
        if self._checker is not None:
            checker, self._checker = self._checker, None
            checker.cancel()
            await asyncio.gather(checker, return_exceptions=True)
        if self._deletion is not None:
            deletion, self._deletion = self._deletion, None
            await deletion.close()  # resumed by the next start
        if self._health is not None:
            health, self._health = self._health, None
            # Load balancers and probes stop sending new work before the drain starts.
            await health.enter_graceful_shutdown()
        if self._server is not None:
            server, self._server = self._server, None
            # Connect streams never end by themselves: close them first so the
            # drain waits only for ordinary calls.
            if self._presence is not None:
                self._presence.close_all()
            if self._prompts is not None:
                await self._prompts.close()
            if self._starter is not None:
                await self._starter.close()
            await server.stop(grace)
        if self._replica is not None:
            replica, self._replica = self._replica, None
            await replica.close()
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        if self._store is not None:
            store, self._store = self._store, None
            await store.close()
        if self._wrote_serve_info:  # never another serve's (one that failed to start)
            self._wrote_serve_info = False
            with contextlib.suppress(FileNotFoundError):
                self.cfg.serve_path.unlink()
        if self._home_lock is not None:
            lock, self._home_lock = self._home_lock, None
            os.close(lock)


@dataclass(frozen=True)
class _Job:
    """A periodic job on shared state, run under the replicas' lease."""

    name: str
    """Its name in the jobs bucket (``done.<name>``) and the singleton_runs label."""
    period: float
    """Seconds between two due times."""
    cause: str
    """The store-request cause its requests count under."""
    run: Callable[[], Awaitable[object]]
    """One run."""

    async def once(self) -> None:
        with store_cause(self.cause):
            await self.run()


async def _count_offline(
    presence: PresenceRegistry, fleet: FleetView, metrics: ControlMetrics
) -> None:
    """Set agents_cp_machines_offline now and every minute, from the fleet as last
    listed (machines.fleet: no store request while nothing changed)."""
    set_cause("offline")
    outage = OutageLog(logger, "machines offline: cannot count")
    while True:
        try:
            metrics.machines_offline.set(presence.count_offline(await fleet.machines()))
        except AgentsError as e:
            outage.failed(e)
        else:
            outage.recovered()
        await asyncio.sleep(OFFLINE_COUNT_INTERVAL)


async def _reseal(cfg: ControlConfig, trusted: TrustedStore) -> bool:
    """Bring ``cp/keys.sealed`` up to date with the home (a no-op when it is).

    False when it cannot be (no bundle, or one that does not verify)."""
    try:
        await reseal_key_bundle(cfg.home, trusted.store)
        return True
    except (InvalidState, IntegrityError) as e:
        # Serving goes on (the machines need it); the operator must act on this.
        logger.error(
            "%s: this deployment cannot be restored from its store (docs/runbooks/"
            "disaster-recovery.md)",
            e,
        )
        return False


async def _self_check(
    guard: DeploymentGuard, intents: Intents, interval: float, fence: Fence | None = None
) -> None:
    """Every ``interval`` seconds: is the store still ours (and our epoch still the
    current one); then finish abandoned changes.

    One GET (and one HEAD) a tick, and a listing of intents/ while one is left
    (else every few minutes: Intents.recover_if_due). The heartbeat interval is the period machines
    notice us by, so a swapped store, or a newer control plane, is noticed about
    as fast as a machine would be, even by an idle process. A store that fails
    (gone, unreachable, misconfigured) is one warning line until a tick works
    again, then one line says so (shared.outage), not a line per tick.
    """
    set_cause("self_check")
    outage = OutageLog(logger, "self-check")
    while True:
        await asyncio.sleep(interval)
        try:
            await guard.verify()
            if fence is not None and guard.problem is None:
                await fence.check()
            if guard.problem is None:
                with store_cause("intents"):
                    await intents.recover_if_due()
        except AgentsError as e:
            outage.failed(e)
        else:
            outage.recovered()


async def _join_replicas(
    cfg: ControlConfig, home_id: str, intents: Intents, cp: ControlPlane, link_address: str
) -> Replica:
    """This process as one replica (controlplane.cluster): connected to NATS, with
    every live replica known. Imported here: a lone process never loads NATS."""
    from controlplane.cluster.replica import Replica

    if not link_address:
        logger.warning(
            "replica: the link listener is on every interface and advertise_host is not "
            "set: machines linked to other replicas cannot learn this one's address"
        )

    async def routed(machine_id: str, kind: str, fields: dict[str, str]) -> bool:
        return await cp._routed(machine_id, kind, fields)

    def account_deleted(account_id: str) -> None:
        if cp._presence is not None:
            cp._presence.close_account_here(account_id)

    def gone(replica_id: str) -> None:
        intents.mark_changed()  # its unfinished changes may be ours to finish now

    def added(replica_id: str) -> None:
        # Machines linked here learn its link address (a fresh welcome lists it).
        if cp._presence is not None:
            cp._presence.tell_all(ReplicasChangedNotice())

    replica = Replica(
        cluster_servers(cfg.cluster_url),
        home_id,
        heartbeat_interval=cfg.heartbeat_interval,
        owner=intents.owner,
        on_notice=routed,
        on_account_deleted=account_deleted,
        on_replica_gone=gone,
        on_routed=lambda outcome: cp.metrics.cluster_routed.labels(outcome).inc(),
        link_address=link_address,
    )
    replica.board.on_replica_added = added
    try:
        await replica.start()
    except BaseException:
        await replica.close()
        raise
    # From the first recovery on (at start, before the lease can be held): another
    # process's unfinished change is finished only by the lease holder, and only
    # once its owner is gone.
    intents.share_with(lambda owner: cp.holds_lease() and not replica.owner_alive(owner))
    return replica


def _machine_backups(
    trusted: TrustedStore, machines: MachineRegistry, accounts: AccountService
) -> MachineBackups | None:
    """The backup RPCs' domain: segments in the un-MAC'd store, manifests MAC'd
    (None: backups refused)."""
    if trusted.backups is None:
        return None

    async def exists(account_id: str, machine_id: str) -> bool:
        return await machines.load_any(account_id, machine_id) is not None

    async def gone(account_id: str) -> bool:
        return await accounts.is_deleting(account_id) or await accounts.was_deleted(account_id)

    return MachineBackups(trusted.backups, exists=exists, gone=gone, records=trusted.store)


def _certificate_config(ring: KeyRing, client_auth: bool) -> grpc.ServerCertificateConfiguration:
    keys = ring.keys
    # The chain carries the CA too: a joining machine checks it against the
    # pinned hash before it sends its token (kubeadm-style discovery).
    pair = [(keys.server.key_pem, keys.server.cert_pem + keys.ca.cert_pem)]
    roots = keys.ca_bundle_pem if client_auth else None
    return grpc.ssl_server_certificate_configuration(pair, root_certificates=roots)


def _dynamic_credentials(ring: KeyRing, *, client_auth: bool) -> grpc.ServerCredentials:
    """TLS credentials that follow the key ring: gRPC asks before each handshake."""
    seen = ring.version

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        nonlocal seen
        if ring.version == seen:
            return None  # unchanged: gRPC keeps the current configuration
        seen = ring.version
        return _certificate_config(ring, client_auth)

    return grpc.dynamic_ssl_server_credentials(
        _certificate_config(ring, client_auth),
        # gRPC documents None as "keep the current one"; grpc-stubs does not.
        fetch,  # type: ignore[arg-type]
        require_client_authentication=client_auth,
    )


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def run_daemon(cfg: ControlConfig, grace: float = 10.0) -> None:
    """Run until SIGTERM/SIGINT: the first drains for ``grace`` seconds, a second cancels.

    systemd hears READY once the start returned, STOPPING when the drain begins,
    and the watchdog pings in between (see the module doc).
    """
    loop = asyncio.get_running_loop()
    async with ControlPlane(cfg) as cp:
        notifier = cp.notifier
        signals = 0
        main = asyncio.current_task()

        def on_signal() -> None:
            nonlocal signals
            signals += 1
            if signals == 1:
                logger.info("stopping (grace %.0fs); signal again to cancel", grace)
                cp.request_stop()
            elif main is not None:
                notifier.status("stopping: cancelled (second stop signal)")
                main.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        try:
            # start() returned: both listeners serve, the store is verified and ours;
            # and a stop from now on drains.
            notifier.ready(f"serving: public port {cp.public_port}, link port {cp.link_port}")
            async with notifier.pinging():
                await cp.wait()
                if cp.fenced is not None:
                    notifier.stopping(f"stopping: {cp.fenced}")
                else:
                    notifier.stopping(f"stopping: draining for up to {grace:g} s")
                # A fenced process has nothing to drain: another one owns the store.
                await cp.stop(0 if cp.fenced else grace)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        if cp.fenced is not None:
            raise cp.fenced
