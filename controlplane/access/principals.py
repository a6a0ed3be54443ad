"""Admin principals: a verified caller, and what it may see.

Its own module so that the account service (which scopes listings by a
principal) and the credential service (which makes principals, and checks
accounts) need not import each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from shared.errors import NotFound, PermissionDenied
from shared.ids import validate_id

__all__ = ["ACCOUNT", "OPERATOR", "Principal"]

OPERATOR: Final = "operator"
ACCOUNT: Final = "account"


@dataclass(frozen=True)
class Principal:
    """A verified admin caller."""

    credential_id: str
    scope: str
    """"operator" (every account) or "account" (only ``account_id``)."""
    account_id: str = ""

    @property
    def is_operator(self) -> bool:
        """Whether this principal may act on every account."""
        return self.scope == OPERATOR

    def require_operator(self, what: str) -> None:
        """PermissionDenied unless the caller is the operator."""
        if not self.is_operator:
            raise PermissionDenied(f"{what}: needs an operator credential")

    def can_see(self, account_id: str) -> bool:
        """Whether objects of ``account_id`` are visible to this principal."""
        return self.is_operator or account_id == self.account_id

    def visible_account(self, account_id: str, kind: str, ident: str) -> None:
        """NotFound(kind, ident), exactly as for a missing object, unless visible."""
        if not self.can_see(account_id):
            raise NotFound(kind, ident)

    def listing_scope(self, requested: str) -> str | None:
        """Which account a listing covers: None means every account (operator only)."""
        if requested:
            validate_id("account", requested, "account_id")
            self.visible_account(requested, "account", requested)
            return requested
        return None if self.is_operator else self.account_id
