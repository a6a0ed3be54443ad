"""The object-store contract: one small async interface, and key validation.

Every backend (:class:`~shared.store.folder.FolderStore`,
:class:`~shared.store.s3.S3Store`, :class:`~shared.store.memory.MemoryStore`)
implements :class:`ObjectStore` with exactly the semantics written in its
docstrings, and ``tests/shared/test_store_contract.py`` checks every backend
against them.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Protocol, Self, TypeAlias, cast, runtime_checkable

from shared.errors import InvalidArgument

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_PAGE_SIZE",
    "DELETE_BATCH",
    "MAX_KEY_BYTES",
    "ObjectInfo",
    "ObjectStore",
    "PutData",
    "delete_keys",
    "validate_key",
    "validate_prefix",
]

logger = logging.getLogger(__name__)

#: Default size of the chunks :meth:`ObjectStore.get_stream` yields.
DEFAULT_CHUNK_SIZE: Final = 1024 * 1024
#: Default number of keys fetched per listing page.
DEFAULT_PAGE_SIZE: Final = 1000
#: Most keys one batch delete request carries (S3's DeleteObjects limit).
DELETE_BATCH: Final = 1000
#: Single deletes in flight at once when a store has no batch delete.
DELETE_CONCURRENCY: Final = 16
#: The longest key accepted, in bytes (S3's own limit).
MAX_KEY_BYTES: Final = 1024

#: What :meth:`ObjectStore.put` accepts: the whole object, or its chunks.
PutData: TypeAlias = bytes | AsyncIterable[bytes]

_KEY_CHARS: Final = re.compile(r"\A[A-Za-z0-9._\-/=]*\Z")


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What the store knows about one object."""

    key: str
    """The object's key, relative to the store (never includes a backend prefix)."""
    size: int
    """The object's length in bytes."""
    etag: str
    """An opaque version tag: it changes whenever the content changes; pass it
    back as ``put(..., if_match=etag)`` for compare-and-swap."""


#: The characters and length every key and prefix passes (see _check_path_like).
_PLAIN_KEY: Final = re.compile(rf"[A-Za-z0-9._\-/=]{{1,{MAX_KEY_BYTES}}}")


def _check_path_like(value: str, field: str, *, allow_empty: bool) -> None:
    # The common case first, in C: deleting an account validates ten thousand
    # keys, and the rules one by one loop over every character in Python.
    if (
        _PLAIN_KEY.fullmatch(value)
        and not value.startswith("/")
        and ".." not in value
        and "//" not in value
    ):
        return
    # Refused (or empty): find the first rule it breaks, to name it.
    if not value:
        if allow_empty:
            return
        raise InvalidArgument(field, "must not be empty")
    if len(value.encode("utf-8")) > MAX_KEY_BYTES:
        raise InvalidArgument(field, f"longer than {MAX_KEY_BYTES} bytes")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise InvalidArgument(field, "contains a control character")
    if "\\" in value:
        raise InvalidArgument(field, "contains a backslash")
    if value.startswith("/"):
        raise InvalidArgument(field, "must not start with '/'")
    if ".." in value:
        raise InvalidArgument(field, "must not contain '..'")
    if "//" in value:
        raise InvalidArgument(field, "must not contain '//'")
    if not _KEY_CHARS.match(value):
        raise InvalidArgument(field, "may contain only A-Z a-z 0-9 . _ - / =")


def validate_key(key: str, field: str = "key") -> str:
    """Return ``key`` if it is a safe object key, else raise :class:`InvalidArgument`.

    Called by every store before any I/O. A key is 1 to 1024 bytes of
    ``[A-Za-z0-9._-/=]``; it does not start or end with ``/``, contains no
    ``..`` or ``//``, no backslash, no control character, and no segment
    starts with ``.`` (so ``.`` and ``..`` segments are refused, and names the
    folder store uses for its temp and lock files can never be keys).
    """
    if not isinstance(key, str):
        raise InvalidArgument(field, "must be a string")
    _check_path_like(key, field, allow_empty=False)
    if key.endswith("/"):
        raise InvalidArgument(field, "must not end with '/'")
    if key.startswith(".") or "/." in key:  # a path segment starting with "."
        raise InvalidArgument(field, "no path segment may start with '.'")
    return key


def validate_prefix(prefix: str, field: str = "prefix") -> str:
    """Return ``prefix`` if it can start a key (empty is allowed), else raise.

    A prefix is a plain string prefix, not necessarily a whole folder: ``"a/b"``
    matches ``"a/b/c"`` and ``"a/bc"``. It follows the key rules, except that it
    may be empty or end with ``/``.
    """
    if not isinstance(prefix, str):
        raise InvalidArgument(field, "must be a string")
    _check_path_like(prefix, field, allow_empty=True)
    if any(segment.startswith(".") for segment in prefix.split("/")):
        raise InvalidArgument(field, "no path segment may start with '.'")
    return prefix


