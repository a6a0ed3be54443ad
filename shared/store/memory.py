"""An in-memory object store: the only fake, for domain unit tests.

It keeps the full :class:`~shared.store.base.ObjectStore` contract (the
contract suite runs against it) but nothing survives the process.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
from collections.abc import AsyncIterator

from shared.errors import NotFound, PreconditionFailed
from shared.store.base import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PAGE_SIZE,
    ObjectInfo,
    PutData,
    StoreBase,
    check_conditions,
    check_sizes,
    validate_key,
    validate_prefix,
)

__all__ = ["MemoryStore"]

logger = logging.getLogger(__name__)


class MemoryStore(StoreBase):
    """Objects in a dict; etag is the SHA-256 of the content, as in FolderStore."""

    def __init__(self) -> None:
        self._objects: dict[str, tuple[bytes, str]] = {}
        self._keys: list[str] = []  # sorted, for ordered listing
        self._lock = asyncio.Lock()

    async def get(self, key: str) -> bytes:
        """See :meth:`ObjectStore.get`."""
        validate_key(key)
        try:
            return self._objects[key][0]
        except KeyError:
            raise NotFound("object", key) from None

    async def get_stream(
        self, key: str, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> AsyncIterator[bytes]:
        """See :meth:`ObjectStore.get_stream`."""
        check_sizes(chunk_size)
        data = await self.get(key)
        view = memoryview(data)
        for start in range(0, len(data), chunk_size):
            yield bytes(view[start : start + chunk_size])

    async def head(self, key: str) -> ObjectInfo:
        """See :meth:`ObjectStore.head`."""
        validate_key(key)
        try:
            data, etag = self._objects[key]
        except KeyError:
            raise NotFound("object", key) from None
        return ObjectInfo(key, len(data), etag)

    async def put(
        self,
        key: str,
        data: PutData,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
    ) -> str:
        """See :meth:`ObjectStore.put`."""
        validate_key(key)
        check_conditions(if_none_match, if_match)
        if isinstance(data, bytes | bytearray | memoryview):
            content = bytes(data)
        else:
            parts = bytearray()
            async for chunk in data:
                parts += chunk
            content = bytes(parts)
        etag = hashlib.sha256(content).hexdigest()
        async with self._lock:
            current = self._objects.get(key)
            if if_none_match and current is not None:
                raise PreconditionFailed(key, "object already exists")
            if if_match is not None:
                if current is None:
                    raise PreconditionFailed(key, "object does not exist")
                if current[1] != if_match:
                    raise PreconditionFailed(key, "etag does not match")
            if current is None:
                bisect.insort(self._keys, key)
            self._objects[key] = (content, etag)
        return etag

    async def delete(self, key: str) -> None:
        """See :meth:`ObjectStore.delete`."""
        validate_key(key)
        async with self._lock:
            if self._objects.pop(key, None) is not None:
                del self._keys[bisect.bisect_left(self._keys, key)]

    async def list_pages(
        self,
        prefix: str = "",
        *,
        start_after: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[list[ObjectInfo]]:
        """See :meth:`ObjectStore.list_pages`."""
        validate_prefix(prefix)
        check_sizes(page_size, "page_size")
        after = start_after if start_after is not None and start_after >= prefix else None
        while True:
            if after is None:
                index = bisect.bisect_left(self._keys, prefix)
            else:
                index = bisect.bisect_right(self._keys, after)
            page: list[ObjectInfo] = []
            for key in self._keys[index : index + page_size]:
                if not key.startswith(prefix):
                    break
                data, etag = self._objects[key]
                page.append(ObjectInfo(key, len(data), etag))
            if not page:
                return
            yield page
            if len(page) < page_size:
                return
            after = page[-1].key
