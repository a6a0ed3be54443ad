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

    def __init__(self, store: ObjectStore, clock: Clock = utc_now) -> None:
        self._store = store
        self._clock = clock
        self._resolvers: dict[str, Resolver] = {}
        # Intents begun by this process (they carry its token) are resolved only
        # once handed over (held, or a failed roll-back): one in flight, or
        # committed between recover's listing and its decision, must never be
        # rolled back behind the change's back. A token, not a time: an earlier
        # process whose clock ran ahead left intents "newer" than this start.
        self._owner = secrets.token_hex(16)
        self._handed_over: set[str] = set()
        self._active: set[str] = set()
        # True once a recover() left no intent in the store and none was begun
        # since: the self-check then lists intents/ only every QUIET_RECHECK
        # seconds (this process is the store's only writer: fenced).
        self._quiet = False
        self._listed_at = 0.0

    def register(self, kind: str, resolver: Resolver) -> None:
        """Use ``resolver`` to roll back abandoned intents of ``kind``."""
        self._resolvers[kind] = resolver

    async def begin(self, kind: str, **fields: str) -> Intent:
        """Write the intent record (step 1); the caller writes its objects after it."""
        intent = Intent(
            new_id("intent"), kind, utc_iso(self._clock()), dict(fields), owner=self._owner
        )
        self._active.add(intent.intent_id)
        self._quiet = False
        try:
            await self._store.put(
                intent_key(intent.intent_id), encode(intent.to_dict()), if_none_match=True
            )
        except BaseException:
            self._active.discard(intent.intent_id)
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

    def release(self, intent: Intent) -> None:
        """Stop protecting a held intent in this process (it waits for commit or rollback)."""
        self._active.discard(intent.intent_id)
        self._handed_over.add(intent.intent_id)

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
        async for info in self._store.list(INTENTS_PREFIX):
            name = info.key[len(INTENTS_PREFIX) :].removesuffix(".json")
            if not is_valid_id("intent", name):
                continue
            try:
                out.append(Intent.from_dict(decode(await self._store.get(info.key), info.key)))
            except (NotFound, IntegrityError):
                continue  # committed meanwhile, or not ours (counted by the store)
        return out

    async def recover(self) -> int:
        """Roll back every abandoned intent whose resolver agrees; return how many."""
        done = left = 0
        listed_at = time.monotonic()
        for intent in await self.pending():
            if self._mine(intent) and intent.intent_id not in self._handed_over:
                left += 1
                continue
            if await self._resolve(intent):
                done += 1
            else:
                left += 1
        self._listed_at = listed_at
        self._quiet = left == 0 and not self._active
        return done

    async def recover_if_due(self, every: float = QUIET_RECHECK) -> int:
        """:meth:`recover`, unless the last one left nothing and this process began
        no intent since: then at most every ``every`` seconds (the periodic
        self-check of an idle control plane lists ``intents/`` a few times an
        hour, not at every tick)."""
        if self._quiet and time.monotonic() - self._listed_at < every:
            return 0
        return await self.recover()

    def _mine(self, intent: Intent) -> bool:
        """Begun by this process."""
        return intent.intent_id in self._active or (
            bool(intent.owner) and secrets.compare_digest(intent.owner, self._owner)
        )
