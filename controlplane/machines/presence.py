"""Presence: the registry of live machine links, and last-seen bookkeeping.

Each machine has at most one live :class:`Session` (a new Connect replaces the
old one). Messages for a machine go into its session's outbox; the Connect
handler sends them in order.

A machine's presence record is written when something about it changes, never
just because time passed: once per link (``online``, at a random point of its
first ``write_interval``, or with its first heartbeat when it reported a
schedule's fire time), when its next fire time changes (not held back), when
its agent count changes (at most once per interval), and when its link ends
(offline, with last seen). So an idle fleet costs no store request per machine
and hour, and a fleet connecting at once (a control plane restarted) waits on
no write before its welcome and does not write in step afterwards. While a
link is up, listings take last seen from the session; a record a control plane
killed without a goodbye left ``online`` is taken as seen until that process's
last alive stamp (:mod:`controlplane.machines.alive`: one write per interval for
the whole fleet), at most an interval before it died.

Replicas (``serve --cluster``): a :class:`Peers` (controlplane.cluster.replica)
is told of each link that opens and ends here; a machine linked to another
replica reads as online from there, notices for it are routed to that replica,
and an account deletion is announced to every replica. Without one (a lone
process) nothing of this runs.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from controlplane.integrity.records import Machine, Presence, decode, encode, presence_key
from controlplane.machines.alive import AliveStamps
from shared.errors import AgentsError, IntegrityError, NotFound
from shared.store.base import ObjectStore
from shared.store.causes import store_cause
from shared.timestamps import Clock, utc_now

if TYPE_CHECKING:
    pass

__all__ = [
    "AccountDeletedNotice",
    "CloseLink",
    "DeliveryNotice",
    "MachineStatus",
    "Outbox",
    "Peers",
    "RemoteLink",
    "Outgoing",
    "PresenceRegistry",
    "RenewNowNotice",
    "ReplicasChangedNotice",
    "RevokedNotice",
    "Session",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RevokedNotice:
    """Tell the machine it was revoked; the link closes after it."""

    reason: str


@dataclass(frozen=True)
class AccountDeletedNotice:
    """Tell the machine its account is being deleted; the link closes after it."""

    account_id: str


@dataclass(frozen=True)
class RenewNowNotice:
    """Ask the machine to renew its certificate."""

    reason: str


@dataclass(frozen=True)
class ReplicasChangedNotice:
    """A replica joined: the link sends a fresh welcome, which lists every live
    replica's link address (a machine adds those it lacks; an older one ignores it)."""


@dataclass(frozen=True)
class DeliveryNotice:
    """A queued prompt for the machine (still sealed to its box key)."""

    prompt_id: str
    agent_id: str
    sealed_prompt: bytes = field(repr=False)
    created_at: dt.datetime


class CloseReason(enum.Enum):
    """Why a link ended without a notice; the value is the metrics label."""

    CLOSED = "closed"
    TIMEOUT = "timeout"
    REPLACED = "replaced"
    SHUTDOWN = "shutdown"
    BROKEN = "broken"
    EXPIRED = "expired"


@dataclass(frozen=True)
class CloseLink:
    """End the link without a notice (see :class:`CloseReason`)."""

    reason: CloseReason


Outgoing = (
    RevokedNotice
    | AccountDeletedNotice
    | RenewNowNotice
    | DeliveryNotice
    | ReplicasChangedNotice
    | CloseLink
)
#: Notices after which the link closes.
TERMINAL = (RevokedNotice, AccountDeletedNotice, CloseLink)


class Outbox:
    """What a link sends next, in order, for its one reader (the link itself).

    ``asyncio.Queue``'s ``put_nowait``/``get``/``get_nowait`` without its three
    deques and its event: a few KiB per link, for a box that is empty nearly
    always.
    """

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[Outgoing] = []
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Outgoing) -> None:
        """Add ``item`` (never blocks)."""
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def get_nowait(self) -> Outgoing:
        """The next item; asyncio.QueueEmpty when there is none."""
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.pop(0)

    def empty(self) -> bool:
        """Whether nothing waits to be sent."""
        return not self._items

    async def get(self) -> Outgoing:
        """Wait for the next item (one reader at a time)."""
        while not self._items:
            assert self._waiter is None, "an outbox has one reader"
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.pop(0)


