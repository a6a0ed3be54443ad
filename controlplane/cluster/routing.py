"""Routing: notices for a machine linked to another replica, over NATS subjects.

The replica holding a machine's link subscribes to
``agents.<deployment>.machine.<id>.notice`` while it is up (:meth:`Router.take`,
:meth:`Router.drop`); a notice for it is a request on that subject, answered
``ok`` by the holder once the notice is in the link's outbox (revoke,
renew-now, drain its prompt queue). A replica whose link to the machine is
stale (the machine has linked to another since, as presence shows) does not
answer, so the live link's replica does. No responder means no replica holds it now:
its next link gets what the store says. Account deletions go to every replica
on ``agents.<deployment>.account.deleted``. Without NATS a route is refused
with TransientError (UNAVAILABLE) naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Final

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.errors import AgentsError, TransientError

__all__ = ["REQUEST_TIMEOUT", "NoticeHandler", "Router"]

logger = logging.getLogger(__name__)

#: Seconds a routed notice waits for the holding replica's answer.
REQUEST_TIMEOUT: Final = 3.0

#: ``handler(machine_id, kind, fields)``: deliver a routed notice to a local link;
#: False when the machine has none here.
NoticeHandler = Callable[[str, str, dict[str, str]], Awaitable[bool]]


class Router:
    """This replica's end of the notice subjects (module doc)."""

    def __init__(
        self,
        name: str,
        where: str,
        *,
        on_notice: NoticeHandler,
        on_account_deleted: Callable[[str], object],
        on_routed: Callable[[str], None] | None = None,
        holds: Callable[[str], bool],
    ) -> None:
        self._root = f"agents.{name}"
        self._where = where
        self._on_notice = on_notice
        self._on_account_deleted = on_account_deleted
        self._on_routed = on_routed
        # Whether another replica holds a machine (presence): route_later's test.
        self._holds = holds
        self._nc: Client | None = None
        self._subs: dict[str, Subscription] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def unavailable(self, what: str) -> TransientError:
        """The refusal of a call that needs NATS while it is unreachable."""
        return TransientError(f"{what}: NATS at {self._where} is unreachable (replicas)")

    def _subject(self, machine_id: str) -> str:
        return f"{self._root}.machine.{machine_id}.notice"

    def _connected(self) -> Client | None:
        nc = self._nc
        return nc if nc is not None and nc.is_connected else None

    async def start(self, nc: Client) -> None:
        """Listen for account deletions on ``nc``."""
        self._nc = nc
        await nc.subscribe(f"{self._root}.account.deleted", cb=self._account_deleted)

    async def close(self) -> None:
        """Cancel the notices still being sent in the background."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._nc = None

    async def take(self, machine_id: str) -> None:
        """The machine's link is up here: answer its notices."""
        if self._nc is not None and machine_id not in self._subs:
            self._subs[machine_id] = await self._nc.subscribe(
                self._subject(machine_id), cb=self._notice
            )

    async def drop(self, machine_id: str) -> None:
        """Its link ended here: stop answering (also while NATS is away: the
        client forgets it now and tells the server when it is back)."""
        sub = self._subs.pop(machine_id, None)
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def route(self, machine_id: str, kind: str, **fields: str) -> bool:
        """Ask the replica holding ``machine_id`` to deliver a notice; whether one
        did (False: no replica holds it now). TransientError naming NATS when
        NATS cannot be reached or the holder does not answer."""
        nc = self._connected()
        if nc is None:
            self._count("unavailable")
            raise self.unavailable(f"machine {machine_id}: {kind}")
        payload = json.dumps({"kind": kind, **fields}).encode()
        try:
            reply = await nc.request(self._subject(machine_id), payload, timeout=REQUEST_TIMEOUT)
        except nats.errors.NoRespondersError:
            self._count("not_linked")
            return False
        except (nats.errors.Error, OSError) as e:
            self._count("unavailable")
            raise TransientError(
                f"machine {machine_id}: {kind}: the replica holding its link did not answer "
                f"over NATS at {self._where}: {str(e) or type(e).__name__}"
            ) from None
        done = reply.data == b"ok"
        self._count("delivered" if done else "not_linked")
        return done

    def route_later(self, machine_id: str, kind: str, **fields: str) -> bool:
        """:meth:`route` in the background for a caller that cannot wait (a sync
        hook); True when another replica holds the machine (as presence says)."""
        if not self._holds(machine_id):
            return False
        self._spawn(self._route_logged(machine_id, kind, fields))
        return True

    def announce_account_deleted(self, account_id: str) -> None:
        """Tell every replica to close the account's links, in the background (best
        effort: a link missed is refused at its next connect, its account gone)."""
        self._spawn(self._publish_deleted(account_id))

    def _spawn(self, work: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _count(self, outcome: str) -> None:
        if self._on_routed is not None:
            self._on_routed(outcome)

    async def _route_logged(self, machine_id: str, kind: str, fields: dict[str, str]) -> None:
        try:
            await self.route(machine_id, kind, **fields)
        except AgentsError as e:
            logger.warning("%s", e)

    async def _publish_deleted(self, account_id: str) -> None:
        nc = self._connected()
        if nc is None:
            logger.warning("account %s: %s", account_id, self.unavailable("closing links"))
            return
        with contextlib.suppress(nats.errors.Error, OSError):
            await nc.publish(f"{self._root}.account.deleted", account_id.encode())

    async def _notice(self, msg: Msg) -> None:
        machine_id = msg.subject.split(".")[-2]
        if self._holds(machine_id):
            # The machine linked to another replica since (its link here is dead
            # and not timed out yet): stay silent so that replica's answer is the one.
            return
        try:
            data = json.loads(msg.data)
            kind = str(data.pop("kind"))
            fields = {str(k): str(v) for k, v in data.items()}
        except (ValueError, KeyError, AttributeError, TypeError):
            await msg.respond(b"bad")
            return
        done = await self._on_notice(machine_id, kind, fields)
        await msg.respond(b"ok" if done else b"not_linked")

    async def _account_deleted(self, msg: Msg) -> None:
        self._on_account_deleted(msg.data.decode(errors="replace"))
