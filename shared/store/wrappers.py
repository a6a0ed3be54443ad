"""Cross-cutting behaviour as wrappers around any ObjectStore: retries and metrics.

Backends stay free of policy: :func:`~shared.store.url.open_store` returns
``MeteredStore(RetryingStore(backend))`` so every operation is retried by one
policy (:mod:`shared.retry`) and each try-sequence is measured once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Final, Self, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from tenacity import AsyncRetrying

from shared.errors import (
    AgentsError,
    IntegrityError,
    InvalidArgument,
    NotFound,
    PreconditionFailed,
    StoreError,
    StoreUnavailable,
    TransientError,
)
from shared.retry import DEFAULT_ATTEMPTS, DEFAULT_INITIAL, DEFAULT_TOTAL, retrying
from shared.store.base import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PAGE_SIZE,
    ObjectInfo,
    ObjectStore,
    PutData,
    StoreBase,
    delete_keys,
)
from shared.store.causes import OTHER, current_cause

__all__ = [
    "METRIC_NAMESPACES",
    "DeadlineStore",
    "MeteredStore",
    "RetryingStore",
    "StoreWrapper",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class StoreWrapper(StoreBase):
    """Base of the wrappers: holds ``inner``; entering or closing the wrapper enters
    or closes the store it wraps."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner

    async def close(self) -> None:
        """Close the inner store."""
        await self.inner.close()

    async def __aenter__(self) -> Self:
        await self.inner.__aenter__()
        return self


class RetryingStore(StoreWrapper):
    """Retries idempotent operations of ``inner`` on TransientError.

    Retried: get, head, delete, put of ``bytes`` (the data can be sent again),
    each listing page (resumed after the last key seen), and opening a stream
    (until its first chunk arrives). Not retried: a put of an async iterable,
    which cannot be replayed, and a stream once bytes have been yielded.

    A conditional put of bytes whose first try may have landed before a
    transient error is resolved on the retry's PreconditionFailed: if the
    object now holds exactly our bytes, the write is reported as ours.
    """

    def __init__(
        self,
        inner: ObjectStore,
        *,
        attempts: int = DEFAULT_ATTEMPTS,
        total: float = DEFAULT_TOTAL,
        initial: float = DEFAULT_INITIAL,
    ) -> None:
        super().__init__(inner)
        self._attempts = attempts
        self._total = total
        self._initial = initial

    def _policy(self, op: str) -> AsyncRetrying:
        return retrying(
            f"store.{op}", attempts=self._attempts, total=self._total, initial=self._initial
        )

    async def get(self, key: str) -> bytes:
        """See :meth:`ObjectStore.get`."""
        async for attempt in self._policy("get"):
            with attempt:
                return await self.inner.get(key)
        raise AssertionError("unreachable")

    async def get_stream(
        self, key: str, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> AsyncIterator[bytes]:
        """See :meth:`ObjectStore.get_stream`."""
        stream: AsyncIterator[bytes] | None = None
        first = b""
        async for attempt in self._policy("get_stream"):
            with attempt:
                stream = self.inner.get_stream(key, chunk_size)
                try:
                    first = await anext(stream)
                except StopAsyncIteration:
                    return
        assert stream is not None
        yield first
        async for chunk in stream:
            yield chunk

    async def head(self, key: str) -> ObjectInfo:
        """See :meth:`ObjectStore.head`."""
        async for attempt in self._policy("head"):
            with attempt:
                return await self.inner.head(key)
        raise AssertionError("unreachable")

    async def put(
        self,
        key: str,
        data: PutData,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
    ) -> str:
        """See :meth:`ObjectStore.put`."""
        if not isinstance(data, bytes | bytearray | memoryview):
            return await self.inner.put(key, data, if_none_match=if_none_match, if_match=if_match)
        content = bytes(data)
        tries = 0
        async for attempt in self._policy("put"):
            with attempt:
                tries += 1
                try:
                    return await self.inner.put(
                        key, content, if_none_match=if_none_match, if_match=if_match
                    )
                except PreconditionFailed:
                    if tries == 1 or not (if_none_match or if_match is not None):
                        raise
                    # An earlier try may have written before its answer was lost.
                    if await self._holds(key, content):
                        return (await self.head(key)).etag
                    raise
        raise AssertionError("unreachable")

    async def _holds(self, key: str, content: bytes) -> bool:
        """Whether ``key`` holds exactly ``content``, read back with retries.

        A transient error is never an answer: taken for "someone else's object",
        a write that landed was reported as lost to a race (and written again
        elsewhere, or failed with a bare PreconditionFailed). Once the retries
        are spent the error is raised: the outcome stays unknown, as it is.
        """
        async for attempt in self._policy("get"):
            with attempt:
                try:
                    return await self.inner.get(key) == content
                except NotFound:
                    return False
        raise AssertionError("unreachable")

    async def delete(self, key: str) -> None:
        """See :meth:`ObjectStore.delete`."""
        async for attempt in self._policy("delete"):
            with attempt:
                await self.inner.delete(key)
                return

    async def delete_many(self, keys: Sequence[str]) -> None:
        """See :meth:`StoreBase.delete_many`; the whole batch is retried (deletes are
        idempotent)."""
        async for attempt in self._policy("delete"):
            with attempt:
                await delete_keys(self.inner, keys)
                return

    async def list_pages(
        self,
        prefix: str = "",
        *,
        start_after: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[list[ObjectInfo]]:
        """See :meth:`ObjectStore.list_pages`; a failed page resumes after the last key."""
        after = start_after
        pages = self.inner.list_pages(prefix, start_after=after, page_size=page_size)
        while True:
            page: list[ObjectInfo] | None = None
            async for attempt in self._policy("list"):
                with attempt:
                    try:
                        page = await anext(pages)
                    except StopAsyncIteration:
                        return
                    except TransientError:
                        # The generator is finished after raising: restart it from
                        # the last key we handed out.
                        pages = self.inner.list_pages(
                            prefix, start_after=after, page_size=page_size
                        )
                        raise
            assert page is not None
            after = page[-1].key
            yield page


#: The daemons' metric namespaces.
METRIC_NAMESPACES: Final = frozenset({"agents_cp", "agents_machine"})


@dataclass(frozen=True, slots=True)
class _Metrics:
    operations: Counter
    seconds: Histogram
    errors: Counter
    requests: Counter


# Metrics exist once per (registry, namespace): a second store in one process
# shares them instead of failing on a duplicate registration.
_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, _Metrics]] = (
    weakref.WeakKeyDictionary()
)


