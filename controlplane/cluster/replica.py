"""One replica's view of the others: presence and routing over NATS.

Presence lives in a JetStream KV bucket whose entries expire after
:data:`TTL_HEARTBEATS` heartbeat intervals (``agents-<deployment>-presence``):

- ``m.<machine id>``: the replica holding the machine's link, its account, last
  seen, version and agent count; written when the link opens and again every
  heartbeat interval while it is up, deleted when it ends (unless another
  replica wrote it since: the machine moved).
- ``r.<replica id>``: a live replica and the owner token of its intents
  (controlplane.integrity.intents): recovery leaves a live replica's intents
  alone, and only the lease holder resolves a dead one's.

Every replica watches the whole bucket, so a listing asks no one: an entry not
refreshed within the TTL counts as gone (JetStream drops it without telling
watchers). A SIGKILLed replica's machines therefore read as offline within the
TTL, and as online again once they have linked to another replica.

Routing: the replica holding a machine's link subscribes to
``agents.<deployment>.machine.<id>.notice`` while it is up; a notice for a
machine not linked here is a request on that subject (revoke, renew-now, drain
its prompt queue), answered by the holder; no responder means nobody holds it
now (its next link gets what the store says). Account deletions are published
to every replica. With NATS unreachable, local links go on as before and a call
that needs another replica is refused with UNAVAILABLE naming NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue

from controlplane.integrity.records import parse_time, utc_iso
from shared.errors import AgentsError, TransientError
from shared.outage import OutageLog
from shared.timestamps import utc_now

__all__ = ["TTL_HEARTBEATS", "Holder", "NoticeHandler", "Replica", "deployment_name"]

logger = logging.getLogger(__name__)

#: Heartbeat intervals a presence entry outlives its last refresh.
TTL_HEARTBEATS: Final = 3
#: The shortest presence TTL (seconds): a refresh must land well within it.
MIN_TTL: Final = 1.5
#: Seconds a replica's start waits for NATS to answer.
CONNECT_TIMEOUT: Final = 5.0
#: Seconds a routed notice waits for the holding replica's answer.
REQUEST_TIMEOUT: Final = 3.0

#: JetStream's "wrong last sequence" error codes (a conditional write lost).
WRONG_LAST_SEQUENCE: Final = (10071, 10164)

#: ``handler(machine_id, kind, fields)``: deliver a routed notice to a local link;
#: False when the machine has none here.
NoticeHandler = Callable[[str, str, dict[str, str]], Awaitable[bool]]


def deployment_name(home_id: str) -> str:
    """The deployment's name in NATS (KV buckets, subjects): replicas of one home
    share it, another deployment on the same NATS server does not."""
    return f"agents-{home_id[:16]}"


@dataclass(frozen=True)
class Holder:
    """A machine linked to another replica, as its presence entry says."""

    replica: str
    account_id: str
    last_seen_at: dt.datetime
    version: str
    agent_count: int
    expires: float
    """Monotonic time after which the entry counts as gone."""


class Replica:
    """This process as one replica: NATS connection, presence, routing."""

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
    ) -> None:
        self.servers = servers
        self.replica_id = secrets.token_hex(6)
        self.name = deployment_name(home_id)
        self.ttl = max(MIN_TTL, TTL_HEARTBEATS * heartbeat_interval)
        self._refresh_every = self.ttl / TTL_HEARTBEATS
        self._owner = owner
        self._on_notice = on_notice
        self._on_account_deleted = on_account_deleted
        self._on_replica_gone = on_replica_gone
        self._on_routed = on_routed
        self._monotonic = monotonic
        self._nc: Client | None = None
        self._kv: KeyValue | None = None
        self.js_kv: Callable[[str, float | None], Awaitable[KeyValue]] | None = None
        self._holders: dict[str, Holder] = {}
        self._replicas: dict[str, tuple[str, float]] = {}  # id -> (owner, expires)
        # Machines linked here: (account, last seen, version, agents, kv revision).
        self._local: dict[str, dict[str, Any]] = {}
        self._subs: dict[str, Subscription] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._loaded = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._closing = False
        self.on_machine_changed: Callable[[str], None] | None = None
        """Called with a machine's id whenever its entry changes (another replica
        linked or unlinked it: the store's record of it was rewritten there)."""

    # ------------------------------------------------------------ lifecycle

    @property
    def where(self) -> str:
        """The NATS servers, as errors name them."""
        return ",".join(self.servers)

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    def _unavailable(self, what: str) -> TransientError:
        return TransientError(f"{what}: NATS at {self.where} is unreachable (replicas)")

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
            len(self._replicas) - 1,
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
        await nc.subscribe(f"{self._subject_root}.account.deleted", cb=self._account_deleted)
        self._watcher = asyncio.create_task(self._watch(), name="cluster-watch")
        self._tasks.append(self._watcher)
        self._tasks.append(asyncio.create_task(self._refresh(), name="cluster-refresh"))
        await self._announce()
        async with asyncio.timeout(10):
            await self._loaded.wait()

    async def close(self) -> None:
        """Leave: forget this replica's entries (its machines relink elsewhere)."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
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
        old = self._watcher
        if old is not None and not old.done():
            old.cancel()
            self._watcher = asyncio.create_task(self._watch(), name="cluster-watch")
            self._tasks.append(self._watcher)
            self._watcher.add_done_callback(self._forget_task)

    # ------------------------------------------------------------ presence

    @property
    def _subject_root(self) -> str:
        return f"agents.{self.name}"

    def _machine_subject(self, machine_id: str) -> str:
        return f"{self._subject_root}.machine.{machine_id}.notice"

    def holder(self, machine_id: str) -> Holder | None:
        """Who else holds ``machine_id``'s link now (None: no other replica)."""
        held = self._holders.get(machine_id)
        if held is None or held.replica == self.replica_id:
            return None
        if held.expires <= self._monotonic():
            return None
        return held

    def check_connected(self, what: str) -> None:
        """TransientError (UNAVAILABLE) naming NATS unless connected: what other
        replicas know cannot be trusted without it."""
        if not self.connected:
            raise self._unavailable(what)

    def owner_alive(self, owner: str) -> bool:
        """Whether a live replica (this one included) owns intents of ``owner``."""
        now = self._monotonic()
        return owner == self._owner or any(
            o == owner and expires > now for o, expires in self._replicas.values()
        )

    async def linked(
        self, machine_id: str, account_id: str, version: str, agent_count: int
    ) -> None:
        """A link opened here: take its routed notices, say we hold it."""
        self._local[machine_id] = {
            "account": account_id,
            "version": version,
            "agents": agent_count,
            "rev": 0,
        }
        if self._nc is None:
            return
        try:
            if machine_id not in self._subs:
                self._subs[machine_id] = await self._nc.subscribe(
                    self._machine_subject(machine_id), cb=self._notice
                )
            await self._put(machine_id)
        except Exception as e:  # NATS down: the link itself goes on
            logger.warning("machine %s: cannot announce its link over NATS: %s", machine_id, e)

    def seen(self, machine_id: str, agent_count: int) -> None:
        """The link was heard from (the next refresh says so)."""
        local = self._local.get(machine_id)
        if local is not None:
            local["agents"] = agent_count

    async def unlinked(self, machine_id: str) -> None:
        """The link ended here: stop taking its notices, drop the entry we wrote."""
        local = self._local.pop(machine_id, None)
        sub = self._subs.pop(machine_id, None)
        if self._nc is None or not self._nc.is_connected:
            return
        try:
            if sub is not None:
                await sub.unsubscribe()
            if local is not None and local["rev"] and self._kv is not None:
                # Only our own write: a newer one is another replica's (it moved).
                try:
                    await self._kv.delete(f"m.{machine_id}", last=local["rev"])
                except nats.js.errors.APIError as e:
                    if e.err_code not in WRONG_LAST_SEQUENCE:
                        raise
        except Exception as e:  # the entry expires by itself
            logger.info("machine %s: cannot withdraw its entry: %s", machine_id, e)

    async def _put(self, machine_id: str) -> None:
        local = self._local.get(machine_id)
        if local is None or self._kv is None:
            return
        value = {
            "replica": self.replica_id,
            "account": local["account"],
            "seen": utc_iso(utc_now()),
            "version": local["version"],
            "agents": local["agents"],
        }
        local["rev"] = await self._kv.put(f"m.{machine_id}", json.dumps(value).encode())

    async def _announce(self) -> None:
        if self._kv is not None:
            value = {"owner": self._owner}
            await self._kv.put(f"r.{self.replica_id}", json.dumps(value).encode())

    async def _refresh(self) -> None:
        """Every TTL/3: refresh this replica's entries; notice replicas gone."""
        outage = OutageLog(logger, f"NATS at {self.where}: cannot refresh presence")
        while True:
            await asyncio.sleep(self._refresh_every)  # a period, not synchronisation
            self._drop_gone()
            try:
                await self._announce()
                await asyncio.gather(*(self._put(m) for m in list(self._local)))
            except Exception as e:
                outage.failed(e)
            else:
                outage.recovered()

    def _drop_gone(self) -> None:
        now = self._monotonic()
        for rid, (_, expires) in list(self._replicas.items()):
            if expires <= now and rid != self.replica_id:
                del self._replicas[rid]
                logger.warning("replica %s is gone (no refresh within %.1fs)", rid, self.ttl)
                if self._on_replica_gone is not None:
                    self._on_replica_gone(rid)

    async def _watch(self) -> None:
        """Follow the bucket (every entry, then each change) for as long as we run."""
        while True:
            assert self._kv is not None
            watcher = None
            try:
                watcher = await self._kv.watchall()
                async for entry in watcher:
                    if entry is None:
                        self._loaded.set()  # the entries present at start are read
                        continue
                    self._apply(entry)
            except asyncio.CancelledError:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()  # type: ignore[no-untyped-call]
                raise
            except Exception as e:  # NATS went away: watch again once it is back
                logger.info("NATS presence watch ended: %s", e)
            await asyncio.sleep(self._refresh_every)  # retry pacing

    def _apply(self, entry: KeyValue.Entry) -> None:
        key = entry.key
        deleted = entry.operation in ("DEL", "PURGE")
        # Entries read at start may be older than the TTL's worth already.
        age = 0.0
        if entry.created is not None:
            created = entry.created
            if isinstance(created, dt.datetime):
                age = max(0.0, (utc_now() - created).total_seconds())
        expires = self._monotonic() + self.ttl - age
        try:
            value = json.loads(entry.value or b"{}") if not deleted else {}
        except ValueError:
            return
        if key.startswith("m."):
            machine_id = key[2:]
            held = self._holders.get(machine_id)
            if self.on_machine_changed is not None and (
                deleted or held is None or (held.replica != value.get("replica"))
            ):
                self.on_machine_changed(machine_id)
            if deleted:
                self._holders.pop(machine_id, None)
                return
            try:
                self._holders[machine_id] = Holder(
                    replica=str(value["replica"]),
                    account_id=str(value.get("account", "")),
                    last_seen_at=parse_time(str(value["seen"])),
                    version=str(value.get("version", "")),
                    agent_count=int(value.get("agents", 0)),
                    expires=expires,
                )
            except (KeyError, ValueError, TypeError):
                return
        elif key.startswith("r."):
            rid = key[2:]
            if deleted:
                if self._replicas.pop(rid, None) is not None and self._on_replica_gone:
                    self._on_replica_gone(rid)
                return
            self._replicas[rid] = (str(value.get("owner", "")), expires)

    # ------------------------------------------------------------ routing

    async def route(self, machine_id: str, kind: str, **fields: str) -> bool:
        """Ask the replica holding ``machine_id`` to deliver a notice; whether one
        did (False: no replica holds it now). TransientError naming NATS when
        NATS cannot be reached."""
        if self._nc is None or not self._nc.is_connected:
            if self._on_routed is not None:
                self._on_routed("unavailable")
            raise self._unavailable(f"machine {machine_id}: {kind}")
        payload = json.dumps({"kind": kind, **fields}).encode()
        try:
            reply = await self._nc.request(
                self._machine_subject(machine_id), payload, timeout=REQUEST_TIMEOUT
            )
        except nats.errors.NoRespondersError:
            outcome, done = "not_linked", False
        except (nats.errors.TimeoutError, nats.errors.Error, OSError) as e:
            if self._on_routed is not None:
                self._on_routed("unavailable")
            raise TransientError(
                f"machine {machine_id}: {kind}: the replica holding its link did not answer "
                f"over NATS at {self.where}: {str(e) or type(e).__name__}"
            ) from None
        else:
            done = reply.data == b"ok"
            outcome = "delivered" if done else "not_linked"
        if self._on_routed is not None:
            self._on_routed(outcome)
        return done

    def route_later(self, machine_id: str, kind: str, **fields: str) -> bool:
        """:meth:`route` in the background for a caller that cannot wait (a sync
        hook); True when another replica holds the machine (as presence says)."""
        if self.holder(machine_id) is None:
            return False
        task = asyncio.create_task(self._route_logged(machine_id, kind, fields))
        self._tasks.append(task)
        task.add_done_callback(self._forget_task)
        return True

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        with contextlib.suppress(ValueError):
            self._tasks.remove(task)

    async def _route_logged(self, machine_id: str, kind: str, fields: dict[str, str]) -> None:
        try:
            await self.route(machine_id, kind, **fields)
        except AgentsError as e:
            logger.warning("%s", e)

    async def _notice(self, msg: Msg) -> None:
        machine_id = msg.subject.split(".")[-2]
        try:
            data = json.loads(msg.data)
            kind = str(data.pop("kind"))
            fields = {str(k): str(v) for k, v in data.items()}
        except (ValueError, KeyError, AttributeError):
            await msg.respond(b"bad")
            return
        done = await self._on_notice(machine_id, kind, fields)
        await msg.respond(b"ok" if done else b"not_linked")

    async def account_deleted(self, account_id: str) -> None:
        """Tell every replica to close the account's links (best effort: a link
        missed here is refused at its next connect, its account being gone)."""
        if self._nc is None or not self._nc.is_connected:
            logger.warning("account %s: %s", account_id, self._unavailable("closing links"))
            return
        with contextlib.suppress(Exception):
            await self._nc.publish(f"{self._subject_root}.account.deleted", account_id.encode())

    def announce_account_deleted(self, account_id: str) -> None:
        """:meth:`account_deleted` in the background (a sync hook calls it)."""
        task = asyncio.create_task(self.account_deleted(account_id))
        self._tasks.append(task)
        task.add_done_callback(self._forget_task)

    async def _account_deleted(self, msg: Msg) -> None:
        self._on_account_deleted(msg.data.decode(errors="replace"))
