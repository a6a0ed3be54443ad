"""The retry policy and the RetryingStore wrapper."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import pytest

from shared.errors import InvalidArgument, NotFound, PreconditionFailed, StoreUnavailable
from shared.retry import retry_async, retrying
from shared.store import MemoryStore, ObjectInfo, RetryingStore

FAST = {"initial": 0.001, "max_delay": 0.01}


async def test_transient_error_is_retried_until_success() -> None:
    calls = 0

    @retry_async("op.flaky", attempts=5, **FAST)
    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise StoreUnavailable("flaky: down")
        return "ok"

    assert await flaky() == "ok"
    assert calls == 3


async def test_retries_are_bounded_by_attempts(caplog: pytest.LogCaptureFixture) -> None:
    calls = 0

    @retry_async("op.down", attempts=4, **FAST)
    async def down() -> None:
        nonlocal calls
        calls += 1
        raise StoreUnavailable("down: still")

    with caplog.at_level(logging.WARNING, logger="shared.retry"):
        with pytest.raises(StoreUnavailable):
            await down()
    assert calls == 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3
    assert all("op.down" in r.getMessage() for r in warnings)


async def test_retries_are_bounded_by_total_time() -> None:
    calls = 0
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        async for attempt in retrying("op.slow", attempts=1000, initial=0.05, total=0.3):
            with attempt:
                calls += 1
                raise StoreUnavailable("slow: down")
    assert time.monotonic() - started < 2.0
    # Waits of 0.05, 0.1 and 0.2 s (plus up to 0.05 of jitter each): the third try
    # is the last within 0.3 s, or the second on a machine slow enough to spend
    # more than 0.05 s between them.
    assert calls in (2, 3)


@pytest.mark.parametrize(
    "error",
    [NotFound("object", "k"), PreconditionFailed("k"), InvalidArgument("key", "bad"), KeyError()],
)
async def test_permanent_errors_are_not_retried(error: Exception) -> None:
    calls = 0

    @retry_async("op.perm", attempts=5, **FAST)
    async def fails() -> None:
        nonlocal calls
        calls += 1
        raise error

    with pytest.raises(type(error)):
        await fails()
    assert calls == 1


def test_bad_policy_refused() -> None:
    with pytest.raises(InvalidArgument):
        retrying("op", attempts=0)


class FlakyStore(MemoryStore):
    """A MemoryStore that fails the first ``failures`` calls of chosen operations."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.calls: dict[str, int] = {}

    def _maybe_fail(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        if self.failures > 0:
            self.failures -= 1
            raise StoreUnavailable(f"{op}: injected")

    async def get(self, key: str) -> bytes:
        self._maybe_fail("get")
        return await super().get(key)

    async def put(
        self,
        key: str,
        data: bytes | AsyncIterator[bytes],  # type: ignore[override]
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
    ) -> str:
        etag = await super().put(key, data, if_none_match=if_none_match, if_match=if_match)
        # Fail after writing: the answer is lost although the write landed.
        self._maybe_fail("put")
        return etag


async def test_retrying_store_retries_get() -> None:
    inner = FlakyStore(failures=0)
    await inner.put("k", b"v")
    inner.failures = 2
    store = RetryingStore(inner)
    assert await store.get("k") == b"v"
    assert inner.calls["get"] == 3


async def test_retrying_store_does_not_retry_not_found() -> None:
    inner = FlakyStore(failures=0)
    with pytest.raises(NotFound):
        await RetryingStore(inner).get("missing")
    assert inner.calls["get"] == 1


async def test_create_only_put_whose_answer_was_lost_is_ours() -> None:
    inner = FlakyStore(failures=1)
    store = RetryingStore(inner)
    etag = await store.put("lease", b"mine", if_none_match=True)
    assert etag == (await inner.head("lease")).etag
    # But someone else's object is still a lost race.
    with pytest.raises(PreconditionFailed):
        await store.put("lease", b"theirs", if_none_match=True)


async def test_a_transient_error_on_read_back_is_no_answer() -> None:
    """Before: the read-back after a lost answer took a 503 for someone else's
    object and raised PreconditionFailed for a write that had landed."""
    inner = FlakyStore(failures=2)  # the put's answer, then the first read-back
    store = RetryingStore(inner)
    etag = await store.put("entry", b"mine", if_none_match=True)
    assert etag == (await inner.head("entry")).etag
    assert inner.calls["get"] == 2


class UnreadableAfterPut(FlakyStore):
    """The put's answer is lost, and every read-back fails after it."""

    async def get(self, key: str) -> bytes:
        self.calls["get"] = self.calls.get("get", 0) + 1
        raise StoreUnavailable("get: injected")


async def test_a_read_back_that_keeps_failing_leaves_the_outcome_unknown() -> None:
    inner = UnreadableAfterPut(failures=1)
    store = RetryingStore(inner, attempts=3)
    with pytest.raises(StoreUnavailable):
        await store.put("entry", b"mine", if_none_match=True)
    assert inner.calls["get"] >= 3, "read back with retries, never taken as an answer"


async def test_streamed_put_is_not_retried() -> None:
    inner = FlakyStore(failures=1)

    async def chunks() -> AsyncIterator[bytes]:
        yield b"once"

    with pytest.raises(StoreUnavailable):
        await RetryingStore(inner).put("k", chunks())
    assert inner.calls["put"] == 1


class FlakyLister(MemoryStore):
    """Fails the listing once, after its first page."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    async def list_pages(
        self, prefix: str = "", *, start_after: str | None = None, page_size: int = 1000
    ) -> AsyncIterator[list[ObjectInfo]]:
        count = 0
        async for page in super().list_pages(prefix, start_after=start_after, page_size=page_size):
            if count == 1 and not self.failed:
                self.failed = True
                raise StoreUnavailable("list: injected")
            count += 1
            yield page


async def test_listing_resumes_after_transient_failure() -> None:
    inner = FlakyLister()
    keys = [f"k{i:03d}" for i in range(25)]
    for key in keys:
        await inner.put(key, b"x")
    listed = [i.key async for i in RetryingStore(inner).list(page_size=10)]
    assert inner.failed
    assert listed == keys