def _metrics(registry: CollectorRegistry, namespace: str) -> _Metrics:
    per_registry = _METRICS.setdefault(registry, {})
    if namespace not in per_registry:
        labels = ("operation", "outcome")
        per_registry[namespace] = _Metrics(
            operations=Counter(
                f"{namespace}_store_operations",
                "Object store operations, by operation and outcome.",
                labels,
                registry=registry,
            ),
            seconds=Histogram(
                f"{namespace}_store_operation_seconds",
                "Object store operation latency in seconds (retries included).",
                labels,
                registry=registry,
                buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            ),
            errors=Counter(
                f"{namespace}_store_errors",
                "Object store faults (unavailable or permanent), by operation and outcome.",
                labels,
                registry=registry,
            ),
            requests=Counter(
                f"{namespace}_store_requests",
                "Object store operations, by the work that caused them (shared.store.causes).",
                ("cause", "operation"),
                registry=registry,
            ),
        )
    return per_registry[namespace]


def outcome_of(error: BaseException | None) -> str:
    """The bounded ``outcome`` label for an operation that raised ``error`` (or None)."""
    if error is None:
        return "ok"
    if isinstance(error, NotFound):
        return "not_found"
    if isinstance(error, PreconditionFailed):
        return "precondition_failed"
    if isinstance(error, InvalidArgument):
        return "invalid"
    if isinstance(error, TransientError):
        return "unavailable"
    if isinstance(error, IntegrityError):
        return "corrupt"
    if isinstance(error, AgentsError):
        return "error"
    if isinstance(error, GeneratorExit):
        return "ok"  # the caller stopped reading early
    if not isinstance(error, Exception):
        return "cancelled"
    return "error"


