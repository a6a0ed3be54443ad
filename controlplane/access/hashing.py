"""Bearer secrets (join tokens, admin credentials): making, splitting, hashing.

A secret is 32 random bytes (URL-safe base64, 43 characters) shown to a person
once as ``<id>.<secret>``. Only a hash is stored. Because the secret carries
256 bits of randomness, a fast keyed hash is enough (no password stretching
is needed): HMAC-SHA256 keyed by the purpose and the id, so a hash copied to
another record or purpose never verifies. Comparison is constant-time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import secrets
from typing import Final

from shared.errors import InvalidArgument
from shared.ids import is_valid_id

__all__ = ["bearer_ids", "hash_secret", "new_secret", "split_bearer", "verify_secret"]

logger = logging.getLogger(__name__)

_SECRET_RE: Final = re.compile(r"\A[A-Za-z0-9_-]{43}\Z")


def new_secret() -> str:
    """32 random bytes, URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()


def hash_secret(purpose: str, ident: str, secret: str) -> str:
    """``"hmac-sha256:<hex>"`` of ``secret`` keyed by purpose and id."""
    key = f"agents.{purpose}.v1:{ident}".encode()
    return "hmac-sha256:" + hmac.new(key, secret.encode(), hashlib.sha256).hexdigest()


def verify_secret(purpose: str, ident: str, secret: str, stored_hash: str) -> bool:
    """Constant-time check of ``secret`` against a stored hash."""
    return hmac.compare_digest(hash_secret(purpose, ident, secret), stored_hash)


def split_bearer(value: str, kind: str, field: str) -> tuple[str, str]:
    """Split ``<id>.<secret>`` where id is of ``kind``; raise InvalidArgument naming ``field``.

    The message never repeats the value (it is a secret).
    """
    if not isinstance(value, str) or value.count(".") != 1:
        raise InvalidArgument(field, f"must look like <{kind} id>.<secret>")
    ident, secret = value.split(".")
    if not is_valid_id(kind, ident) or not _SECRET_RE.match(secret):
        raise InvalidArgument(field, f"must look like <{kind} id>.<secret>")
    return ident, secret


def bearer_ids(value: str | None, kind: str) -> dict[str, str]:
    """``{"<kind>_id": id}`` of a well-formed ``<id>.<secret>``, else ``{}``: what a
    log line about a refused bearer may name (shared.logs), never its secret."""
    try:
        ident, _ = split_bearer(value or "", kind, kind)
    except InvalidArgument:
        return {}
    return {f"{kind}_id": ident}