@dataclass
class Session:
    """One live link of one machine."""

    machine_id: str
    account_id: str
    version: str
    agent_count: int
    connected_at: dt.datetime
    last_seen_at: dt.datetime
    outbox: Outbox = field(default_factory=Outbox)
    last_write: float = -1e18
    """Monotonic time of the last last-seen write."""
    written: bool = False
    """A record of this link was written (the first one is due within its first
    interval)."""
    written_count: int = -1
    """The agent count the last write said."""
    next_fire_at: dt.datetime | None = None
    """The soonest schedule fire time the machine reported, or None."""
    fire_changed: bool = False
    """``next_fire_at`` changed since the last write: the next one is not held back."""

    async def next_outgoing(self) -> Outgoing:
        """Wait for the next message for this machine."""
        return await self.outbox.get()


@dataclass(frozen=True)
class MachineStatus:
    """A machine as listings show it: the record plus what presence knows."""

    machine: Machine
    online: bool
    last_seen_at: dt.datetime | None
    version: str
    agent_count: int
    next_fire_at: dt.datetime | None = None
    """The soonest schedule fire time it reported (kept after it went offline)."""


class RemoteLink(Protocol):
    """A machine's link held by another replica."""

    @property
    def last_seen_at(self) -> dt.datetime: ...
    @property
    def version(self) -> str: ...
    @property
    def agent_count(self) -> int: ...


class Peers(Protocol):
    """The other replicas (controlplane.cluster.replica.Replica), as presence uses them."""

    async def linked(
        self, machine_id: str, account_id: str, version: str, agent_count: int
    ) -> None:
        """A link opened here."""

    async def unlinked(self, machine_id: str) -> None:
        """The link ended here."""

    def holder(self, machine_id: str) -> RemoteLink | None:
        """The machine's link at another replica, if any."""

    def check_connected(self, what: str) -> None:
        """TransientError naming NATS unless the other replicas can be known."""

    async def route(self, machine_id: str, kind: str, **fields: str) -> bool:
        """Hand a notice to the replica holding the machine; whether it did."""

    def route_later(self, machine_id: str, kind: str, **fields: str) -> bool:
        """:meth:`route` in the background; whether another replica holds it."""

    def announce_account_deleted(self, account_id: str) -> None:
        """Tell every replica to close the account's links (in the background)."""