@runtime_checkable
class ObjectStore(Protocol):
    """A flat namespace of immutable byte objects with conditional writes.

    Every method validates its key (:func:`validate_key`) before any I/O and
    raises :class:`~shared.errors.InvalidArgument` naming ``key``. Errors:
    :class:`~shared.errors.NotFound` for a missing object,
    :class:`~shared.errors.PreconditionFailed` for a lost conditional write,
    :class:`~shared.errors.StoreUnavailable` for transient faults (connection
    errors, 5xx, throttling; safe to retry an idempotent call) and
    :class:`~shared.errors.StoreError` for permanent ones. A store is an async
    context manager; leaving it calls :meth:`close`.
    """

    async def get(self, key: str) -> bytes:
        """Return the whole object. Raises NotFound if it does not exist."""
        ...

    def get_stream(self, key: str, chunk_size: int = DEFAULT_CHUNK_SIZE) -> AsyncIterator[bytes]:
        """Yield the object in chunks of at most ``chunk_size`` bytes.

        Memory stays bounded by ``chunk_size`` whatever the object's size.
        NotFound is raised on the first iteration if the object does not exist.
        """
        ...

    async def head(self, key: str) -> ObjectInfo:
        """Return the object's size and etag. Raises NotFound if it does not exist."""
        ...

    async def put(
        self,
        key: str,
        data: PutData,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
    ) -> str:
        """Write the object atomically and return its new etag.

        ``data`` is the whole content, or an async iterable of chunks consumed
        once with bounded memory. Readers see the old object or the new one,
        never a mix. ``if_none_match=True`` creates only: PreconditionFailed if
        the key exists. ``if_match=etag`` is compare-and-swap: PreconditionFailed
        if the key is missing or its current etag differs. Both at once is
        refused with InvalidArgument. An unconditional put is idempotent.
        """
        ...

    async def delete(self, key: str) -> None:
        """Delete the object. Idempotent: deleting a missing key succeeds."""
        ...

    def list_pages(
        self,
        prefix: str = "",
        *,
        start_after: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[list[ObjectInfo]]:
        """Yield pages of at most ``page_size`` objects whose key starts with ``prefix``.

        Keys come in lexical (byte) order, each page fetched separately, only
        keys strictly greater than ``start_after`` if given, so a listing can
        resume from the last key seen. Empty pages are never yielded.
        """
        ...

    def list(
        self,
        prefix: str = "",
        *,
        start_after: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[ObjectInfo]:
        """Yield every object under ``prefix`` in lexical key order (see list_pages)."""
        ...

    async def close(self) -> None:
        """Release connections and file handles. Idempotent."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


def check_conditions(if_none_match: bool, if_match: str | None) -> None:
    """Refuse contradictory or malformed put conditions (shared by backends)."""
    if if_none_match and if_match is not None:
        raise InvalidArgument("if_match", "cannot be combined with if_none_match")
    if if_match is not None and (not isinstance(if_match, str) or not if_match):
        raise InvalidArgument("if_match", "must be a non-empty etag")


def check_sizes(chunk_size: int, field: str = "chunk_size") -> None:
    """Refuse a non-positive chunk or page size."""
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise InvalidArgument(field, "must be a positive integer")


async def flatten_pages(pages: AsyncIterator[list[ObjectInfo]]) -> AsyncIterator[ObjectInfo]:
    """Turn a stream of listing pages into a stream of objects."""
    async for page in pages:
        for info in page:
            yield info


class StoreBase:
    """Small shared behaviour: context management and ``list`` over ``list_pages``."""

    def list_pages(
        self,
        prefix: str = "",
        *,
        start_after: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[list[ObjectInfo]]:
        """Backends override this; see :meth:`ObjectStore.list_pages`."""
        raise NotImplementedError

    def list(
        self,
        prefix: str = "",
        *,
        start_after: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[ObjectInfo]:
        """Yield every object under ``prefix`` in lexical key order."""
        return flatten_pages(self.list_pages(prefix, start_after=start_after, page_size=page_size))

    async def delete_many(self, keys: Sequence[str]) -> None:
        """Delete every key (each idempotent, as :meth:`ObjectStore.delete`).

        Not part of the :class:`ObjectStore` contract: call :func:`delete_keys`.
        This default deletes one key at a time, at most ``DELETE_CONCURRENCY``
        at once, through the store's own ``delete`` (so a wrapper that does not
        override this still applies its rules to every key); backends with a
        batch call (S3's DeleteObjects) and the wrappers override it.
        """
        await _delete_each(cast(ObjectStore, self), keys)

    async def close(self) -> None:
        """Release resources; backends override when they hold any."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def _delete_each(store: ObjectStore, keys: Sequence[str]) -> None:
    limit = asyncio.Semaphore(DELETE_CONCURRENCY)

    async def one(key: str) -> None:
        async with limit:
            await store.delete(key)

    await asyncio.gather(*(one(k) for k in keys))


async def delete_keys(store: ObjectStore, keys: Sequence[str]) -> None:
    """Delete ``keys`` (idempotent), in batches where the store can.

    A failure may leave any subset deleted; calling again with the same keys
    finishes the job.
    """
    if not keys:
        return
    if isinstance(store, StoreBase):
        await store.delete_many(keys)
    else:
        await _delete_each(store, keys)


async def iter_chunks(data: PutData, max_chunk: int) -> AsyncIterator[bytes]:
    """Yield ``data`` (bytes or an async iterable of bytes) in bounded chunks.

    Chunks from an iterable are passed through as they come; bytes are cut
    into slices of at most ``max_chunk``.
    """
    if isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data)
        for start in range(0, len(view), max_chunk):
            yield bytes(view[start : start + max_chunk])
        return
    if not isinstance(data, AsyncIterable):
        raise InvalidArgument("data", "must be bytes or an async iterable of bytes")
    async for chunk in data:
        if not isinstance(chunk, bytes | bytearray | memoryview):
            raise InvalidArgument("data", "chunks must be bytes")
        if chunk:
            yield bytes(chunk)
