"""One replica of a deployment: its NATS connection, presence and routing.

Presence lives in two JetStream KV buckets:

- ``agents-<deployment>-links``, without expiry: ``m.<machine id>``, the
  replica holding the machine's link, its account, when it linked, version and
  agent count; written when the link opens here (a machine that moves is
  written by its new replica), deleted when it ends (unless another replica
  wrote it since: the machine moved). Not refreshed: its traffic follows link
  churn, not heartbeats times machines (every replica watches it all).
- ``agents-<deployment>-presence``, whose entries expire after
  :data:`TTL_HEARTBEATS` heartbeat intervals: ``r.<replica id>``, a live
  replica, refreshed every third of that, with the owner token of its intents
  (controlplane.integrity.intents: recovery leaves a live replica's intents
  alone, and only the lease holder finishes a dead one's) and its link
  address (``link``: what machines dial; every replica hands the live ones'
  to its machines at join and at each welcome, so they learn of each other).

A machine entry counts only while the replica it names is alive (its ``r.``
entry has not expired), and its last seen is that replica's last refresh (its
links end within a few silent heartbeats). Every replica watches both buckets
(:mod:`controlplane.cluster.board` keeps what it saw), so a listing asks no
one: a SIGKILLed replica's machines read as offline within the TTL, and as
online again once they have linked to another replica. The live replica with
the smallest id sweeps the entries a gone replica left (a delete conditional
on the revision it saw: a machine rewritten since has moved). A replica puts
its local links' entries again when they are missing (linked while NATS was
away, or swept while it was cut off from NATS). Notices for a machine linked
elsewhere go through :mod:`controlplane.cluster.routing`. With NATS
unreachable, local links go on as before and a call that needs another replica
is refused with UNAVAILABLE naming NATS; a start without NATS fails (it could
not tell a live replica's unfinished changes from abandoned ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.kv import KeyValue

from controlplane.cluster.board import Holder, PresenceBoard
from controlplane.cluster.faults import outage_error
from controlplane.cluster.routing import REQUEST_TIMEOUT, NoticeHandler, Router
from controlplane.integrity.records import utc_iso
from shared.errors import TransientError
from shared.outage import OutageLog
from shared.timestamps import utc_now

__all__ = ["CONNECT_TIMEOUT", "TTL_HEARTBEATS", "Replica", "deployment_name"]

logger = logging.getLogger(__name__)

#: Heartbeat intervals a presence entry outlives its last refresh.
TTL_HEARTBEATS: Final = 3
#: The shortest presence TTL (seconds): a refresh must land well within it.
MIN_TTL: Final = 1.5
#: Seconds a replica's start waits for NATS to answer.
CONNECT_TIMEOUT: Final = 5.0
#: Machine entries of gone replicas deleted per refresh round, at most.
SWEEP_BATCH: Final = 1000
#: JetStream's "wrong last sequence" error codes (a conditional write lost).
WRONG_LAST_SEQUENCE: Final = (10071, 10164)


def deployment_name(home_id: str) -> str:
    """The deployment's name in NATS (KV buckets, subjects): replicas of one home
    share it, another deployment on the same NATS server does not."""
    return f"agents-{home_id[:16]}"


@dataclass
class _Local:
    """A link held here, as its presence entry says it."""

    account_id: str
    version: str
    agent_count: int
    revision: int = 0
    """The entry's revision we last wrote (0: none yet)."""


