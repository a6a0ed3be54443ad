"""jsonstore.read_all: a listing is complete, or an error naming what it could not read."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from controlplane.integrity import jsonstore
from shared.errors import IntegrityError, NotFound, StoreUnavailable
from shared.ids import new_id
from shared.store import MemoryStore, ObjectInfo
from shared.store.wrappers import StoreWrapper


class RacingGets(StoreWrapper):
    """Answers NotFound to the first ``misses`` GETs of ``key`` while it exists:
    what a server does to a GET racing an overwrite of the object."""

    def __init__(self, inner: MemoryStore, key: str, misses: int) -> None:
        super().__init__(inner)
        self.key = key
        self.misses = misses

    async def get(self, key: str) -> bytes:
        if key == self.key and self.misses > 0:
            self.misses -= 1
            raise NotFound("object", key)
        return await self.inner.get(key)

    async def head(self, key: str) -> ObjectInfo:
        return await self.inner.head(key)

    def list_pages(
        self, prefix: str = "", *, start_after: str | None = None, page_size: int = 1000
    ) -> AsyncIterator[list[ObjectInfo]]:
        return self.inner.list_pages(prefix, start_after=start_after, page_size=page_size)


async def _two_tokens() -> tuple[MemoryStore, list[str]]:
    store = MemoryStore()
    keys = []
    for i in range(2):
        key = f"accounts/a/tokens/{new_id('token')}.json"
        await jsonstore.create(store, key, {"n": i})
        keys.append(key)
    return store, sorted(keys)


async def test_a_read_that_races_a_write_is_read_again_not_left_out() -> None:
    store, keys = await _two_tokens()
    racing = RacingGets(store, keys[1], misses=2)
    listed = await jsonstore.read_all(racing, "accounts/a/tokens/", "token")
    assert len(listed) == 2  # before: the second token was silently missing
    assert racing.misses == 0


async def test_a_key_listed_but_never_readable_fails_the_listing_naming_it() -> None:
    store, keys = await _two_tokens()
    racing = RacingGets(store, keys[0], misses=100)
    with pytest.raises(StoreUnavailable, match=keys[0]):
        await jsonstore.read_all(racing, "accounts/a/tokens/", "token")


async def test_an_object_deleted_after_the_listing_is_left_out() -> None:
    store, keys = await _two_tokens()

    class DeletedMeanwhile(RacingGets):
        async def get(self, key: str) -> bytes:
            if key == self.key:
                await self.inner.delete(key)
            return await self.inner.get(key)

    listed = await jsonstore.read_all(
        DeletedMeanwhile(store, keys[0], 0),
        "accounts/a/tokens/",
        "token",
    )
    assert listed == [await jsonstore.read(store, keys[1])]


async def test_a_torn_read_is_read_again_and_a_forgery_left_out() -> None:
    store, keys = await _two_tokens()

    class TornOnce(RacingGets):
        async def get(self, key: str) -> bytes:
            if key == self.key and self.misses > 0:
                self.misses -= 1
                raise IntegrityError(f"object {key}", "content does not match its MAC")
            return await self.inner.get(key)

    listed = await jsonstore.read_all(TornOnce(store, keys[0], 1), "accounts/a/tokens/", "token")
    assert len(listed) == 2
    forged = TornOnce(store, keys[0], 100)
    left = await jsonstore.read_all(forged, "accounts/a/tokens/", "token")
    assert left == [await jsonstore.read(store, keys[1])]