_FAULTS: Final = frozenset({"unavailable", "corrupt", "error"})


class _Timer:
    def __init__(self, metrics: _Metrics, operation: str, cause: str | None) -> None:
        self._metrics = metrics
        self._operation = operation
        # Taken at the start: the caller's context, whatever runs the rest.
        self._cause = cause
        self._start = time.perf_counter()

    def done(self, error: BaseException | None) -> None:
        outcome = outcome_of(error)
        self._metrics.operations.labels(self._operation, outcome).inc()
        if self._cause is not None:
            self._metrics.requests.labels(self._cause, self._operation).inc()
        self._metrics.seconds.labels(self._operation, outcome).observe(
            time.perf_counter() - self._start
        )
        if outcome in _FAULTS:
            self._metrics.errors.labels(self._operation, outcome).inc()


class MeteredStore(StoreWrapper):
    """Counts and times every operation of ``inner``.

    Metrics (labels ``operation`` and ``outcome`` only; never a key):
    ``<namespace>_store_operations_total``, ``<namespace>_store_operation_seconds``
    and ``<namespace>_store_errors_total`` (outcomes ``unavailable``, ``corrupt``,
    ``error``: faults, not NotFound or lost conditional writes).
    A listing counts one ``list`` operation per page.

    Given ``causes`` (the daemon's fixed list), each operation is also counted in
    ``<namespace>_store_requests_total{cause, operation}`` under the cause its
    caller's context names (:mod:`shared.store.causes`), ``other`` for one not
    on the list: summed over causes, it is ``*_store_operations_total``.
    """

    def __init__(
        self,
        inner: ObjectStore,
        namespace: str,
        registry: CollectorRegistry | None = None,
        *,
        causes: Collection[str] = (),
    ) -> None:
        if namespace not in METRIC_NAMESPACES:
            raise InvalidArgument("namespace", f"must be one of {sorted(METRIC_NAMESPACES)}")
        super().__init__(inner)
        self._metrics = _metrics(registry if registry is not None else REGISTRY, namespace)
        self._causes = frozenset(causes)

    def _timer(self, operation: str) -> _Timer:
        cause = None
        if self._causes:
            cause = current_cause()
            if cause not in self._causes:
                cause = OTHER
        return _Timer(self._metrics, operation, cause)

    async def _timed(self, operation: str, work: Awaitable[T]) -> T:
        """Await ``work``, counted and timed as one ``operation`` with its outcome."""
        timer = self._timer(operation)
        try:
            result = await work
        except BaseException as exc:
            timer.done(exc)
            raise
        timer.done(None)
        return result

    async def get(self, key: str) -> bytes:
        """See :meth:`ObjectStore.get`."""
        return await self._timed("get", self.inner.get(key))

    async def get_stream(
        self, key: str, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> AsyncIterator[bytes]:
        """See :meth:`ObjectStore.get_stream`; timed from open to the last chunk."""
        timer = self._timer("get_stream")
        try:
            async for chunk in self.inner.get_stream(key, chunk_size):
                yield chunk
        except BaseException as exc:
            timer.done(exc)
            raise
        timer.done(None)

    async def head(self, key: str) -> ObjectInfo:
        """See :meth:`ObjectStore.head`."""
        return await self._timed("head", self.inner.head(key))

    async def put(
        self,
        key: str,
        data: PutData,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
    ) -> str:
        """See :meth:`ObjectStore.put`."""
        put = self.inner.put(key, data, if_none_match=if_none_match, if_match=if_match)
        return await self._timed("put", put)

    async def delete(self, key: str) -> None:
        """See :meth:`ObjectStore.delete`."""
        await self._timed("delete", self.inner.delete(key))

    async def delete_many(self, keys: Sequence[str]) -> None:
        """See :meth:`StoreBase.delete_many`; counted as one ``delete`` operation."""
        await self._timed("delete", delete_keys(self.inner, keys))

    async def list_pages(
        self,
        prefix: str = "",
        *,
        start_after: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[list[ObjectInfo]]:
        """See :meth:`ObjectStore.list_pages`."""
        pages = self.inner.list_pages(prefix, start_after=start_after, page_size=page_size)
        while True:
            timer = self._timer("list")
            try:
                page = await anext(pages)
            except StopAsyncIteration:
                timer.done(None)
                return
            except BaseException as exc:
                timer.done(exc)
                raise
            timer.done(None)
            yield page


class DeadlineStore(StoreWrapper):
    """Bounds every operation of ``inner`` by ``seconds`` and names the store in its faults.

    Wrapped around :class:`RetryingStore`, the deadline covers the retries too, so a
    frozen server costs a caller at most ``seconds`` (keep it shorter than the
    deadline of whoever waits on the caller). A call that runs out of time raises
    StoreUnavailable; store faults (StoreUnavailable, StoreError and their
    subclasses) are re-raised as the same class with ``store <where>: `` in front
    of the message, so an operator reading one line knows which store failed.
    NotFound, PreconditionFailed, InvalidArgument and IntegrityError pass as they are.
    """

    def __init__(self, inner: ObjectStore, *, seconds: float, where: str) -> None:
        if seconds <= 0:
            raise InvalidArgument("seconds", "must be positive")
        super().__init__(inner)
        self._seconds = seconds
        self._where = where

    def _named(self, exc: AgentsError) -> AgentsError:
        # Subclasses of both carry only a message, so rebuilding keeps the class.
        return type(exc)(f"store {self._where}: {exc.message}")

    def _late(self, op: str, key: str) -> StoreUnavailable:
        return StoreUnavailable(
            f"store {self._where}: no answer within {self._seconds:g}s ({op} {key})"
        )

    async def _bounded(self, op: str, key: str, call: Any) -> Any:
        try:
            async with asyncio.timeout(self._seconds):
                return await call
        except TimeoutError:
            raise self._late(op, key) from None
        except (StoreUnavailable, StoreError) as exc:
            raise self._named(exc) from exc

    async def get(self, key: str) -> bytes:
        """See :meth:`ObjectStore.get`."""
        data: bytes = await self._bounded("get", key, self.inner.get(key))
        return data

    async def get_stream(
        self, key: str, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> AsyncIterator[bytes]:
        """See :meth:`ObjectStore.get_stream`; each chunk is bounded."""
        stream = self.inner.get_stream(key, chunk_size)
        while True:
            try:
                chunk: bytes = await self._bounded("get", key, anext(stream))
            except StopAsyncIteration:
                return
            yield chunk

    async def head(self, key: str) -> ObjectInfo:
        """See :meth:`ObjectStore.head`."""
        info: ObjectInfo = await self._bounded("head", key, self.inner.head(key))
        return info

    async def put(
        self,
        key: str,
        data: PutData,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
    ) -> str:
        """See :meth:`ObjectStore.put`. A put that runs out of time may still have landed."""
        call = self.inner.put(key, data, if_none_match=if_none_match, if_match=if_match)
        etag: str = await self._bounded("put", key, call)
        return etag

    async def delete(self, key: str) -> None:
        """See :meth:`ObjectStore.delete`."""
        await self._bounded("delete", key, self.inner.delete(key))

    async def delete_many(self, keys: Sequence[str]) -> None:
        """See :meth:`StoreBase.delete_many`; the whole batch is bounded once."""
        if keys:
            await self._bounded("delete", keys[0], delete_keys(self.inner, keys))

    async def list_pages(
        self,
        prefix: str = "",
        *,
        start_after: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[list[ObjectInfo]]:
        """See :meth:`ObjectStore.list_pages`; each page is bounded."""
        pages = self.inner.list_pages(prefix, start_after=start_after, page_size=page_size)
        while True:
            try:
                page: list[ObjectInfo] = await self._bounded("list", prefix, anext(pages))
            except StopAsyncIteration:
                return
            yield page