class Replica:
    """This process as one replica (module doc); implements presence's ``Peers``."""

    def __init__(
        self,
        servers: tuple[str, ...],
        home_id: str,
        *,
        heartbeat_interval: float,
        owner: str,
        on_notice: NoticeHandler,
        on_account_deleted: Callable[[str], object],
        on_replica_gone: Callable[[str], None] | None = None,
        on_routed: Callable[[str], None] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        link_address: str = "",
    ) -> None:
        self.servers = servers
        self.replica_id = secrets.token_hex(6)
        self.name = deployment_name(home_id)
        self.ttl = max(MIN_TTL, TTL_HEARTBEATS * heartbeat_interval)
        self._refresh_every = self.ttl / TTL_HEARTBEATS
        self._owner = owner
        self._link = link_address
        self.board = PresenceBoard(
            self.replica_id,
            owner,
            self.ttl,
            on_replica_gone=on_replica_gone,
            monotonic=monotonic,
            link_address=link_address,
        )
        self.router = Router(
            self.name,
            self.where,
            on_notice=on_notice,
            on_account_deleted=on_account_deleted,
            on_routed=on_routed,
            holds=lambda machine_id: self.board.holder(machine_id) is not None,
        )
        self._nc: Client | None = None
        self._kv: KeyValue | None = None
        self._links_kv: KeyValue | None = None
        self.js_kv: Callable[[str, float | None], Awaitable[KeyValue]] | None = None
        """Opens (or makes) one of the deployment's KV buckets (the lease's too)."""
        self._local: dict[str, _Local] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._loaded = {"presence": asyncio.Event(), "links": asyncio.Event()}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._closing = False

    # ------------------------------------------------------------ lifecycle

    @property
    def where(self) -> str:
        """The NATS servers, as errors name them."""
        return ",".join(self.servers)

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def start(self) -> None:
        """Connect, open the buckets, load every replica's presence and announce
        this one (before recovery: a live replica's intents are left alone)."""
        try:
            # Bounded: an unreachable server is retried for ever by the client.
            async with asyncio.timeout(CONNECT_TIMEOUT):
                nc = await self._connect()
        except (OSError, nats.errors.Error, TimeoutError) as e:
            raise TransientError(
                f"cluster: cannot reach NATS at {self.where}: {str(e) or type(e).__name__}"
            ) from None
        self._nc = nc
        try:
            await self._open(nc)
        except (nats.errors.Error, TimeoutError) as e:
            raise TransientError(
                f"cluster: NATS at {self.where} answered but its JetStream did not (is it "
                f"started with -js?): {str(e) or type(e).__name__}"
            ) from None
        logger.info(
            "replica %s of %s: NATS %s, %d other replica(s) alive",
            self.replica_id,
            self.name,
            self.where,
            self.board.others,
        )

    async def _connect(self) -> Client:
        return await nats.connect(
            servers=list(self.servers),
            name=f"agents-control {self.replica_id}",
            connect_timeout=2,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=self._error,
            disconnected_cb=self._disconnected,
            reconnected_cb=self._reconnected,
        )

    async def _open(self, nc: Client) -> None:
        js = nc.jetstream(timeout=REQUEST_TIMEOUT)

        async def kv(suffix: str, ttl: float | None) -> KeyValue:
            bucket = f"{self.name}-{suffix}"
            try:
                return await js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError:
                with contextlib.suppress(nats.js.errors.BadRequestError):
                    return await js.create_key_value(bucket=bucket, ttl=ttl, history=1)
                return await js.key_value(bucket)  # another replica made it meanwhile

        self.js_kv = kv
        self._kv = await kv("presence", self.ttl)
        self._links_kv = await kv("links", None)
        await self.router.start(nc)
        for bucket in self._loaded:
            self._start_watch(bucket)
        self._tasks.append(asyncio.create_task(self._refresh(), name="cluster-refresh"))
        await self._announce()
        async with asyncio.timeout(10):
            for loaded in self._loaded.values():
                await loaded.wait()

    def _start_watch(self, bucket: str) -> None:
        task = asyncio.create_task(self._watch(bucket), name=f"cluster-watch-{bucket}")
        self._watchers[bucket] = task
        self._tasks.append(task)

    async def close(self) -> None:
        """Leave: forget this replica's entries (its machines relink elsewhere)."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.router.close()
        if self._nc is not None:
            nc, self._nc = self._nc, None
            if nc.is_connected and self._kv is not None:
                with contextlib.suppress(Exception):  # best effort: the TTL ends them anyway
                    await self._kv.delete(f"r.{self.replica_id}")
            with contextlib.suppress(Exception):
                await nc.close()

    async def _error(self, e: Exception) -> None:
        logger.debug("NATS: %s", e)

    async def _disconnected(self) -> None:
        if not self._closing:
            logger.warning("NATS at %s: disconnected; local links go on", self.where)

    async def _reconnected(self) -> None:
        logger.info("NATS at %s: reconnected", self.where)
        # A restarted server lost the watch's consumer: watch again, from the
        # bucket's current entries (our own are put again by the next refresh).
        for bucket, old in list(self._watchers.items()):
            if not old.done():
                old.cancel()
                self._start_watch(bucket)

    # ------------------------------------------------------------ Peers (presence)

    def holder(self, machine_id: str) -> Holder | None:
        """Who else holds ``machine_id``'s link now (None: no other replica)."""
        return self.board.holder(machine_id)

    def owner_alive(self, owner: str) -> bool:
        """Whether a live replica (this one included) owns intents of ``owner``."""
        return self.board.owner_alive(owner)

    def link_addresses(self, most: int) -> tuple[str, ...]:
        """The live replicas' link addresses, this one's first (board.link_addresses);
        none while NATS is unreachable: this replica then sees no other, and a list
        of itself alone would make its machines forget the others (a machine takes
        back the learned addresses a list no longer names; an empty list changes
        nothing)."""
        if not self.connected:
            return ()
        return self.board.link_addresses(most)

    def check_connected(self, what: str) -> None:
        """TransientError (UNAVAILABLE) naming NATS unless connected: what other
        replicas know cannot be trusted without it."""
        if not self.connected:
            raise self.router.unavailable(what)

    async def route(self, machine_id: str, kind: str, **fields: str) -> bool:
        """Hand a notice to the replica holding the machine (routing.Router.route)."""
        return await self.router.route(machine_id, kind, **fields)

    def route_later(self, machine_id: str, kind: str, **fields: str) -> bool:
        """:meth:`route` in the background; whether another replica holds it."""
        return self.router.route_later(machine_id, kind, **fields)

    def announce_account_deleted(self, account_id: str) -> None:
        """Tell every replica to close the account's links (in the background)."""
        self.router.announce_account_deleted(account_id)

    async def linked(
        self, machine_id: str, account_id: str, version: str, agent_count: int
    ) -> None:
        """A link opened here: take its routed notices, say we hold it."""
        self._local[machine_id] = _Local(account_id, version, agent_count)
        if not self.connected:
            return  # no wait for NATS before the welcome: the next refresh says it
        try:
            await self.router.take(machine_id)
            await self._put(machine_id)
        except (nats.errors.Error, OSError) as e:  # NATS down: the link itself goes on
            logger.warning("machine %s: cannot announce its link over NATS: %s", machine_id, e)

    async def unlinked(self, machine_id: str) -> None:
        """The link ended here: stop taking its notices, drop the entry we wrote."""
        local = self._local.pop(machine_id, None)
        try:
            await self.router.drop(machine_id)
            if not self.connected:
                return  # put again if NATS comes back first; else swept with us
            if local is not None and local.revision:
                # Only our own write: a newer one is another replica's (it moved).
                await self._delete_machine(machine_id, local.revision)
        except (nats.errors.Error, OSError) as e:  # swept once this replica is gone
            logger.info("machine %s: cannot withdraw its entry: %s", machine_id, e)

    # ------------------------------------------------------------ the bucket

    async def _delete_machine(self, machine_id: str, revision: int) -> None:
        """Delete ``m.<machine_id>`` if still at ``revision`` (else it moved)."""
        if self._links_kv is None:
            return
        try:
            await self._links_kv.delete(f"m.{machine_id}", last=revision)
        except nats.js.errors.APIError as e:
            if e.err_code not in WRONG_LAST_SEQUENCE:
                raise

    async def _put(self, machine_id: str) -> None:
        local = self._local.get(machine_id)
        if local is None or self._links_kv is None:
            return
        value = {
            "replica": self.replica_id,
            "account": local.account_id,
            "seen": utc_iso(utc_now()),
            "version": local.version,
            "agents": local.agent_count,
        }
        local.revision = await self._links_kv.put(f"m.{machine_id}", json.dumps(value).encode())

    async def _announce(self) -> None:
        if self._kv is not None:
            value = {"owner": self._owner, "link": self._link}
            await self._kv.put(f"r.{self.replica_id}", json.dumps(value).encode())

    def _missing(self) -> list[str]:
        """Local links whose entry is not on the board: linked while NATS was
        away, or swept while this replica was cut off (and taken for gone). One
        another replica rewrote since is not ours to take back (it moved)."""
        out: list[str] = []
        for machine_id, local in self._local.items():
            entry = self.board.entry(machine_id)
            # (An entry put but not read back yet is put again: harmless, and rare.)
            if local.revision == 0 or entry is None:
                out.append(machine_id)
        return out

    async def _sweep(self) -> None:
        """Delete the machine entries gone replicas left (one sweeper: board.sweeper)."""
        if not self.board.sweeper:
            return
        # Bounded per round: the next refresh of our own entry waits for it.
        orphans = self.board.orphans()[:SWEEP_BATCH]
        if orphans:
            logger.info("sweeping %d machine entries of replicas gone", len(orphans))
        await asyncio.gather(*(self._delete_machine(m, rev) for m, rev in orphans))

    async def _refresh(self) -> None:
        """Every TTL/3: refresh this replica's entry, put its missing machine
        entries, notice replicas gone and sweep what they left."""
        outage = OutageLog(logger, f"NATS at {self.where}: cannot refresh presence")
        while True:
            await asyncio.sleep(self._refresh_every)  # a period, not synchronisation
            self.board.drop_gone()
            try:
                await self._announce()
                missing = self._missing()
                for machine_id in missing:
                    await self.router.take(machine_id)  # linked while NATS was away
                await asyncio.gather(*(self._put(m) for m in missing))
                await self._sweep()
            except (nats.errors.Error, OSError) as e:
                outage.failed(outage_error(e))
            else:
                outage.recovered()

    async def _watch(self, bucket: str) -> None:
        """Follow a bucket (every entry, then each change) for as long as we run."""
        kv = self._links_kv if bucket == "links" else self._kv
        while True:
            assert kv is not None
            watcher = None
            # The links read afresh: entries deleted while the watch was away go.
            present: set[str] | None = set() if bucket == "links" else None
            try:
                watcher = await kv.watchall()
                async for entry in watcher:
                    if entry is None:
                        if present is not None:
                            self.board.keep_machines(k[2:] for k in present)
                            present = None
                        self._loaded[bucket].set()  # the entries present at start are read
                        continue
                    deleted = entry.operation in ("DEL", "PURGE")
                    if present is not None and not deleted:
                        present.add(entry.key)
                    self.board.apply(
                        entry.key, entry.value, deleted, entry.created, entry.revision or 0
                    )
            except asyncio.CancelledError:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()  # type: ignore[no-untyped-call]
                raise
            except (nats.errors.Error, OSError) as e:  # watch again once NATS is back
                logger.info("NATS presence watch ended: %s", e)
            except Exception:  # a bug: its traceback, and the watch goes on
                logger.exception("NATS presence watch failed; watching again")
            await asyncio.sleep(self._refresh_every)  # retry pacing
