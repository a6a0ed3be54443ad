"""Join tokens: short-lived, limited-use, stored as a hash, consumed with CAS.

A token's uses are counted twice: in its record (``uses``, compare-and-swap:
concurrent joins take one use each) and by create-only markers, one per use
taken (``accounts/<a>/token-uses/<tok>/<intent>``). A bucket writer can put the
record back at an older use count (the MAC cannot tell an older genuine
version), but cannot take a marker away without delete rights, so a token is
usable only while both counts allow it. A marker is made before the record's
use is taken (killed between: the token counts as used, failing closed) and
removed after a rolled-back join gave its use back.

A token's record is updated by one writer at a time in this process (a lock per
token): a fleet joining with one token would otherwise lose most of its
compare-and-swap rounds to each other and give up (``too much contention``).
The compare-and-swap still guards the record against any other writer. Joins
waiting for that lock take their uses together: one update of the record takes
a use for each of them in turn (each checked as if alone: a join past the last
use is refused, the others go on), so a fleet's joins are not serialised on
one record write each (:meth:`TokenService._take_uses`).

The markers are listed at each use (:meth:`TokenService._uses_taken`): every
replica of a deployment writes them, so a count kept by one process would miss
another's and let a token put back at an older use count be used again.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from controlplane.access.accounts import AccountService
from controlplane.access.hashing import hash_secret, new_secret, split_bearer, verify_secret
from controlplane.access.principals import Principal
from controlplane.config import MAX_TOKEN_TTL
from controlplane.integrity import jsonstore
from controlplane.integrity.audit import Auditor
from controlplane.integrity.intents import Intent, Intents
from controlplane.integrity.records import (
    JoinToken,
    Machine,
    token_index_key,
    token_key,
    token_use_key,
    token_uses_prefix,
    tokens_prefix,
    utc_iso,
)
from controlplane.integrity.replays import ReplayLog
from shared.errors import (
    IntegrityError,
    InvalidArgument,
    InvalidState,
    NotFound,
    TransientError,
    Unauthenticated,
)
from shared.ids import new_id, validate_id
from shared.store.base import ObjectStore
from shared.timestamps import Clock, utc_now

__all__ = ["MAX_USES", "NewToken", "TokenService"]

logger = logging.getLogger(__name__)

#: The most joins one token may allow.
MAX_USES: Final = 1000
_PURPOSE: Final = "token"
_CREATE: Final = "token.create"


@dataclass(frozen=True)
class NewToken:
    """A token just made: its record and the value shown once."""

    token: JoinToken
    value: str
    """``tok_<id>.<secret>``; never stored."""


_BAD_TOKEN = "join: unknown token or wrong secret"


class TokenService:
    """Join tokens of every account."""

    def __init__(
        self,
        store: ObjectStore,
        accounts: AccountService,
        auditor: Auditor,
        *,
        default_ttl: int = 3600,
        clock: Clock = utc_now,
        intents: Intents | None = None,
        replays: ReplayLog | None = None,
        validity_clock: Clock | None = None,
    ) -> None:
        self._store = store
        # What a token's expiry is judged by: the later of our clock and the
        # store's (integrity.clock), so a clock behind never stretches a token.
        self._validity_clock = validity_clock or clock
        self._replays = replays if replays is not None else ReplayLog()
        self._accounts = accounts
        self._audit = auditor
        self._default_ttl = default_ttl
        self._clock = clock
        self._intents = intents if intents is not None else Intents(store, clock)
        self._intents.register(_CREATE, self._roll_back_create)
        # One lock per token in use (see the module doc); gone with its last user.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        # The uses waiting to be taken together, by token (see _take_uses).
        self._waiting: dict[str, list[_Use]] = {}

    def _lock(self, token_id: str) -> asyncio.Lock:
        lock = self._locks.get(token_id)
        if lock is None:
            lock = self._locks[token_id] = asyncio.Lock()
        return lock

    async def _update(
        self,
        account_id: str,
        token_id: str,
        change: Callable[[dict[str, Any]], dict[str, Any] | None],
    ) -> dict[str, Any]:
        """:func:`jsonstore.update` of the token's record, one writer at a time."""
        async with self._lock(token_id):
            return await jsonstore.update(self._store, token_key(account_id, token_id), change)

    async def _take_uses(self, token: JoinToken, intent_id: str) -> JoinToken:
        """Take one use of ``token`` for ``intent_id`` (compare-and-swap), with every
        other use of it waiting meanwhile (module doc): the token as this use left
        it, or Unauthenticated when it could not be taken."""
        use = _Use(intent_id, asyncio.get_running_loop().create_future())
        self._waiting.setdefault(token.token_id, []).append(use)
        try:
            async with self._lock(token.token_id):
                waiting = self._waiting.pop(token.token_id, [])
                if waiting:  # else an earlier holder took this use with its own
                    await self._update_for(token, waiting, use)
            outcome = await use.result
        except asyncio.CancelledError:
            # Not taken yet: nobody takes it now (taken already, it is as a
            # cancelled lone join's: the join's intent gives it back).
            pending = self._waiting.get(token.token_id, [])
            if use in pending:
                pending.remove(use)
            raise
        if isinstance(outcome, Unauthenticated):
            raise outcome
        return outcome

    async def _update_for(self, token: JoinToken, waiting: list[_Use], mine: _Use) -> None:
        """One update of the record taking ``waiting``'s uses; each told its outcome."""
        try:
            await jsonstore.update(
                self._store,
                token_key(token.account_id, token.token_id),
                lambda d: self._each_use(d, waiting),
            )
        except BaseException as e:
            for other in waiting:
                if other is not mine and not other.result.done():
                    other.result.set_exception(_for_others(e))
            raise
        for other in waiting:
            if not other.result.done():
                if other.outcome is None:  # never so: every waiting use is looked at
                    other.result.set_exception(TransientError("join: token use not taken"))
                else:
                    other.result.set_result(other.outcome)

    def _each_use(self, d: dict[str, Any], waiting: list[_Use]) -> dict[str, Any] | None:
        """The record with one use taken for each waiting join that may take one,
        in turn; each one's outcome noted (recomputed on every CAS attempt)."""
        taken = 0
        for use in waiting:
            try:
                # As each join alone would: one that finds it used up takes nothing.
                self._check_usable(JoinToken.from_dict(d))
            except Unauthenticated as e:
                use.outcome = e
                continue
            used_by = [*d.get("used_by", [])]
            if use.intent_id:
                used_by.append(use.intent_id)
            d = {**d, "uses": int(d.get("uses", 0)) + 1, "used_by": used_by}
            use.outcome = JoinToken.from_dict(d)
            taken += 1
        return d if taken else None

    async def create(
        self,
        principal: Principal,
        account_id: str,
        ttl_seconds: int = 0,
        max_uses: int = 0,
        *,
        repair_machine_id: str = "",
    ) -> NewToken:
        """Make a token for ``account_id``: TTL default from config, at most 24 h.

        ``ttl_seconds=0`` means the configured default and ``max_uses=0`` means
        one use: proto3 cannot tell an unset field from 0, so 0 is "not given".
        Negative values raise InvalidArgument naming the field.
        """
        validate_id("account", account_id, "account_id")
        principal.visible_account(account_id, "account", account_id)
        if ttl_seconds < 0:
            raise InvalidArgument("ttl_seconds", "must not be negative (0 means the default)")
        if max_uses < 0:
            raise InvalidArgument("max_uses", "must not be negative (0 means one use)")
        ttl = ttl_seconds if ttl_seconds > 0 else self._default_ttl
        if not 1 <= ttl <= MAX_TOKEN_TTL:
            raise InvalidArgument("ttl_seconds", f"must be between 1 and {MAX_TOKEN_TTL} seconds")
        uses = max_uses if max_uses > 0 else 1
        if not 1 <= uses <= MAX_USES:
            raise InvalidArgument("max_uses", f"must be between 1 and {MAX_USES}")
        try:
            await self._accounts.get(account_id)
        except NotFound:
            raise NotFound("account", account_id) from None
        await self._accounts.require_active(account_id, "token create")
        now = self._clock()
        token_id = new_id("token")
        secret = new_secret()
        token = JoinToken(
            token_id=token_id,
            account_id=account_id,
            secret_hash=hash_secret(_PURPOSE, token_id, secret),
            created_at=now,
            expires_at=now + dt.timedelta(seconds=ttl),
            max_uses=uses,
            created_by=principal.credential_id,
            repair_machine_id=repair_machine_id,
        )
        # Index and record under one intent (controlplane.integrity.intents); deleting it is the
        # commit point, and the value is shown only after it.
        async with self._intents.change(_CREATE, account_id=account_id, token_id=token_id):
            await jsonstore.create(
                self._store, token_index_key(token_id), {"account_id": account_id}
            )
            await jsonstore.create(self._store, token_key(account_id, token_id), token.to_dict())
        await self._audit.record(principal.credential_id, "token.create", token_id, account_id)
        return NewToken(token, f"{token_id}.{secret}")

    async def create_repair(
        self, principal: Principal, machine: Machine, ttl_seconds: int = 0
    ) -> NewToken:
        """A one-use token that re-pairs ``machine`` (already checked visible to
        ``principal``): the box that joins with it takes over the machine's id and
        the machine's old certificate is refused from then on (controlplane.machines.pairing)."""
        if machine.revoked:
            raise InvalidState(
                "machine repair", f"machine {machine.machine_id} is revoked; join a new machine"
            )
        return await self.create(
            principal, machine.account_id, ttl_seconds, 1, repair_machine_id=machine.machine_id
        )

    async def _roll_back_create(self, intent: Intent, age: float) -> bool:
        """Undo a token create that never committed: the record, then its index entry."""
        acct = validate_id("account", intent.fields.get("account_id", ""), "account_id")
        tok = validate_id("token", intent.fields.get("token_id", ""), "token_id")
        await self._store.delete(token_key(acct, tok))
        await self._store.delete(token_index_key(tok))
        return True

    async def _owner(self, token_id: str) -> str:
        data = await jsonstore.read(self._store, token_index_key(token_id))
        return validate_id("account", str(data.get("account_id", "")), "account_id")

    async def get(self, principal: Principal, token_id: str) -> JoinToken:
        """One token; NotFound when missing or not visible to ``principal``."""
        validate_id("token", token_id, "token_id")
        try:
            account_id = await self._owner(token_id)
            principal.visible_account(account_id, "token", token_id)
            data = await jsonstore.read(self._store, token_key(account_id, token_id))
        except NotFound:
            raise NotFound("token", token_id) from None
        return JoinToken.from_dict(data)

    async def list(self, principal: Principal, account_id: str = "") -> list[JoinToken]:
        """Tokens of one account, or of every account for the operator; oldest first."""
        out: list[JoinToken] = []
        for acct in await self._accounts.scope_ids(principal, account_id):
            records = await jsonstore.read_all(self._store, tokens_prefix(acct), "token")
            out.extend(JoinToken.from_dict(d) for d in records)
        return out

    async def revoke(self, principal: Principal, token_id: str) -> JoinToken:
        """Revoke a token (idempotent)."""
        token = await self.get(principal, token_id)

        def change(d: dict[str, Any]) -> dict[str, Any] | None:
            if d.get("revoked"):
                return None
            return {**d, "revoked": True}

        data = await self._update(token.account_id, token_id, change)
        await self._audit.record(
            principal.credential_id, "token.revoke", token_id, token.account_id
        )
        return JoinToken.from_dict(data)

    async def consume(self, value: str, intent_id: str = "") -> JoinToken:
        """:meth:`check` a presented token, then :meth:`use` it once."""
        return await self.use(await self.check(value), intent_id)

    async def check(self, value: str) -> JoinToken:
        """The token ``value`` names, if its secret matches and it may be used (reads only).

        Raises Unauthenticated ("join: token expired", ...) or PermissionDenied
        when the account is deleted or being deleted. Never echoes the secret.
        """
        try:
            token_id, secret = split_bearer(value, "token", "token")
        except InvalidArgument:
            raise Unauthenticated("join: malformed token (want tok_<id>.<secret>)") from None
        try:
            account_id = await self._owner(token_id)
            key = token_key(account_id, token_id)
            token = JoinToken.from_dict(await jsonstore.read(self._store, key))
        except (NotFound, IntegrityError):
            # A refused (forged) record answers like a missing one: it grants nothing.
            raise Unauthenticated(_BAD_TOKEN) from None
        if token.account_id != account_id or token.token_id != token_id:
            raise Unauthenticated(_BAD_TOKEN)
        if not verify_secret(_PURPOSE, token_id, secret, token.secret_hash):
            # Same words as an unknown id: the answer must not tell which ids exist.
            raise Unauthenticated(_BAD_TOKEN)
        self._check_usable(token)
        taken = await self._uses_taken(token)
        if taken >= token.max_uses:
            # The record allows a use its markers say was taken: an older copy
            # put back (or a join killed between its marker and its record).
            self._replays.report(
                "token",
                f"token {token_id}: its record says {token.uses} use(s) of {token.max_uses}, "
                f"its use markers {taken}: refused as used",
            )
            raise Unauthenticated("join: token already used")
        await self._accounts.require_active(account_id, "join")
        return token

    async def _uses_taken(self, token: JoinToken) -> int:
        """How many use markers the token has (see the module doc)."""
        prefix = token_uses_prefix(token.account_id, token.token_id)
        return sum([len(page) async for page in self._store.list_pages(prefix)])

    async def _mark_use(self, token: JoinToken, use_id: str) -> None:
        # False when it exists: made by an earlier try of this same join, one use still.
        marker = {"token_id": token.token_id, "use": use_id, "at": utc_iso(self._clock())}
        await jsonstore.create(
            self._store, token_use_key(token.account_id, token.token_id, use_id), marker
        )

    async def use(self, token: JoinToken, intent_id: str = "") -> JoinToken:
        """Take one use (compare-and-swap); ``intent_id`` names the join taking it, so a
        rolled-back join can give it back (:meth:`give_back`). Its marker first."""
        use_id = intent_id or new_id("intent")
        await self._mark_use(token, use_id)
        try:
            used = await self._take_uses(token, intent_id)
        except Unauthenticated:
            # Used up by a concurrent join meanwhile: this one took nothing.
            await self._store.delete(token_use_key(token.account_id, token.token_id, use_id))
            raise
        await self._audit.record(token.token_id, "token.use", token.token_id, token.account_id)
        return used

    async def give_back(self, account_id: str, token_id: str, intent_id: str) -> None:
        """Return the use ``intent_id`` took, if it took one (idempotent)."""

        def change(d: dict[str, Any]) -> dict[str, Any] | None:
            used_by = [*d.get("used_by", [])]
            if intent_id not in used_by:
                return None
            used_by.remove(intent_id)
            return {**d, "uses": max(0, int(d.get("uses", 0)) - 1), "used_by": used_by}

        try:
            await self._update(account_id, token_id, change)
        except NotFound:
            return  # the token itself is gone: nothing to give back
        # After the record: killed between, the marker stays and the use counts
        # (closed); a later give_back (idempotent) removes it.
        await self._store.delete(token_use_key(account_id, token_id, intent_id))

    async def take_again(self, account_id: str, token_id: str, intent_id: str) -> None:
        """Count the use ``intent_id`` took again if it was given back (idempotent).

        A box that connects with the certificate of a join whose use was given
        back (a repair rolled back after its grace: its record stays) holds the
        machine: the token must not take it over a second time.
        """

        def change(d: dict[str, Any]) -> dict[str, Any] | None:
            used_by = [*d.get("used_by", [])]
            if intent_id in used_by:
                return None  # the use still counts (the usual case)
            return {**d, "uses": int(d.get("uses", 0)) + 1, "used_by": [*used_by, intent_id]}

        key = token_key(account_id, token_id)
        try:
            # Read first: every join's confirmation gets here, and the use almost
            # always still counts; its marker then exists too (a give-back takes
            # the use out of the record before it deletes the marker), so neither
            # needs a write.
            if intent_id in (await jsonstore.read(self._store, key)).get("used_by", []):
                return
            # Its marker first (still there when the use was never given back).
            marker = {"token_id": token_id, "use": intent_id, "at": utc_iso(self._clock())}
            await jsonstore.create(
                self._store, token_use_key(account_id, token_id, intent_id), marker
            )
            await self._update(account_id, token_id, change)
        except NotFound:
            return  # the token itself is gone: nobody can use it again
        except IntegrityError as e:  # a forged record: the token is refused anyway
            logger.error("token %s: cannot count its use again: %s", token_id, e)

    def _check_usable(self, token: JoinToken) -> None:
        state = token.state(self._validity_clock())
        if state == "revoked":
            raise Unauthenticated("join: token revoked")
        if state == "used":
            raise Unauthenticated("join: token already used")
        if state == "expired":
            raise Unauthenticated("join: token expired")


@dataclass
class _Use:
    """One join's use of a token, waiting to be taken with the others'."""

    intent_id: str
    result: asyncio.Future[JoinToken | Unauthenticated]
    outcome: JoinToken | Unauthenticated | None = None
    """What the last attempt of the update made of it (set by ``_each_use``)."""


def _for_others(e: BaseException) -> BaseException:
    """What the other waiters of a failed update are told: the same error (one
    object raised by each; an exception cannot always be copied: most of ours take
    other arguments than their message), or, when the update's runner was
    cancelled, an unavailable store, for them to try again."""
    if isinstance(e, asyncio.CancelledError):
        return TransientError("join: the token's update was interrupted; try again")
    return e
