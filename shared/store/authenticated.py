"""Objects that write access to the store alone cannot forge: a MAC on every object.

:class:`AuthenticatedStore` wraps any :class:`~shared.store.base.ObjectStore`.
Every object it writes is stored as one header line and the caller's bytes::

    agents-mac1 <hex HMAC-SHA256>\\n<payload>

The MAC covers a domain tag, the object's KEY and the payload, under a key that
is never in the store (the caller supplies it; the control plane derives it
from its home's secrets key, see :func:`controlplane.integrity.trusted.record_mac_key`).
So someone who can write to the bucket but has no file from the home cannot
make an object the wrapper accepts, nor move a genuine object to another key
(an index entry copied to another id, a credential renamed). What a MAC cannot
stop is a genuine older version written back at its own key (a rollback) or a
deletion; docs/security.md says what that means for each record.

Reads verify before returning anything: an object without the header, with a
MAC that does not match, or that is not valid at its key raises
:class:`~shared.errors.IntegrityError` (DATA_LOSS). ``on_refused(key)`` is
called for every refusal (the daemon counts them; logging is once per key).
Listings pass through: a listing grants nothing until an object is read.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Final

from shared.errors import IntegrityError, InvalidArgument, TooLarge
from shared.store.base import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PAGE_SIZE,
    ObjectInfo,
    ObjectStore,
    PutData,
    delete_keys,
    iter_chunks,
    validate_key,
)
from shared.store.wrappers import StoreWrapper

__all__ = [
    "MAC_HEADER",
    "MAX_AUTHENTICATED_BYTES",
    "AuthenticatedStore",
    "seal",
    "unseal",
    "unverified_payload",
]

logger = logging.getLogger(__name__)

MAC_HEADER: Final = b"agents-mac1 "
_DOMAIN: Final = b"agents.store-object.v1\0"
#: Authenticated objects are records, read whole: streamed writes are bounded by this.
MAX_AUTHENTICATED_BYTES: Final = 16 * 1024 * 1024
#: How many refused keys are remembered to log each only once.
_LOGGED_KEYS: Final = 10_000


def _mac(mac_key: bytes, key: str, payload: bytes) -> str:
    msg = _DOMAIN + key.encode() + b"\0" + payload
    return hmac.new(mac_key, msg, hashlib.sha256).hexdigest()


def seal(mac_key: bytes, key: str, payload: bytes) -> bytes:
    """The stored form of ``payload`` at ``key`` (header line + payload)."""
    return MAC_HEADER + _mac(mac_key, key, payload).encode() + b"\n" + payload


def unseal(mac_key: bytes, key: str, stored: bytes) -> bytes:
    """The payload of a stored object, or IntegrityError if it is not authentic at ``key``."""
    if not stored.startswith(MAC_HEADER):
        raise IntegrityError(key, "object carries no MAC (written without the deployment's key)")
    line_end = stored.find(b"\n", len(MAC_HEADER))
    if line_end < 0:
        raise IntegrityError(key, "malformed MAC header")
    given = stored[len(MAC_HEADER) : line_end]
    payload = stored[line_end + 1 :]
    if not hmac.compare_digest(given, _mac(mac_key, key, payload).encode()):
        raise IntegrityError(key, "MAC does not match (forged, altered or moved object)")
    return payload


def unverified_payload(stored: bytes) -> bytes:
    """The payload of a stored object, its MAC header (if any) cut off, NOT verified:
    for a caller that trusts the object anyway (an adopt) or only deletes within
    the object's own prefix by what it names (an account deletion)."""
    if not stored.startswith(MAC_HEADER):
        return stored
    line_end = stored.find(b"\n", len(MAC_HEADER))
    return stored[line_end + 1 :] if line_end >= 0 else b""


class AuthenticatedStore(StoreWrapper):
    """Seals every write and verifies every read of ``inner`` (see the module doc)."""

    def __init__(
        self,
        inner: ObjectStore,
        mac_key: bytes,
        *,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        if len(mac_key) < 32:
            raise InvalidArgument("mac_key", "must be at least 32 bytes")
        super().__init__(inner)
        self._key = bytes(mac_key)
        self._on_refused = on_refused
        self._logged: set[str] = set()

    def _refused(self, key: str, error: IntegrityError) -> None:
        if self._on_refused is not None:
            self._on_refused(key)
        if key not in self._logged and len(self._logged) < _LOGGED_KEYS:
            self._logged.add(key)
            logger.error("store object refused: %s", error)

    def _open(self, key: str, stored: bytes) -> bytes:
        try:
            return unseal(self._key, key, stored)
        except IntegrityError as e:
            self._refused(key, e)
            raise

    async def get(self, key: str) -> bytes:
        """See :meth:`ObjectStore.get`; IntegrityError when the object is not authentic."""
        return self._open(key, await self.inner.get(validate_key(key)))

    async def get_stream(
        self, key: str, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> AsyncIterator[bytes]:
        """See :meth:`ObjectStore.get_stream`: verified whole first, then yielded in chunks."""
        payload = await self.get(key)
        for start in range(0, len(payload), chunk_size):
            yield payload[start : start + chunk_size]

    async def head(self, key: str) -> ObjectInfo:
        """See :meth:`ObjectStore.head`: existence and etag only, nothing verified.

        Callers that decide anything from an object's content use :meth:`get`.
        """
        return await self.inner.head(key)

    async def put(
        self,
        key: str,
        data: PutData,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
    ) -> str:
        """See :meth:`ObjectStore.put`; the stored bytes carry the MAC."""
        validate_key(key)
        if isinstance(data, bytes | bytearray | memoryview):
            payload = bytes(data)
        else:
            parts: list[bytes] = []
            size = 0
            async for chunk in iter_chunks(data, DEFAULT_CHUNK_SIZE):
                size += len(chunk)
                if size > MAX_AUTHENTICATED_BYTES:
                    raise TooLarge("data", MAX_AUTHENTICATED_BYTES)
                parts.append(chunk)
            payload = b"".join(parts)
        return await self.inner.put(
            key, seal(self._key, key, payload), if_none_match=if_none_match, if_match=if_match
        )

    async def delete(self, key: str) -> None:
        """See :meth:`ObjectStore.delete`."""
        await self.inner.delete(key)

    async def delete_many(self, keys: Sequence[str]) -> None:
        """See :meth:`StoreBase.delete_many` (deletes carry no MAC)."""
        await delete_keys(self.inner, keys)

    def list_pages(
        self,
        prefix: str = "",
        *,
        start_after: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[list[ObjectInfo]]:
        """See :meth:`ObjectStore.list_pages` (sizes include the MAC header)."""
        return self.inner.list_pages(prefix, start_after=start_after, page_size=page_size)
