"""Accounts: create (one per GitHub user), read, list, and their deletion state."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from controlplane.integrity import jsonstore
from controlplane.integrity.audit import Auditor
from controlplane.integrity.intents import Intent, Intents
from controlplane.integrity.records import (
    ACCOUNT_INDEX_PREFIX,
    Account,
    account_from_dict,
    account_index_key,
    account_key,
    account_to_dict,
    deleted_key,
    deleting_key,
    github_index_key,
)
from controlplane.integrity.replays import ReplayLog
from shared.crypto import BoxKeyPair
from shared.errors import (
    AlreadyExists,
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from shared.ids import is_valid_id, new_id, validate_id
from shared.store.base import ObjectStore
from shared.timestamps import Clock, utc_now

if TYPE_CHECKING:  # authz imports this module
    from controlplane.access.principals import Principal

__all__ = ["AccountService", "CreatedAccount", "validate_github_login"]

logger = logging.getLogger(__name__)

# GitHub's own rule: 1..39 alphanumerics or single hyphens, not at either end.
_LOGIN_RE: Final = re.compile(r"\A[A-Za-z0-9](?:[A-Za-z0-9]|-(?=[A-Za-z0-9])){0,38}\Z")
_MAX_GITHUB_ID: Final = 2**53
_CREATE: Final = "account.create"


def validate_github_login(login: str) -> str:
    """Return ``login`` if it is a valid GitHub login, else raise InvalidArgument."""
    if not isinstance(login, str) or not _LOGIN_RE.match(login):
        raise InvalidArgument("github_login", "must be 1-39 letters, digits or single hyphens")
    return login


@dataclass(frozen=True)
class CreatedAccount:
    """A new account, and the recovery private key when the server generated it."""

    account: Account
    recovery_private_key: bytes | None
    """Shown once to the operator; never stored."""


class AccountService:
    """Accounts in the store. Visibility checks are the caller's (see authz)."""

    def __init__(
        self,
        store: ObjectStore,
        auditor: Auditor,
        clock: Clock = utc_now,
        intents: Intents | None = None,
        replays: ReplayLog | None = None,
    ) -> None:
        self._store = store
        self._audit = auditor
        self._clock = clock
        self._replays = replays if replays is not None else ReplayLog()
        self._intents = intents if intents is not None else Intents(store, clock)
        self._intents.register(_CREATE, self._roll_back_create)

    async def create(
        self,
        github_user_id: int,
        github_login: str,
        recovery_public_key: bytes | None,
        actor: str,
    ) -> CreatedAccount:
        """Create an account; AlreadyExists if the GitHub user already has one."""
        if not isinstance(github_user_id, int) or not 0 < github_user_id < _MAX_GITHUB_ID:
            raise InvalidArgument("github_user_id", "must be a positive integer")
        validate_github_login(github_login)
        private: bytes | None = None
        if recovery_public_key:
            if len(recovery_public_key) != 32:
                raise InvalidArgument("recovery_public_key", "must be 32 bytes (X25519)")
            public = bytes(recovery_public_key)
        else:
            pair = BoxKeyPair.generate()
            public, private = pair.public_key, pair.private_key
        account = Account(
            account_id=new_id("account"),
            github_user_id=github_user_id,
            github_login=github_login,
            signed_up_at=self._clock(),
            recovery_public_key=public,
        )
        acct = account.account_id
        # Three objects, one intent (controlplane.integrity.intents): a crash anywhere below
        # is rolled back, so no GitHub id stays claimed by an account nobody sees.
        async with self._intents.change(
            _CREATE, account_id=acct, github_user_id=str(github_user_id)
        ):
            # Claim the GitHub id first: two concurrent creates for one user make one account.
            index = github_index_key(github_user_id)
            if not await jsonstore.create(self._store, index, {"account_id": acct}):
                raise AlreadyExists("account for github user", str(github_user_id))
            await jsonstore.create(self._store, account_key(acct), account_to_dict(account))
            await jsonstore.create(self._store, account_index_key(acct), {})
        # Commit point passed (the intent is deleted): the account exists.
        await self._audit.record(actor, "account.create", account.account_id, account.account_id)
        logger.info("account %s created", account.account_id)
        return CreatedAccount(account, private)

    async def _roll_back_create(self, intent: Intent, age: float) -> bool:
        """Undo an account create that never committed: hide it, then free its GitHub id."""
        acct = validate_id("account", intent.fields.get("account_id", ""), "account_id")
        await self._store.delete(account_index_key(acct))
        await self._store.delete(account_key(acct))
        gid = int(intent.fields.get("github_user_id", "0") or 0)
        if gid > 0:
            key = github_index_key(gid)
            try:
                claimed = (await jsonstore.read(self._store, key)).get("account_id")
            except (NotFound, IntegrityError):
                claimed = None
            # Only our own claim: a lost race's claim belongs to the winner.
            if claimed == acct:
                await self._store.delete(key)
        return True

    async def get(self, account_id: str) -> Account:
        """The account; NotFound if missing. ``state`` is "deleting" under a tombstone."""
        validate_id("account", account_id, "account_id")
        try:
            data = await jsonstore.read(self._store, account_key(account_id))
        except (NotFound, IntegrityError):
            # A refused (forged) record is no account (the store counted it).
            raise NotFound("account", account_id) from None
        if data.get("account_id") != account_id:
            raise NotFound("account", account_id)
        # The tombstone before deleted/<a>: a deletion writes deleted/<a> before it
        # removes the tombstone, so one that finishes between the two reads is
        # seen as deleting or deleted. Read the other way round, it could be
        # seen as neither (active) by a join that then registers into it.
        deleting = await self.is_deleting(account_id)
        if await self.was_deleted(account_id):
            # An account's record after its deletion finished is an older copy put
            # back (write access can replay it, not remove deleted/<a>): it is gone.
            self._replays.report(
                "account", f"account {account_id}: a record after its deletion finished: ignored"
            )
            raise NotFound("account", account_id)
        return account_from_dict(data, "deleting" if deleting else "active")

    async def is_deleting(self, account_id: str) -> bool:
        """Whether the account carries a deletion tombstone."""
        try:
            # Read, not head: only an authentic tombstone counts (see integrity).
            await self._store.get(deleting_key(account_id))
        except (NotFound, IntegrityError):
            return False  # a forged tombstone is ignored (and counted by the store)
        return True

    async def was_deleted(self, account_id: str) -> bool:
        """Whether the account existed and its deletion has finished."""
        try:
            await self._store.get(deleted_key(account_id))
        except (NotFound, IntegrityError):
            return False
        return True

    async def require_active(self, account_id: str, what: str) -> Account:
        """The account, or PermissionDenied when it is missing or being deleted."""
        try:
            account = await self.get(account_id)
        except NotFound:
            raise PermissionDenied(f"{what}: account does not exist") from None
        if account.state != "active":
            raise PermissionDenied(f"{what}: account is being deleted")
        return account

    async def scope_ids(self, principal: Principal, account_id: str = "") -> list[str]:
        """The account ids a listing by ``principal`` covers.

        ``account_id`` alone when given (and visible), else every account for
        the operator, else the principal's own account.
        """
        scope = principal.listing_scope(account_id)
        if scope is not None:
            return [scope]
        return [a.account_id for a in await self.list()]

    async def list(self) -> list[Account]:
        """Every account, oldest first (ids sort by creation time)."""
        out: list[Account] = []
        async for info in self._store.list(ACCOUNT_INDEX_PREFIX):
            name = info.key[len(ACCOUNT_INDEX_PREFIX) :].removesuffix(".json")
            if not is_valid_id("account", name):
                continue
            try:
                out.append(await self.get(name))
            except (NotFound, IntegrityError):
                continue  # deleted, half-created, or refused (counted by the store)
        return out
