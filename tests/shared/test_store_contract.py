"""One contract suite, run against every ObjectStore backend (folder, s3, memory)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client import CollectorRegistry

from shared.errors import InvalidArgument, NotFound, PreconditionFailed, StoreIncompatible
from shared.store import (
    FolderStore,
    MemoryStore,
    MeteredStore,
    ObjectStore,
    RetryingStore,
    S3Config,
    S3Store,
    StoreOptions,
    open_store,
    parse_store_url,
    validate_key,
)
from shared.store.base import DELETE_BATCH, delete_keys
from shared.store.clock import store_time
from tests.helpers.moto_server import recording_proxy, stripping_proxy

MIB = 1024 * 1024


async def _collect(stream: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in stream])


async def test_round_trip(store: ObjectStore) -> None:
    etag = await store.put("a/b/c.json", b'{"x": 1}')
    assert await store.get("a/b/c.json") == b'{"x": 1}'
    assert await _collect(store.get_stream("a/b/c.json", chunk_size=3)) == b'{"x": 1}'
    info = await store.head("a/b/c.json")
    assert (info.key, info.size, info.etag) == ("a/b/c.json", 8, etag)

    etag2 = await store.put("a/b/c.json", b"{}")
    assert etag2 != etag
    assert await store.get("a/b/c.json") == b"{}"

    await store.delete("a/b/c.json")
    with pytest.raises(NotFound):
        await store.get("a/b/c.json")
    assert [i async for i in store.list()] == []


async def test_empty_object(store: ObjectStore) -> None:
    await store.put("empty", b"")
    assert await store.get("empty") == b""
    assert (await store.head("empty")).size == 0
    assert await _collect(store.get_stream("empty")) == b""


async def test_delete_missing_is_fine(store: ObjectStore) -> None:
    await store.delete("never/was")
    await store.delete("never/was")


async def test_delete_keys_removes_only_those_keys(store: ObjectStore) -> None:
    # More than one S3 DeleteObjects batch, plus missing keys (idempotent).
    keys = [f"d/{i:05d}" for i in range(DELETE_BATCH + 5)]
    await asyncio.gather(*(store.put(k, b"x") for k in keys))
    await store.put("d_keep", b"k")
    wrapped = RetryingStore(MeteredStore(store, "agents_cp", CollectorRegistry()))
    await delete_keys(wrapped, [*keys[:-1], "d/missing"])
    left = [i.key async for i in store.list("d")]
    assert left == [keys[-1], "d_keep"]
    await delete_keys(store, keys)
    assert [i.key async for i in store.list("d")] == ["d_keep"]
    with pytest.raises(InvalidArgument):
        await delete_keys(store, ["ok", "../bad"])


async def test_missing_key_raises_not_found(store: ObjectStore) -> None:
    with pytest.raises(NotFound) as caught:
        await store.get("no/such")
    assert caught.value.ident == "no/such"
    with pytest.raises(NotFound):
        await store.head("no/such")
    with pytest.raises(NotFound):
        await _collect(store.get_stream("no/such"))


async def test_create_only_refuses_existing(store: ObjectStore) -> None:
    first = await store.put("lease", b"one", if_none_match=True)
    with pytest.raises(PreconditionFailed) as caught:
        await store.put("lease", b"two", if_none_match=True)
    assert caught.value.key == "lease"
    assert await store.get("lease") == b"one"
    assert (await store.head("lease")).etag == first


async def test_compare_and_swap(store: ObjectStore) -> None:
    stale = await store.put("record", b"v1")
    current = await store.put("record", b"v2")
    with pytest.raises(PreconditionFailed):
        await store.put("record", b"v3", if_match=stale)
    assert await store.get("record") == b"v2"

    new = await store.put("record", b"v3", if_match=current)
    assert new != current
    assert await store.get("record") == b"v3"
    assert (await store.head("record")).etag == new


async def test_compare_and_swap_on_missing_key_fails(store: ObjectStore) -> None:
    etag = await store.put("other", b"x")
    with pytest.raises(PreconditionFailed):
        await store.put("missing", b"y", if_match=etag)
    with pytest.raises(NotFound):
        await store.get("missing")


async def test_conditions_cannot_be_combined(store: ObjectStore) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await store.put("k", b"x", if_none_match=True, if_match="abc")
    assert caught.value.field == "if_match"


async def test_concurrent_compare_and_swap_has_one_winner(
    store: ObjectStore, store_kind: str
) -> None:
    if store_kind == "s3":
        pytest.skip("moto checks conditions without a lock; real S3 serialises them")
    etag = await store.put("counter", b"0")
    results = await asyncio.gather(
        *(store.put("counter", str(i).encode(), if_match=etag) for i in range(1, 9)),
        return_exceptions=True,
    )
    winners = [r for r in results if isinstance(r, str)]
    assert len(winners) == 1
    assert all(isinstance(r, PreconditionFailed) for r in results if not isinstance(r, str))


async def test_list_many_keys_in_order_across_pages(store: ObjectStore) -> None:
    keys = [f"many/{i:05d}" for i in range(2500)]
    limit = asyncio.Semaphore(32)

    async def put(key: str) -> None:
        async with limit:
            await store.put(key, key.encode())

    # Neighbours that sort around the prefix must not leak into the listing.
    await asyncio.gather(*(put(k) for k in [*keys, "many-a", "manz", "man"]))

    pages = [p async for p in store.list_pages("many/", page_size=1000)]
    assert [len(p) for p in pages] == [1000, 1000, 500]
    listed = [info.key for page in pages for info in page]
    assert listed == keys
    assert all(info.size == len(info.key) for page in pages for info in page)

    flat = [info.key async for info in store.list("many/")]
    assert flat == keys
    resumed = [info.key async for info in store.list("many/", start_after="many/02400")]
    assert resumed == keys[2401:]
    everything = [info.key async for info in store.list(page_size=700)]
    assert everything == sorted([*keys, "many-a", "manz", "man"])


async def test_list_orders_across_folders(store: ObjectStore) -> None:
    # '-' and '.' sort before '/': a folder store must not list folder-first.
    for key in ["a/x", "a-b", "a.c", "b", "a/y/z", "ab"]:
        await store.put(key, b"1")
    assert [i.key async for i in store.list()] == sorted(["a/x", "a-b", "a.c", "b", "a/y/z", "ab"])
    assert [i.key async for i in store.list("a/")] == ["a/x", "a/y/z"]
    assert [i.key async for i in store.list("a", start_after="a/x")] == ["a/y/z", "ab"]


async def _pattern(size: int, chunk: int, hasher: hashlib._Hash) -> AsyncIterator[bytes]:
    seed = hashlib.sha256(b"seed").digest()
    for index in range(0, size, chunk):
        block = hashlib.sha256(seed + index.to_bytes(8, "big")).digest() * (chunk // 32)
        hasher.update(block)
        yield block


async def test_large_object_streams_with_bounded_memory(
    store: ObjectStore, store_kind: str
) -> None:
    size = 64 * MIB
    process = psutil.Process()
    baseline = process.memory_info().rss
    peak = baseline

    def sample() -> None:
        nonlocal peak
        peak = max(peak, process.memory_info().rss)

    sent = hashlib.sha256()

    async def source() -> AsyncIterator[bytes]:
        async for block in _pattern(size, MIB, sent):
            sample()
            yield block

    etag = await store.put("big/blob", source())
    assert (await store.head("big/blob")).size == size
    assert (await store.head("big/blob")).etag == etag

    received = hashlib.sha256()
    total = 0
    async for chunk in store.get_stream("big/blob", chunk_size=MIB):
        assert len(chunk) <= MIB
        received.update(chunk)
        total += len(chunk)
        sample()
    assert total == size
    assert received.hexdigest() == sent.hexdigest()
    if store_kind != "memory":  # the in-memory fake holds objects in RAM by design
        assert peak - baseline < 64 * MIB, f"grew by {(peak - baseline) / MIB:.1f} MiB"


async def test_large_conditional_writes(store: ObjectStore) -> None:
    """Objects larger than one S3 part still honour create-only and CAS."""
    size = 9 * MIB

    async def body(tag: bytes) -> AsyncIterator[bytes]:
        for _ in range(size // MIB):
            yield tag * MIB

    etag = await store.put("large", body(b"a"), if_none_match=True)
    with pytest.raises(PreconditionFailed):
        await store.put("large", body(b"b"), if_none_match=True)
    with pytest.raises(PreconditionFailed):
        await store.put("large", body(b"b"), if_match="0" * 32)
    new = await store.put("large", body(b"c"), if_match=etag)
    assert (await store.head("large")).etag == new
    assert (await store.get("large"))[:4] == b"cccc"


BAD_KEYS = [
    "",
    "/abs",
    "a/../b",
    "..",
    "a/./b",
    ".",
    "a//b",
    "a\\b",
    "a\nb",
    "a\x00b",
    "a\x7fb",
    "a b",
    "trailing/",
    "x" * 1025,
    "ünïcode",
    ".hidden",
]


async def test_bad_keys_refused_before_io(
    store: ObjectStore, store_kind: str, tmp_path: Path
) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"data"

    for key in BAD_KEYS:
        calls = [
            store.get(key),
            store.head(key),
            store.delete(key),
            store.put(key, b"data"),
            store.put(key, chunks(), if_none_match=True),
            _collect(store.get_stream(key)),
        ]
        for call in calls:
            with pytest.raises(InvalidArgument) as caught:
                await call
            assert caught.value.field == "key", key
    for prefix in ["/x", "a/../", "a\n"]:
        with pytest.raises(InvalidArgument):
            await _collect_list(store, prefix)
    assert [i async for i in store.list()] == []
    if store_kind == "folder":
        root = tmp_path / "store"
        assert not root.exists() or [p.name for p in root.iterdir()] == []


async def _collect_list(store: ObjectStore, prefix: str) -> list[str]:
    return [i.key async for i in store.list(prefix)]


def test_good_keys_accepted() -> None:
    for key in ["a", "accounts/acct_x/machines/mc_1.json", "k=v/x-y_z.1", "x" * 1024]:
        assert validate_key(key) == key


async def test_folder_store_modes(tmp_path: Path) -> None:
    async with FolderStore(tmp_path / "root") as store:
        await store.put("dir/file", b"x")
        assert (tmp_path / "root").stat().st_mode & 0o777 == 0o700
        assert (tmp_path / "root" / "dir").stat().st_mode & 0o777 == 0o700
        assert (tmp_path / "root" / "dir" / "file").stat().st_mode & 0o777 == 0o600
        # Temp files of interrupted writes are never listed.
        (tmp_path / "root" / "dir" / ".file.abc.tmp").write_bytes(b"junk")
        assert [i.key async for i in store.list()] == ["dir/file"]


async def test_s3_refused_when_server_ignores_conditions(
    moto_endpoint: str, s3_config: S3Config
) -> None:
    with stripping_proxy(moto_endpoint) as proxy:
        config = S3Config(
            bucket=s3_config.bucket,
            prefix=s3_config.prefix,
            endpoint_url=proxy,
            access_key=s3_config.access_key,
            secret_key=s3_config.secret_key,
        )
        with pytest.raises(StoreIncompatible) as caught:
            await S3Store.open(config)
        assert "If-None-Match" in str(caught.value)
        # The probe cleaned up after itself.
        direct = await S3Store.open(s3_config)
        try:
            assert [i async for i in direct.list()] == []
        finally:
            await direct.close()


async def test_s3_bad_keys_send_no_request(moto_endpoint: str, s3_config: S3Config) -> None:
    """Bad keys are refused before any I/O: the S3 server never hears of them."""
    with recording_proxy(moto_endpoint) as (proxy, seen):
        config = S3Config(
            bucket=s3_config.bucket,
            prefix=s3_config.prefix,
            endpoint_url=proxy,
            access_key=s3_config.access_key,
            secret_key=s3_config.secret_key,
        )
        async with S3Store(config) as store:
            await store.put("good", b"x")  # the proxy does forward requests
            before = len(seen)
            assert before > 0
            for key in BAD_KEYS:
                for call in (store.get(key), store.put(key, b"x"), store.delete(key)):
                    with pytest.raises(InvalidArgument):
                        await call
            assert seen[before:] == []


async def test_s3_probe_accepts_moto(s3_config: S3Config) -> None:
    async with S3Store(s3_config) as store:
        await store.put("k", b"v")
        assert [i.key async for i in store.list()] == ["k"]


async def test_s3_store_time_is_the_servers_date(s3_config: S3Config) -> None:
    """Through every wrapper open_store adds, the reading reaches S3's Date header
    (moto runs on our clock: within the header's second plus the round trip)."""
    store = await open_store(
        f"s3://{s3_config.bucket}/t",
        options=StoreOptions(
            access_key=s3_config.access_key,
            secret_key=s3_config.secret_key,
            region=s3_config.region,
            endpoint_url=s3_config.endpoint_url,
        ),
        registry=CollectorRegistry(),
    )
    async with store:
        reading = await store_time(store)
    assert reading is not None and abs(reading.skew) < 2.0
    assert reading.server.tzinfo is not None
    assert (
        await store_time(
            MeteredStore(RetryingStore(MemoryStore()), "agents_cp", CollectorRegistry())
        )
        is None
    )


async def test_open_store_urls(tmp_path: Path, s3_config: S3Config) -> None:
    registry = CollectorRegistry()
    folder = await open_store(str(tmp_path / "f"), registry=registry)
    assert isinstance(folder, MeteredStore) and isinstance(folder.inner, RetryingStore)
    assert isinstance(folder.inner.inner, FolderStore)
    async with folder:
        await folder.put("x", b"1")
        with pytest.raises(NotFound):
            await folder.get("y")
    assert (
        registry.get_sample_value(
            "agents_cp_store_operations_total", {"operation": "put", "outcome": "ok"}
        )
        == 1
    )
    assert (
        registry.get_sample_value(
            "agents_cp_store_operations_total", {"operation": "get", "outcome": "not_found"}
        )
        == 1
    )
    assert (
        registry.get_sample_value(
            "agents_cp_store_errors_total", {"operation": "get", "outcome": "not_found"}
        )
        is None
    )

    by_file_url = await open_store(f"file://{tmp_path / 'f'}", registry=registry)
    async with by_file_url:
        assert await by_file_url.get("x") == b"1"

    url = f"s3://{s3_config.bucket}/deploy?endpoint={s3_config.endpoint_url}"
    options = StoreOptions(access_key="testing", secret_key="testing-secret")
    s3 = await open_store(url, options=options, namespace="agents_machine", registry=registry)
    async with s3:
        await s3.put("k", b"v")
        assert await s3.get("k") == b"v"
    assert (
        registry.get_sample_value(
            "agents_machine_store_operations_total", {"operation": "put", "outcome": "ok"}
        )
        == 1
    )


@pytest.mark.parametrize(
    "url",
    [
        "",
        "ftp://host/x",
        "s3://",
        "s3://bucket/a/../b",
        "s3://bucket/p?unknown=1",
        "s3://bucket/p?endpoint=ftp://x",
        "s3://bucket/p?path_style=maybe",
        "s3://BAD_bucket/p",
        "file://otherhost/x",
        "file://relative",
    ],
)
def test_bad_urls_refused(url: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_store_url(url)
    assert caught.value.field == "store"


def test_url_secret_not_in_errors_or_repr() -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_store_url("s3://bucket/p?secret_key=hunter2&access_key=AK&bogus=1")
    assert "hunter2" not in str(caught.value)
    config = parse_store_url("s3://bucket/p?secret_key=hunter2&access_key=AK&region=eu-west-1")
    assert isinstance(config, S3Config)
    assert config.secret_key == "hunter2" and config.region == "eu-west-1"
    assert config.prefix == "p/"
    assert "hunter2" not in repr(config)
    explicit = parse_store_url(
        "s3://bucket?secret_key=url&access_key=url", StoreOptions("cfg", "cfg-secret")
    )
    assert isinstance(explicit, S3Config) and explicit.secret_key == "cfg-secret"


def test_plain_path_is_folder(tmp_path: Path) -> None:
    assert parse_store_url(str(tmp_path)) == tmp_path
    assert parse_store_url(f"file://{tmp_path}") == tmp_path
    assert os.path.isabs(parse_store_url("relative/dir"))  # type: ignore[arg-type]


async def test_folder_store_sweeps_stale_temp_files(tmp_path: Path) -> None:
    """Temp files of crashed writes vanish at open and when their folder empties;
    a fresh one (a write in progress elsewhere) is left alone."""
    import os
    import time

    root = tmp_path / "root"
    async with FolderStore(root) as store:
        await store.put("accounts/a1/account.json", b"{}")
        await store.put("keep/x", b"1")
    stale = root / "accounts" / "a1" / ".account.json.0123456789ab.tmp"
    fresh = root / "keep" / ".x.0123456789ab.tmp"
    for p in (stale, fresh):
        p.write_bytes(b"partial")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    async with FolderStore(root) as store:
        await store.head("keep/x")  # first use sweeps
        assert not stale.exists()
        assert fresh.exists()
        # Debris appearing later goes when its folder is emptied by a delete.
        stale.write_bytes(b"partial")
        os.utime(stale, (old, old))
        await store.delete("accounts/a1/account.json")
        assert not (root / "accounts").exists()


async def test_folder_store_delete_does_not_scan_a_full_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleting from a folder of many objects stops looking at its first object
    (a whole scan per delete made deleting a big prefix quadratic: 20,000
    objects took hours); a folder left with only a fresh temp file stays."""
    import shared.store.folder as folder_mod

    root = tmp_path / "root"
    async with FolderStore(root) as store:
        for i in range(200):
            await store.put(f"big/o{i:03d}", b"x")
        await store.put("lone/x", b"1")
        looked: list[str] = []
        real = os.scandir

        def counting(path: Any) -> Any:
            it = real(path)

            class Counted:
                def __enter__(self) -> Any:
                    return self

                def __exit__(self, *exc: object) -> None:
                    it.close()

                def __iter__(self) -> Any:
                    for entry in it:
                        looked.append(entry.name)
                        yield entry

            return Counted()

        monkeypatch.setattr(folder_mod.os, "scandir", counting)
        for i in range(100):
            await store.delete(f"big/o{i:03d}")
        assert len(looked) <= 100  # one entry looked at per delete, not 200
        fresh = root / "lone" / ".x.0123456789ab.tmp"
        fresh.write_bytes(b"partial")
        await store.delete("lone/x")
        assert fresh.exists()  # a write in progress elsewhere: its folder stays
    assert [i.key async for i in FolderStore(root).list("big/")][:1] == ["big/o100"]


async def test_folder_store_makes_new_folders_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every folder a put creates is fsynced into its parent before the object lands."""
    import shared.store.folder as folder_mod

    synced: list[Path] = []
    real = folder_mod.fsync_dir

    def record(path: Path) -> None:
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(folder_mod, "fsync_dir", record)
    root = tmp_path / "root"
    async with FolderStore(root) as store:
        root.mkdir(mode=0o700, exist_ok=True)
        await store.put("a/b/c/obj", b"x")
    for created in (root / "a", root / "a" / "b", root / "a" / "b" / "c"):
        assert created.parent in synced, f"{created} not made durable in {created.parent}"


class _TrackedMemoryStore(MemoryStore):
    """A MemoryStore that records whether it was entered and how often it was closed."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = False
        self.closes = 0

    async def __aenter__(self) -> _TrackedMemoryStore:
        self.entered = True
        return self

    async def close(self) -> None:
        self.closes += 1


@pytest.mark.parametrize("wrapper", ["retrying", "metered"])
async def test_wrappers_enter_list_and_close_the_inner_store(wrapper: str) -> None:
    inner = _TrackedMemoryStore()
    outer: ObjectStore = (
        RetryingStore(inner)
        if wrapper == "retrying"
        else MeteredStore(inner, "agents_cp", registry=CollectorRegistry())
    )
    async with outer as entered:
        assert entered is outer
        assert inner.entered and inner.closes == 0
        for key in ("b", "a", "c/d"):
            await outer.put(key, b"x")
        keys = [i.key async for i in outer.list(page_size=2)]
        assert keys == ["a", "b", "c/d"]
        assert [i.key async for i in outer.list("c/")] == ["c/d"]
        assert [i.key async for i in outer.list(start_after="a")] == ["b", "c/d"]
    assert inner.closes == 1
    await outer.close()
    assert inner.closes == 2
