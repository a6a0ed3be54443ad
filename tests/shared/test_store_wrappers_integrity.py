"""AuthenticatedStore (MAC on every object) and DeadlineStore (bounded calls, named faults)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from shared.errors import IntegrityError, NotFound, StoreMisconfigured, StoreUnavailable
from shared.store import MemoryStore
from shared.store.authenticated import AuthenticatedStore, seal
from shared.store.wrappers import DeadlineStore

KEY = b"k" * 32


async def test_authenticated_round_trip_and_refusals() -> None:
    inner = MemoryStore()
    refused: list[str] = []
    store = AuthenticatedStore(inner, KEY, on_refused=refused.append)
    await store.put("a/x.json", b'{"v":1}')
    assert await store.get("a/x.json") == b'{"v":1}'
    assert (await inner.get("a/x.json")).startswith(b"agents-mac1 ")

    async def chunks() -> AsyncIterator[bytes]:
        yield b"ab"
        yield b"cd"

    await store.put("a/s", chunks())
    assert b"".join([c async for c in store.get_stream("a/s", 3)]) == b"abcd"

    # Written without the key, altered, moved to another key, under another key.
    await inner.put("a/forged.json", b'{"v":1}')
    stored = await inner.get("a/x.json")
    await inner.put("a/altered.json", stored.replace(b'"v":1', b'"v":2'))
    await inner.put("a/moved.json", stored)
    await inner.put("a/other.json", seal(b"o" * 32, "a/other.json", b"{}"))
    for key in ("a/forged.json", "a/altered.json", "a/moved.json", "a/other.json"):
        with pytest.raises(IntegrityError):
            await store.get(key)
    assert refused == ["a/forged.json", "a/altered.json", "a/moved.json", "a/other.json"]
    with pytest.raises(NotFound):
        await store.get("a/missing.json")


class _Stuck(MemoryStore):
    async def get(self, key: str) -> bytes:
        await asyncio.Event().wait()  # a server that never answers
        return b""

    async def head(self, key: str):  # type: ignore[no-untyped-def]
        raise StoreMisconfigured("head x: the bucket does not exist (NoSuchBucket)")


async def test_deadline_bounds_calls_and_names_the_store() -> None:
    store = DeadlineStore(_Stuck(), seconds=0.2, where="s3://b/p/")
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(StoreUnavailable, match=r"store s3://b/p/: no answer within 0.2s"):
        await store.get("k")
    assert loop.time() - started < 2
    with pytest.raises(StoreMisconfigured, match=r"^store s3://b/p/: head x: the bucket"):
        await store.head("k")
    # Answers that are not faults pass as they are.
    plain = DeadlineStore(MemoryStore(), seconds=1, where="s3://b/p/")
    with pytest.raises(NotFound, match=r"^object missing: not found$"):
        await plain.get("missing")
