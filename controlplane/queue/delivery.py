"""Prompt delivery: from the queue in the store to a machine's Connect stream.

Every prompt is written to the queue first (:class:`~controlplane.queue.prompts.PromptQueue`,
its one create-once put is the commit point); delivery only reads the queue:

- When a machine connects, and after each send to a connected machine, the
  machine's queue is listed and every entry not already in flight on its link
  is put in the link's outbox, in sequence order. One drain per machine runs
  at a time, so the outbox keeps sequence order; the machine handles
  deliveries one after another and so runs each agent's prompts in order.
- The entry is deleted only after the machine's acknowledgement (it stored the
  prompt durably, deduplicated by prompt id), in batches with the other
  acknowledgements that arrive meanwhile (:class:`~controlplane.queue.acks.AckBatcher`).
  A control plane killed between the delivery and the delete delivers the
  entry again on the next connect and the machine answers the same run id; a
  machine killed before its ack gets it again too. Neither loses nor runs a prompt twice.
- A link that ends forgets what was in flight on it: the next connect
  delivers it again.
- A drain the store failed (a listing or a read that ran out of retries), or an
  acknowledged entry whose delete failed, is drained again while the link is
  up, after a wait that doubles from :data:`REDRAIN_FIRST` up to
  :data:`REDRAIN_MAX`: a transient error is never the end of a delivery. Before,
  nothing drained again until the next connect or send, so a connected
  machine's queue could wait for ever behind one lost answer.

Outcomes the store no longer shows (acknowledged with a run id, refused with a
reason) are kept in memory, the last :data:`RECENT` per machine, for
``prompt list``.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from controlplane.access.principals import Principal
from controlplane.machines.links import Ack
from controlplane.machines.presence import DeliveryNotice, PresenceRegistry, Session
from controlplane.queue.acks import AckBatcher
from controlplane.queue.prompts import PromptQueue, QueuedPrompt
from shared.errors import AgentsError
from shared.store.causes import set_cause
from shared.timestamps import Clock, utc_now

__all__ = ["PromptDelivery", "PromptState", "SendOutcome"]

logger = logging.getLogger(__name__)

#: Outcomes remembered per machine for listings.
RECENT: Final = 100
#: Seconds a send to a connected machine waits for its acknowledgement.
ACK_WAIT: Final = 10.0
#: Seconds before a failed drain (or a failed delete of an acknowledged entry)
#: is drained again; the wait doubles after each failure, up to REDRAIN_MAX.
REDRAIN_FIRST: Final = 0.5
REDRAIN_MAX: Final = 30.0


@dataclass(frozen=True)
class SendOutcome:
    """What ``prompt send`` answers."""

    prompt_id: str
    state: str
    """queued, delivered (no ack yet), acknowledged or refused."""
    run_id: str = ""
    reason: str = ""


@dataclass(frozen=True)
class PromptState:
    """One prompt as ``prompt list`` shows it (never its text)."""

    prompt_id: str
    agent_id: str
    created_at: dt.datetime
    size: int
    state: str
    run_id: str = ""
    reason: str = ""


@dataclass
class _Link:
    session: Session
    in_flight: dict[str, QueuedPrompt]
    lock: asyncio.Lock
    redrain: asyncio.Task[None] | None = None
    """The drain waiting to run again after a failure, if any."""
    wait: float = REDRAIN_FIRST
    """Seconds the next drain after a failure waits."""


class PromptDelivery:
    """Sends, drains and acknowledgements; one instance per daemon."""

    def __init__(
        self,
        queue: PromptQueue,
        presence: PresenceRegistry,
        *,
        ack_wait: float = ACK_WAIT,
        clock: Clock = utc_now,
        on_queued: Callable[[str, str], None] | None = None,
        on_connected: Callable[[str], None] | None = None,
        redrain_first: float = REDRAIN_FIRST,
        redrain_max: float = REDRAIN_MAX,
    ) -> None:
        self._queue = queue
        self._redrain_first = redrain_first
        self._redrain_max = redrain_max
        self._presence = presence
        self._ack_wait = ack_wait
        self._clock = clock
        self._on_queued = on_queued
        self._on_connected = on_connected
        self._links: dict[str, _Link] = {}
        self._waiters: dict[str, asyncio.Future[SendOutcome]] = {}
        self._recent: dict[str, collections.deque[PromptState]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._acks = AckBatcher(queue)

    # ------------------------------------------------------------ admin side

    async def send(
        self,
        principal: Principal,
        machine_id: str,
        agent_id: str,
        text: str,
        idempotency_key: str = "",
    ) -> SendOutcome:
        """Queue the prompt; with the machine connected, deliver it and wait (a
        bounded time) for its acknowledgement."""
        # An offline machine's roster decides whether the agent exists; an
        # online machine answers itself (its roster may be a heartbeat old).
        sent = await self._queue.send(
            principal,
            machine_id,
            agent_id,
            text,
            idempotency_key,
            # Linked to another replica counts as online: it answers itself too.
            check_roster=not self._presence.online(machine_id),
        )
        link = self._live(machine_id)
        # Linked to another replica: that one delivers it (controlplane.cluster).
        if link is None and sent.state == "queued" and sent.entry is not None:
            if await self._presence.route(machine_id, "drain"):
                return SendOutcome(sent.prompt_id, "queued")
        if link is None and self._on_queued is not None and sent.state == "queued":
            # A prompt waits (a retried send too): ask the provider (debounced).
            self._on_queued(sent.account_id, machine_id)
        if sent.entry is None:  # a replayed idempotency key
            if sent.state != "queued":  # acknowledged before: the store's record says how
                return SendOutcome(sent.prompt_id, sent.state, sent.run_id, sent.reason)
            return self._replayed(machine_id, sent.prompt_id)
        if link is None:
            return SendOutcome(sent.prompt_id, "queued")
        waiter = self._waiters.setdefault(
            sent.prompt_id, asyncio.get_running_loop().create_future()
        )
        await self._drain(link)
        try:
            async with asyncio.timeout(self._ack_wait):
                return await asyncio.shield(waiter)
        except TimeoutError:
            return SendOutcome(sent.prompt_id, "delivered")
        finally:
            self._waiters.pop(sent.prompt_id, None)

    def _replayed(self, machine_id: str, prompt_id: str) -> SendOutcome:
        for s in self._recent.get(machine_id, ()):
            if s.prompt_id == prompt_id:
                return SendOutcome(prompt_id, s.state, s.run_id, s.reason)
        link = self._links.get(machine_id)
        if link is not None and prompt_id in link.in_flight:
            return SendOutcome(prompt_id, "delivered")
        return SendOutcome(prompt_id, "queued")

    async def states(self, principal: Principal, machine_id: str) -> list[PromptState]:
        """Queued and in-flight prompts (oldest first), then recent outcomes."""
        entries = await self._queue.queued(principal, machine_id)
        link = self._links.get(machine_id)
        flying = link.in_flight if link is not None else {}
        out = [
            PromptState(
                e.prompt_id,
                e.agent_id,
                e.created_at,
                e.size,
                "delivered" if e.prompt_id in flying else "queued",
            )
            for e in entries
        ]
        listed = {s.prompt_id for s in out}
        out.extend(s for s in self._recent.get(machine_id, ()) if s.prompt_id not in listed)
        return out

    # ------------------------------------------------------------ link side

    def connected(self, session: Session) -> None:
        """The machine's link is up: deliver its queue (in the background)."""
        link = _Link(session, {}, asyncio.Lock(), wait=self._redrain_first)
        self._links[session.machine_id] = link
        if self._on_connected is not None:
            self._on_connected(session.machine_id)
        task = asyncio.create_task(self._drain(link), name=f"drain-{session.machine_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def drain_now(self, machine_id: str) -> bool:
        """Deliver the machine's queue now, when its link is up here (another
        replica queued a prompt for it); False when it is not."""
        link = self._live(machine_id)
        if link is None:
            return False
        task = asyncio.create_task(self._drain(link), name=f"drain-{machine_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def disconnected(self, session: Session) -> None:
        """The link ended: its in-flight prompts go again on the next connect."""
        link = self._links.get(session.machine_id)
        if link is not None and link.session is session:
            del self._links[session.machine_id]

    async def acked(self, session: Session, ack: Ack) -> None:
        """Delete the acknowledged entry (only now, batched with others that come
        meanwhile: controlplane.queue.acks), then show it and tell a waiting send."""
        link = self._links.get(session.machine_id)
        entry = link.in_flight.get(ack.delivery_id) if link is not None else None
        if entry is None or link is None:
            logger.info("machine %s: ack for unknown delivery ignored", session.machine_id)
            return
        # Not awaited: the link reads the next acknowledgement while this one is
        # deleted. It stays in flight until then, so no drain delivers it again.
        deleted = self._acks.add(entry, run_id=ack.run_id, refused=ack.refused)
        deleted.add_done_callback(
            functools.partial(self._deleted, session.machine_id, link, entry, ack)
        )

    def _deleted(
        self,
        machine_id: str,
        link: _Link,
        entry: QueuedPrompt,
        ack: Ack,
        deleted: asyncio.Future[None],
    ) -> None:
        link.in_flight.pop(ack.delivery_id, None)
        if deleted.cancelled():
            return
        if (err := deleted.exception()) is not None:
            # Still queued: the next drain delivers it again and the machine
            # answers the run it already made.
            logger.warning(
                "machine %s: cannot delete acknowledged %s: %s", machine_id, entry.prompt_id, err
            )
            self._drain_later(link)
            return
        state = "refused" if ack.refused else "acknowledged"
        outcome = SendOutcome(entry.prompt_id, state, ack.run_id, ack.refused)
        recent = self._recent.setdefault(machine_id, collections.deque(maxlen=RECENT))
        recent.append(
            PromptState(
                entry.prompt_id,
                entry.agent_id,
                entry.created_at,
                entry.size,
                state,
                ack.run_id,
                ack.refused,
            )
        )
        waiter = self._waiters.get(entry.prompt_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(outcome)

    def _live(self, machine_id: str) -> _Link | None:
        link = self._links.get(machine_id)
        if link is None or self._presence.session(machine_id) is not link.session:
            return None
        return link

    def _drain_later(self, link: _Link) -> None:
        """Drain ``link`` again after its wait (see the module doc), unless one waits already."""
        if self._links.get(link.session.machine_id) is not link:
            return  # the link ended: the next connect drains
        if link.redrain is not None and not link.redrain.done():
            return
        wait, link.wait = link.wait, min(link.wait * 2, self._redrain_max)
        link.redrain = asyncio.create_task(
            self._redrain(link, wait), name=f"redrain-{link.session.machine_id}"
        )
        self._tasks.add(link.redrain)
        link.redrain.add_done_callback(self._tasks.discard)

    async def _redrain(self, link: _Link, wait: float) -> None:
        await asyncio.sleep(wait)  # backoff before the store is asked again
        link.redrain = None  # a failure of this drain schedules the next one
        await self._drain(link)

    async def _drain(self, link: _Link) -> None:
        """Put every queued entry not in flight into the link's outbox, in order;
        drained again later when the store fails (:meth:`_drain_later`).
        Always run as a task of its own (or its redrain's)."""
        set_cause("queue")
        async with link.lock:
            if self._links.get(link.session.machine_id) is not link:
                return  # the link ended meanwhile
            try:
                entries = await self._queue.pending(
                    link.session.account_id,
                    link.session.machine_id,
                    skip={e.seq for e in link.in_flight.values()},
                )
            except AgentsError as err:
                logger.warning(
                    "machine %s: cannot read its queue (drained again later): %s",
                    link.session.machine_id,
                    err,
                )
                self._drain_later(link)
                return
            link.wait = self._redrain_first
            for e in entries:
                if e.prompt_id in link.in_flight:
                    continue
                link.in_flight[e.prompt_id] = e
                link.session.outbox.put_nowait(
                    DeliveryNotice(e.prompt_id, e.agent_id, e.sealed_prompt, e.created_at)
                )

    async def close(self) -> None:
        """Cancel drains in progress (at shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._acks.close()