class PresenceRegistry:
    """Live sessions by machine id; one instance per daemon."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        write_interval: float = 60.0,
        clock: Clock = utc_now,
        monotonic: Callable[[], float] = time.monotonic,
        on_change: Callable[[int], None] | None = None,
        spread: Callable[[], float] = random.random,
        epoch: int = 0,
        alive: AliveStamps | None = None,
    ) -> None:
        self._store = store
        self._write_interval = write_interval
        self._clock = clock
        self._monotonic = monotonic
        # Where in its first interval a new link's first write falls (0 to 1).
        self._spread = spread
        self._epoch = epoch
        self._alive = alive
        self._on_change = on_change
        self._sessions: dict[str, Session] = {}
        # The stored presence of each machine, as this process last wrote or read
        # it (None: there is none). It is the only writer (fenced), so an offline
        # machine's status costs one GET per process, not one per wake check, a
        # machine that never connected included.
        self._stored: dict[str, Presence | None] = {}
        self._peers: Peers | None = None

    def set_peers(self, peers: Peers) -> None:
        """Serve as one replica of several (module doc); before any link opens."""
        self._peers = peers

    def forget_stored(self, machine_id: str) -> None:
        """The machine linked or unlinked at another replica, which writes its record:
        read it again when next asked (each link's start and end is seen in NATS)."""
        self._stored.pop(machine_id, None)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(len(self._sessions))

    @property
    def online_count(self) -> int:
        """How many machines have a live link."""
        return len(self._sessions)

    def session(self, machine_id: str) -> Session | None:
        """The machine's live session, if any."""
        return self._sessions.get(machine_id)

    async def open(self, machine: Machine, version: str, agent_count: int) -> Session:
        """Register a new link; an older link of the same machine is told to close."""
        now = self._clock()
        session = Session(
            machine_id=machine.machine_id,
            account_id=machine.account_id,
            version=version,
            agent_count=agent_count,
            connected_at=now,
            last_seen_at=now,
        )
        old = self._sessions.get(machine.machine_id)
        if old is not None:
            old.outbox.put_nowait(CloseLink(CloseReason.REPLACED))
        # The first write is due within the first interval (see the module doc).
        session.last_write = self._monotonic() - self._write_interval * self._spread()
        self._sessions[machine.machine_id] = session
        self._changed()
        logger.info("machine %s online", machine.machine_id)
        if self._peers is not None:
            await self._peers.linked(machine.machine_id, machine.account_id, version, agent_count)
        return session

    async def seen(self, session: Session, agent_count: int | None = None) -> None:
        """A heartbeat (or any message) arrived: update, and write at most once per interval."""
        if self.heard(session, agent_count):
            await self.write(session)

    def heard(self, session: Session, agent_count: int | None = None) -> bool:
        """:meth:`seen` without the write: whether one is due now (then :meth:`write`).
        Most heartbeats need none, and then cost no await."""
        session.last_seen_at = self._clock()
        if agent_count is not None:
            session.agent_count = agent_count
        if session.fire_changed:
            return True
        due = self._monotonic() - session.last_write >= self._write_interval
        # The link's first record; later ones only for a change (module doc).
        return due and (not session.written or session.agent_count != session.written_count)

    async def write(self, session: Session) -> None:
        """Write the session's last seen now (a write :meth:`heard` said is due)."""
        await self._write(session)

    def fire_reported(self, session: Session, next_fire_at: dt.datetime | None) -> None:
        """A heartbeat said when the machine's next schedule fires: a change is written
        with the next :meth:`seen` (not held back), so a machine that stops right
        after leaves its next fire time in the store to be woken for."""
        if next_fire_at != session.next_fire_at:
            session.next_fire_at = next_fire_at
            session.fire_changed = True

    async def close(self, session: Session) -> None:
        """The link ended: forget it and write last seen (idempotent; a replaced
        session is already forgotten and its successor writes for it)."""
        if self._sessions.get(session.machine_id) is not session:
            if self._peers is not None and session.machine_id not in self._sessions:
                await self._peers.unlinked(session.machine_id)  # kicked: no longer here
            return
        # Written before it is forgotten: a close cancelled during the write (the
        # link's reader task, torn down as the link ends) leaves the session
        # registered, so the link's own close writes it again. Forgotten first,
        # a cancelled write was lost and last seen went back to the link's
        # first record.
        await self._write(session, online=False)
        if self._sessions.get(session.machine_id) is not session:
            return  # replaced meanwhile (a reconnect): the successor writes for it
        del self._sessions[session.machine_id]
        self._changed()
        logger.info("machine %s offline", session.machine_id)
        if self._peers is not None:
            await self._peers.unlinked(session.machine_id)

    def close_all(self, reason: CloseReason = CloseReason.SHUTDOWN) -> int:
        """Tell every live link to end (at shutdown, so draining does not wait on them).

        Machines reconnect with backoff, to this daemon's successor.
        Returns how many links were told.
        """
        sessions = list(self._sessions.values())
        for session in sessions:
            session.outbox.put_nowait(CloseLink(reason))
        return len(sessions)

    def tell_all(self, message: Outgoing) -> int:
        """Queue ``message`` for every link held here; how many."""
        sessions = list(self._sessions.values())
        for session in sessions:
            session.outbox.put_nowait(message)
        return len(sessions)

    def online(self, machine_id: str) -> bool:
        """Whether the machine has a live link, here or at another replica."""
        if machine_id in self._sessions:
            return True
        return self._peers is not None and self._peers.holder(machine_id) is not None

    def notify(self, machine_id: str, message: Outgoing) -> bool:
        """Queue a message for the machine's live link; False when it is offline.
        A renew-now for a machine linked to another replica is routed there."""
        session = self._sessions.get(machine_id)
        if session is None:
            if self._peers is not None and isinstance(message, RenewNowNotice):
                return self._peers.route_later(machine_id, "renew_now", reason=message.reason)
            return False
        session.outbox.put_nowait(message)
        return True

    async def route(self, machine_id: str, kind: str, **fields: str) -> bool:
        """Hand a notice to the replica holding the machine's link; False when
        none does (or this process serves alone). TransientError naming NATS
        when it cannot be known."""
        if self._peers is None or machine_id in self._sessions:
            return False
        if self._peers.holder(machine_id) is None:
            self._peers.check_connected(f"machine {machine_id}")
            return False
        return await self._peers.route(machine_id, kind, **fields)

    async def kick(
        self, account_id: str, machine_id: str, reason: str = "machine revoked by an administrator"
    ) -> None:
        """Close a revoked (or repaired) machine's link at once, telling it ``reason``
        (a hook for MachineRegistry.revoke and .repair); at the replica holding it
        when that is another (the revoke is stored already: a failure to tell it
        is logged, and its next connect is refused)."""
        if self.notify(machine_id, RevokedNotice(reason)):
            if self._sessions.pop(machine_id, None) is not None:
                self._changed()
            return
        try:
            await self.route(machine_id, "revoked", reason=reason)
        except AgentsError as e:
            logger.warning(
                "machine %s: revoked, but its link stays until it reconnects: %s", machine_id, e
            )

    def close_account(self, account_id: str) -> int:
        """Tell every live link of ``account_id`` that the account is being deleted
        (and every other replica, to tell theirs).

        Each link sends ``account_deleted`` and ends; returns how many were told here.
        """
        if self._peers is not None:
            self._peers.announce_account_deleted(account_id)
        return self.close_account_here(account_id)

    def close_account_here(self, account_id: str) -> int:
        """:meth:`close_account` for this process's links only (what another
        replica's announcement asks of this one)."""
        sessions = [s for s in self._sessions.values() if s.account_id == account_id]
        for session in sessions:
            session.outbox.put_nowait(AccountDeletedNotice(account_id))
            self._sessions.pop(session.machine_id, None)
        if sessions:
            self._changed()
        return len(sessions)

    async def _write(self, session: Session, *, online: bool = True) -> None:
        session.last_write = self._monotonic()
        session.written = True
        session.written_count = session.agent_count
        session.fire_changed = False
        record = Presence(
            machine_id=session.machine_id,
            last_seen_at=session.last_seen_at,
            version=session.version,
            agent_count=session.agent_count,
            next_fire_at=session.next_fire_at,
            online=online,
            epoch=self._epoch,
        )
        try:
            with store_cause("presence"):
                await self._store.put(
                    presence_key(session.account_id, session.machine_id), encode(record)
                )
            self._stored[session.machine_id] = record
        except AgentsError as e:
            # Presence is advisory: a failed write must not end the link.
            logger.warning("presence %s: cannot write last seen: %s", session.machine_id, e)

    def count_offline(self, known: list[Machine]) -> int:
        """Machines of ``known`` (the fleet: machines.fleet), not revoked, without a
        live link here. Providers only start machines, never stop them on purpose,
        so every such machine counts."""
        return sum(1 for m in known if not m.revoked and not self.online(m.machine_id))

    async def status(self, machine: Machine) -> MachineStatus:
        """The machine's listing view: live session first, else its stored last seen."""
        live = self._sessions.get(machine.machine_id)
        if live is not None:
            return MachineStatus(
                machine,
                True,
                live.last_seen_at,
                live.version,
                live.agent_count,
                live.next_fire_at,
            )
        if self._peers is not None:
            remote = self._peers.holder(machine.machine_id)
            if remote is not None:
                return MachineStatus(
                    machine, True, remote.last_seen_at, remote.version, remote.agent_count
                )
            # Offline as far as NATS tells; without NATS, nobody knows.
            self._peers.check_connected("machine status")
        if machine.machine_id in self._stored:
            rec = self._stored[machine.machine_id]
        else:
            rec = self._stored[machine.machine_id] = await self._read(machine)
        if rec is None:
            # Missing, or refused (forged): either way nothing is known about it.
            return MachineStatus(machine, False, None, machine.version, 0)
        return MachineStatus(
            machine,
            False,
            self._last_seen(rec),
            rec.version or machine.version,
            rec.agent_count,
            rec.next_fire_at,
        )

    async def _read(self, machine: Machine) -> Presence | None:
        try:
            with store_cause("presence"):
                data = await self._store.get(presence_key(machine.account_id, machine.machine_id))
        except (NotFound, IntegrityError):
            return None
        return Presence.from_dict(decode(data, "presence"))

    def _last_seen(self, rec: Presence) -> dt.datetime:
        """A record left online by a control plane that stopped without closing the
        link: seen until that process's last alive stamp, if later (module doc)."""
        if not rec.online or rec.epoch == self._epoch or self._alive is None:
            return rec.last_seen_at
        stamped = self._alive.last_alive(rec.epoch)
        return max(rec.last_seen_at, stamped) if stamped is not None else rec.last_seen_at
