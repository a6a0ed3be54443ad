"""The folder store's listing starts at the deepest folder its prefix names:
the same keys as a walk from the root, and nothing the root walk would skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.errors import InvalidArgument
from shared.store import FolderStore

KEYS = [
    "accounts/a/machines/m1.json",
    "accounts/a/token-uses/t1/int_1",
    "accounts/a/token-uses/t1/int_2",
    "accounts/a/token-uses/t10/int_3",
    "accounts/a/token-uses/t2/int_4",
    "accounts/a/tokens/t1.json",
    "accounts/a-b/x.json",
    "accounts/b/token-uses/t1/int_5",
    "index/tokens/t1.json",
]


async def _listed(store: FolderStore, prefix: str, after: str | None = None) -> list[str]:
    return [o.key async for o in store.list(prefix, start_after=after)]


async def test_every_prefix_lists_what_the_whole_listing_holds_under_it(tmp_path: Path) -> None:
    store = FolderStore(tmp_path / "store")
    for key in KEYS:
        await store.put(key, b"{}")
    everything = await _listed(store, "")
    assert everything == sorted(KEYS)
    prefixes = {key[:i] for key in KEYS for i in range(len(key) + 1)}
    for prefix in sorted(prefixes):
        expected = [k for k in everything if k.startswith(prefix)]
        assert await _listed(store, prefix) == expected, prefix
        for after in ("accounts/a/token-uses/t1/int_1", "accounts/a/token-uses/t10/"):
            assert await _listed(store, prefix, after) == [k for k in expected if k > after]


async def test_a_link_a_file_or_a_hidden_name_on_the_prefix_lists_nothing(
    tmp_path: Path,
) -> None:
    store = FolderStore(tmp_path / "store")
    await store.put("accounts/a/tokens/t1.json", b"{}")
    outside = tmp_path / "outside"
    await FolderStore(outside).put("tokens/t9.json", b"{}")  # a genuine object, elsewhere
    os.symlink(outside, tmp_path / "store" / "accounts" / "linked")
    (tmp_path / "store" / "accounts" / "plain").write_bytes(b"x")
    (tmp_path / "store" / ".hidden" / "tokens").mkdir(parents=True)
    for prefix in ("accounts/linked/", "accounts/linked/tokens/", "accounts/plain/tokens/"):
        assert await _listed(store, prefix) == [], prefix
    with pytest.raises(InvalidArgument):
        await _listed(store, ".hidden/tokens/")  # not even asked
    assert await _listed(store, "accounts/") == ["accounts/a/tokens/t1.json"]
