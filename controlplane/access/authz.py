"""Admin credentials: who is calling, verified into a principal (access.principals).

Four separate steps, each in its own place: the servicer reads the bearer
credential; :meth:`CredentialService.authenticate` verifies it into a
:class:`Principal`; the ownership record (an object's account id) is looked up
by the domain service; :meth:`Principal.visible_account` makes the decision.
An account admin asking for another account's object gets exactly the
NotFound a missing object gives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

from controlplane.access.accounts import AccountService
from controlplane.access.hashing import (
    bearer_ids,
    hash_secret,
    new_secret,
    split_bearer,
    verify_secret,
)
from controlplane.access.principals import ACCOUNT, OPERATOR, Principal
from controlplane.integrity import jsonstore
from controlplane.integrity.audit import Auditor
from controlplane.integrity.records import Credential, credential_key
from shared.errors import (
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from shared.ids import new_id, validate_id
from shared.repeats import RepeatLimit
from shared.store.base import ObjectStore
from shared.timestamps import Clock, utc_now

__all__ = ["CredentialService", "NewCredential"]

logger = logging.getLogger(__name__)

_PURPOSE: Final = "credential"


@dataclass(frozen=True)
class NewCredential:
    """A credential just made: its record and the value shown once."""

    credential: Credential
    value: str
    """``adm_<id>.<secret>``; never stored."""


_BAD_CREDENTIAL = "admin: unknown credential or wrong secret"


class CredentialService:
    """Admin credentials in the store (hash only)."""

    def __init__(
        self, store: ObjectStore, accounts: AccountService, auditor: Auditor, clock: Clock = utc_now
    ) -> None:
        self._store = store
        self._refusals = RepeatLimit(logger)
        self._accounts = accounts
        self._audit = auditor
        self._clock = clock

    async def _create(self, scope: str, account_id: str, label: str) -> NewCredential:
        cred_id = new_id("credential")
        secret = new_secret()
        cred = Credential(
            credential_id=cred_id,
            scope=scope,
            account_id=account_id,
            secret_hash=hash_secret(_PURPOSE, cred_id, secret),
            created_at=self._clock(),
            label=label,
        )
        await jsonstore.create(self._store, credential_key(cred_id), cred.to_dict())
        return NewCredential(cred, f"{cred_id}.{secret}")

    async def create_operator(self, label: str = "operator") -> NewCredential:
        """Make an operator credential (``init`` makes the first one)."""
        made = await self._create(OPERATOR, "", label)
        await self._audit.record("system", "credential.create", made.credential.credential_id)
        return made

    async def create_for_account(
        self, principal: Principal, account_id: str, label: str
    ) -> NewCredential:
        """Make a credential scoped to one account (operator only)."""
        principal.require_operator("credential create")
        validate_id("account", account_id, "account_id")
        if not label or len(label) > 64 or not label.isprintable():
            raise InvalidArgument("label", "must be 1-64 printable characters")
        # A missing account is NOT_FOUND (exit 2), as for token create; one being
        # deleted stays PERMISSION_DENIED.
        await self._accounts.get(account_id)
        await self._accounts.require_active(account_id, "credential create")
        made = await self._create(ACCOUNT, account_id, label)
        await self._audit.record(
            principal.credential_id, "credential.create", made.credential.credential_id, account_id
        )
        return made

    async def authenticate(self, bearer: str | None) -> Principal:
        """Verify ``adm_<id>.<secret>``; Unauthenticated with a reason, never echoing it.

        A refusal is one WARNING line naming the credential's id when the bearer
        has the right shape (``credential_id``), never its secret; the same
        refusal again within a minute is a DEBUG line (shared.repeats)."""
        try:
            return await self._authenticate(bearer)
        except (Unauthenticated, PermissionDenied) as e:
            self._refusals.warning(
                "admin credential refused: %s", e.message, extra=bearer_ids(bearer, "credential")
            )
            raise

    async def _authenticate(self, bearer: str | None) -> Principal:
        if not bearer:
            raise Unauthenticated("admin: no credential (authorization: Bearer adm_...)")
        try:
            cred_id, secret = split_bearer(bearer, "credential", "credential")
        except InvalidArgument:
            raise Unauthenticated("admin: malformed credential") from None
        try:
            cred = Credential.from_dict(await jsonstore.read(self._store, credential_key(cred_id)))
        except (NotFound, IntegrityError):
            # A refused (forged or altered) record grants nothing and says no more
            # than a missing one; the store counted and logged it.
            raise Unauthenticated(_BAD_CREDENTIAL) from None
        if cred.credential_id != cred_id:
            raise Unauthenticated(_BAD_CREDENTIAL)
        if not verify_secret(_PURPOSE, cred_id, secret, cred.secret_hash):
            # Same words as an unknown id: the answer must not tell which ids exist.
            raise Unauthenticated(_BAD_CREDENTIAL)
        if cred.revoked:
            raise Unauthenticated("admin: credential revoked")
        if cred.scope == ACCOUNT:
            await self._accounts.require_active(cred.account_id, "admin")
        elif cred.scope != OPERATOR:
            raise Unauthenticated("admin: credential has an unknown scope")
        return Principal(cred.credential_id, cred.scope, cred.account_id)
