"""A listing of the folder store cancelled while its walker runs in a worker thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from shared.store import FolderStore
from shared.store.base import ObjectInfo


async def test_a_cancelled_listing_ends_cancelled_not_with_the_walkers_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FolderStore(tmp_path / "store")
    walking, release = threading.Event(), threading.Event()

    def blocked_walk(*args: Any) -> Generator[ObjectInfo, None, None]:
        walking.set()
        release.wait(10)
        yield from ()

    monkeypatch.setattr(store, "_walk", blocked_walk)

    async def consume() -> None:
        async for _ in store.list_pages(""):
            pass

    task = asyncio.create_task(consume())
    try:
        assert await asyncio.to_thread(walking.wait, 10)
        task.cancel()
        # Before the fix the walker's close raised ValueError ("generator already
        # executing") in place of the CancelledError: a task looping on
        # `except Exception` then never ended.
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        release.set()
        await store.close()
