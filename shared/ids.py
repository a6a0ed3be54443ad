"""Identifiers: how they are made and the strict patterns that validate them.

Every id that arrives from outside (a request field, a file name, a store
key) goes through :func:`validate_id` before it touches a path, a key or a
query. Ids are ``<prefix>_<26 chars>``: 10 characters of millisecond time
and 16 of randomness in lower-case Crockford base32, so they sort by
creation time and are safe in paths, URLs and store keys.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from typing import Final

from shared.errors import InvalidId

__all__ = [
    "KINDS",
    "id_time_ms",
    "is_backup_id",
    "is_increment",
    "is_valid_id",
    "new_id",
    "validate_id",
    "validate_sha256",
]

logger = logging.getLogger(__name__)

_ALPHABET: Final = "0123456789abcdefghjkmnpqrstvwxyz"

#: kind -> prefix. The prefix makes a pasted id self-describing.
KINDS: Final[dict[str, str]] = {
    "account": "acct",
    "agent": "ag",
    "attachment": "att",
    "backup": "bk",
    # A continuous backup's increment (docs/backups.md): told from a daily point
    # by its id alone, so a target that cannot open manifests prunes by kind.
    "increment": "bki",
    "event": "ev",
    "machine": "mc",
    "prompt": "pr",
    "run": "run",
    "schedule": "sch",
    "token": "tok",
    "credential": "adm",
    "audit": "au",
    "intent": "int",
    "deployment": "dep",
}

_BODY: Final = f"[{_ALPHABET}]{{26}}"
_PATTERNS: Final[dict[str, re.Pattern[str]]] = {
    kind: re.compile(rf"\A{prefix}_{_BODY}\Z") for kind, prefix in KINDS.items()
}
_SHA256: Final = re.compile(r"\A[0-9a-f]{64}\Z")


#: Ids carry their time in ten base-32 characters: milliseconds below 2**50.
_MAX_MS: Final = 1 << 50


def _encode(value: int, length: int) -> str:
    out = []
    for _ in range(length):
        out.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(out))


def new_id(kind: str, *, now_ms: int | None = None) -> str:
    """Return a fresh id of ``kind`` (a key of :data:`KINDS`)."""
    prefix = KINDS[kind]
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    if not 0 <= ms < _MAX_MS:
        # Ten characters hold 50 bits: a time past them would wrap and sort first.
        raise ValueError(f"id time {ms} ms is outside the ids' range")
    return f"{prefix}_{_encode(ms, 10)}{_encode(secrets.randbits(80), 16)}"


def id_time_ms(value: str) -> int:
    """The millisecond time a well-formed id was made at (its first ten characters)."""
    ms = 0
    for ch in value.partition("_")[2][:10]:
        ms = ms * 32 + _ALPHABET.index(ch)
    return ms


def is_valid_id(kind: str, value: str) -> bool:
    """True when ``value`` is a well-formed id of ``kind``."""
    pattern = _PATTERNS.get(kind)
    return bool(pattern and isinstance(value, str) and pattern.match(value))


def is_increment(value: str) -> bool:
    """Whether ``value`` is a continuous backup's increment id (``bki_...``)."""
    return is_valid_id("increment", value)


def is_backup_id(value: str) -> bool:
    """Whether ``value`` is a stored backup's id: a daily point or an increment."""
    return is_valid_id("backup", value) or is_valid_id("increment", value)


def validate_id(kind: str, value: str, field: str | None = None) -> str:
    """Return ``value`` if it is a well-formed id of ``kind``, else raise InvalidId."""
    if not is_valid_id(kind, value):
        raise InvalidId(kind, value if isinstance(value, str) else repr(value), field)
    return value


def validate_sha256(value: str, field: str = "sha256") -> str:
    """Return ``value`` if it is 64 lower-case hex characters, else raise InvalidId."""
    if not isinstance(value, str) or not _SHA256.match(value):
        raise InvalidId("sha256", str(value), field)
    return value
