"""Crash-consistent multi-object changes: one pattern, an intent record per change.

Every change that writes more than one object (account create, token create,
join with its token use; later the prompt queue, backups, account deletion and
DR) follows the same four steps::

    async with intents.change("token.create", account_id=a, token_id=t):
        ...write the objects, each create-once or compare-and-swap...
    # leaving the block deletes the intent: THE COMMIT POINT

1. **Begin**: ``cp/intents/<int_id>.json`` is created (create-once) naming the
   change's kind and the ids of every object it may write. Nothing is written
   before it, so any object a change wrote is named by an intent until commit.
2. **Write** the objects in any order; each write is idempotent or conditional.
3. **Commit**: delete the intent. The answer goes back to the caller only after
   that, so a change the caller heard succeed is never undone.
4. **Roll back** otherwise: when the block raises, the kind's resolver undoes
   the writes at once (best effort). A crash leaves the intent behind; the next
   control plane resolves it at start and on every self-check tick
   (:meth:`Intents.recover`), and ``agents-control fsck --repair`` does the same.

A resolver is an idempotent async function ``(intent, age_seconds) -> bool``
that undoes whatever part of the change is present (deleting an object only
when it is the one the intent made, giving a token use back only when the
intent took it) and returns True, or returns False to wait (a join whose reply
may have reached the machine waits for the machine to connect, see
:mod:`controlplane.machines.pairing`). The intent is deleted after a True.

A change may also end in "held" state (``hold=True``): the block's success
does not commit; the intent stays until :meth:`Intents.commit` is called by a
later event (a joined machine's first connection), or its resolver rolls it
back. Intents begun by this process and still in flight are never resolved
by :meth:`Intents.recover`, nor one it committed while recover was looking.

The self-check calls :meth:`Intents.recover_if_due` at every tick. What it
costs does not grow with the intents left waiting (a burst of joins holds one
per machine until it connects): an intent record never changes, so each is
read once; one whose resolver said wait is asked again only after
:data:`WAIT_RECHECK` seconds (config ``intent_recheck_seconds``); and intents/
is listed again only when this process began or abandoned one since (it is the
store's only writer: fenced), when a waiting one is due, or every
:data:`QUIET_RECHECK` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

from controlplane.integrity.records import decode, encode, parse_time, utc_iso
from shared.errors import AgentsError, IntegrityError, NotFound
from shared.ids import is_valid_id, new_id, validate_id
from shared.store.base import ObjectStore
from shared.timestamps import Clock, utc_now

__all__ = ["INTENTS_PREFIX", "Intent", "Intents", "Resolver", "intent_key"]

logger = logging.getLogger(__name__)

INTENTS_PREFIX: Final = "cp/intents/"
#: Seconds between two listings of intents/ while none is left (recover_if_due).
QUIET_RECHECK: Final = 300.0
#: Seconds before recover_if_due asks again about an intent its resolver said to
#: wait for (a held join: the machine has join_confirm_grace, 300 s by default,
#: to connect); what it adds to a roll-back's delay.
WAIT_RECHECK: Final = 30.0


def intent_key(intent_id: str) -> str:
    """Key of one intent record."""
    return INTENTS_PREFIX + validate_id("intent", intent_id, "intent_id") + ".json"


@dataclass(frozen=True)
class Intent:
    """One multi-object change in progress."""

    intent_id: str
    kind: str
    started_at: str
    """ISO 8601 UTC."""
    fields: dict[str, str] = field(default_factory=dict)
    """The ids of every object the change may write."""
    owner: str = ""
    """A random token of the process that began it (empty in older records)."""

    def to_dict(self) -> dict[str, Any]:
        """The stored form."""
        return {
            "intent_id": self.intent_id,
            "kind": self.kind,
            "started_at": self.started_at,
            "fields": dict(self.fields),
            "owner": self.owner,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Intent:
        """Inverse of :meth:`to_dict`."""
        raw = data.get("fields") or {}
        return cls(
            intent_id=validate_id("intent", str(data.get("intent_id", "")), "intent_id"),
            kind=str(data.get("kind", "")),
            started_at=str(data.get("started_at", "")),
            fields={str(k): str(v) for k, v in dict(raw).items()},
            owner=str(data.get("owner", "")),
        )


Resolver = Callable[[Intent, float], Awaitable[bool]]


class Intents:
    """The intent records of one deployment; one instance per process."""

    def __init__(
        self,
        store: ObjectStore,
        clock: Clock = utc_now,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        recheck: float = WAIT_RECHECK,
    ) -> None:
        self._store = store
        self._recheck = recheck
        self._clock = clock
        self._monotonic = monotonic
        self._resolvers: dict[str, Resolver] = {}
        # Intents begun by this process (they carry its token) are resolved only
        # once handed over (held, or a failed roll-back): one in flight, or
        # committed between recover's listing and its decision, must never be
        # rolled back behind the change's back. A token, not a time: an earlier
        # process whose clock ran ahead left intents "newer" than this start.
        self._owner = secrets.token_hex(16)
        self._handed_over: set[str] = set()
        self._active: set[str] = set()
        # What recover_if_due needs to skip a listing or a resolver (see the
        # module doc; this process is the store's only writer: fenced): the
        # intents read or begun here (records never change), when each waiting
        # one is asked again, and whether a roll-back was left to recovery since
        # the last listing. An intent begun here needs no listing to be known:
        # it is committed, rolled back (or left, which marks it), or held
        # (then waiting).
        self._listed_at = -float("inf")
        self._read: dict[str, Intent] = {}
        self._recheck_at: dict[str, float] = {}
        self._changed = True
        self._may_resolve: Callable[[str], bool] | None = None

    @property
    def owner(self) -> str:
        """The token this process's intents carry (replicas tell it to each other)."""
        return self._owner

    def share_with(self, may_resolve: Callable[[str], bool]) -> None:
        """Replicas (controlplane.cluster): resolve another process's intent only
        when ``may_resolve(its owner)`` (its owner is gone and we hold the jobs'
        lease); every intent is listed again at the next tick when one goes."""
        self._may_resolve = may_resolve

    def mark_changed(self) -> None:
        """List intents/ again at the next :meth:`recover_if_due` (a replica went)."""
        self._changed = True

    def register(self, kind: str, resolver: Resolver) -> None:
        """Use ``resolver`` to roll back abandoned intents of ``kind``."""
        self._resolvers[kind] = resolver

    async def begin(self, kind: str, **fields: str) -> Intent:
        """Write the intent record (step 1); the caller writes its objects after it."""
        intent = Intent(
            new_id("intent"), kind, utc_iso(self._clock()), dict(fields), owner=self._owner
        )
        self._active.add(intent.intent_id)
        self._read[intent.intent_id] = intent
        try:
            await self._store.put(
                intent_key(intent.intent_id), encode(intent.to_dict()), if_none_match=True
            )
        except BaseException:
            self._active.discard(intent.intent_id)
            self._read.pop(intent.intent_id, None)
            raise
        return intent

    async def commit(self, intent: Intent) -> None:
        """Delete the intent: the change is now final (its commit point)."""
        await self.commit_id(intent.intent_id)

    async def commit_id(self, intent_id: str) -> None:
        """:meth:`commit` by id (for a held change confirmed by a later event)."""
        await self._store.delete(intent_key(intent_id))
        self._active.discard(intent_id)
        self._handed_over.discard(intent_id)
        self._forget(intent_id)

    def _forget(self, intent_id: str) -> None:
        self._read.pop(intent_id, None)
        self._recheck_at.pop(intent_id, None)

    def release(self, intent: Intent) -> None:
        """Stop protecting a held intent in this process (it waits for commit or rollback)."""
        self._active.discard(intent.intent_id)
        self._handed_over.add(intent.intent_id)
        # Just begun, so nothing to roll back yet: asked like one that said wait.
        self._recheck_at[intent.intent_id] = self._monotonic() + self._recheck

    @contextlib.asynccontextmanager
    async def change(
        self, kind: str, *, hold: bool = False, **fields: str
    ) -> AsyncIterator[Intent]:
        """Begin, yield for the writes, then commit (or hold); roll back on an error."""
        intent = await self.begin(kind, **fields)
        try:
            yield intent
        except BaseException:
            await self._abandon(intent)
            raise
        if hold:
            self.release(intent)
        else:
            await self.commit(intent)

    async def _abandon(self, intent: Intent) -> None:
        self._active.discard(intent.intent_id)
        self._changed = True  # a failed roll-back is left to the next listing
        try:
            if not await self._resolve(intent, force=True):
                self._handed_over.add(intent.intent_id)
        except AgentsError as e:
            self._handed_over.add(intent.intent_id)
            # The record stays; recovery finishes the roll-back later.
            logger.warning(
                "%s %s: roll-back left for recovery: %s", intent.kind, intent.intent_id, e
            )

    async def resolve(self, intent: Intent) -> bool:
        """Roll ``intent`` back if its resolver agrees now; True when it is gone."""
        return await self._resolve(intent)

    async def _resolve(self, intent: Intent, *, force: bool = False) -> bool:
        resolver = self._resolvers.get(intent.kind)
        if resolver is None:
            logger.error("intent %s: no resolver for kind %r", intent.intent_id, intent.kind)
            return False
        age = float("inf") if force else self.age(intent)
        if not await resolver(intent, age):
            return False
        await self._store.delete(intent_key(intent.intent_id))
        self._handed_over.discard(intent.intent_id)
        self._forget(intent.intent_id)
        logger.info("%s %s: rolled back", intent.kind, intent.intent_id)
        return True

    def age(self, intent: Intent) -> float:
        """Seconds since the intent began (0 when its time is unreadable)."""
        try:
            return (self._clock() - parse_time(intent.started_at)).total_seconds()
        except ValueError:
            return 0.0

    async def pending(self) -> list[Intent]:
        """Every intent record in the store, oldest first (refused ones are skipped)."""
        out: list[Intent] = []
        listed: set[str] = set()
        started = self._monotonic()
        async for info in self._store.list(INTENTS_PREFIX):
            name = info.key[len(INTENTS_PREFIX) :].removesuffix(".json")
            if not is_valid_id("intent", name):
                continue
            listed.add(name)
            known = self._read.get(name)
            if known is not None:
                out.append(known)
                continue
            try:
                intent = Intent.from_dict(decode(await self._store.get(info.key), info.key))
            except (NotFound, IntegrityError):
                continue  # committed meanwhile, or not ours (counted by the store)
            self._read[name] = intent
            out.append(intent)
        # Removed by hand (this process removes its own itself); begun here while
        # the listing ran is not gone.
        for gone in set(self._read) - listed - self._active - self._handed_over:
            self._forget(gone)
        # Held here, released long before this listing began (its recheck was due),
        # and not listed: committed elsewhere (a replica the machine linked to
        # confirmed its join). Kept, it stayed due and intents/ was listed every tick.
        for gone in self._handed_over - listed:
            if self._recheck_at.get(gone, float("inf")) <= started:
                self._handed_over.discard(gone)
                self._forget(gone)
        for stale in set(self._recheck_at) - set(self._read):
            del self._recheck_at[stale]
        return out

    async def recover(self) -> int:
        """Roll back every abandoned intent whose resolver agrees; return how many."""
        return await self._recover(due_only=False)

    async def _recover(self, *, due_only: bool) -> int:
        done = left = 0
        listed_at = self._monotonic()
        self._changed = False  # a change during the listing marks it again
        for intent in await self.pending():
            if self._mine(intent) and intent.intent_id not in self._handed_over:
                left += 1
                continue
            if (
                not self._mine(intent)
                and self._may_resolve is not None
                and not self._may_resolve(intent.owner)
            ):
                left += 1  # a live replica's, or ours to leave to the lease holder
                continue
            if due_only and self._recheck_at.get(intent.intent_id, 0.0) > listed_at:
                left += 1
                continue
            if await self._resolve(intent):
                done += 1
            else:
                left += 1
                # Unless it was committed while its resolver ran (a machine connected):
                # a recheck of nothing would be due for ever, a listing every tick.
                if intent.intent_id in self._read:
                    self._recheck_at[intent.intent_id] = self._monotonic() + self._recheck
        self._listed_at = listed_at
        return done

    async def recover_if_due(self, every: float = QUIET_RECHECK) -> int:
        """:meth:`recover` when something may have changed (see the module doc):
        a roll-back was left to recovery since the last listing, or a waiting
        intent is due to be asked again; else at most every ``every`` seconds
        (the periodic self-check of an idle control plane, or of one with a
        thousand joins waiting for their machines, lists ``intents/`` a few
        times an hour, not at every tick)."""
        now = self._monotonic()
        # Else what the last listing left are intents in flight here (they end
        # by themselves, marking a failed roll-back) and waiting ones.
        due = min(self._recheck_at.values(), default=float("inf"))
        if not self._changed and now - self._listed_at < every and now < due:
            return 0
        return await self._recover(due_only=True)

    def _mine(self, intent: Intent) -> bool:
        """Begun by this process."""
        return intent.intent_id in self._active or (
            bool(intent.owner) and secrets.compare_digest(intent.owner, self._owner)
        )
