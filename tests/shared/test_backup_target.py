"""shared.backup_target: the target contract, over every store a target is built on."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared.backup_target import BackupTarget, StoreTarget, manifest_key
from shared.errors import InvalidArgument, InvalidId, NotFound, PreconditionFailed
from shared.ids import new_id
from shared.store.folder import FolderStore
from shared.store.memory import MemoryStore


@pytest.fixture(params=["memory", "folder", "prefixed"])
async def target(request: pytest.FixtureRequest, tmp_path: Path) -> BackupTarget:
    if request.param != "prefixed":
        store = MemoryStore() if request.param == "memory" else FolderStore(tmp_path / "b")
        return StoreTarget(store)
    # Under a prefix, beside another machine's backups that it must never see.
    shared = MemoryStore()
    neighbour = StoreTarget(shared, "accounts/a/backups/other/")
    await neighbour.put_manifest(new_id("backup", now_ms=1500), b"theirs")
    await neighbour.put_segment("f" * 64, _chunks(b"theirs"))
    return StoreTarget(shared, "accounts/a/backups/mine/")


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def _read(target: BackupTarget, name: str) -> bytes:
    return b"".join([c async for c in target.get_segment(name)])


def _name() -> str:
    return os.urandom(32).hex()


async def test_segments_are_write_once_and_listed(target: BackupTarget) -> None:
    a, b = _name(), _name()
    await target.put_segment(a, _chunks(b"one", b"two"))
    await target.put_segment(a, _chunks(b"ignored: same name, same content by design"))
    assert await _read(target, a) == b"onetwo"
    assert await target.have_segments([a, b]) == {a: 6}
    assert await target.have_segments([]) == {}
    await target.put_segment(b, _chunks(b""))
    assert await target.list_segments() == {a, b}
    await target.delete_segments([a, _name()])
    assert await target.list_segments() == {b}
    with pytest.raises(NotFound):
        await _read(target, a)


async def test_manifests_create_once_sorted_and_deletable(target: BackupTarget) -> None:
    first, second = new_id("backup", now_ms=1000), new_id("backup", now_ms=2000)
    await target.put_manifest(second, b"sealed-2")
    await target.put_manifest(first, b"sealed-1")
    with pytest.raises(PreconditionFailed):
        await target.put_manifest(first, b"overwrite")
    assert [(m.backup_id, m.size) for m in await target.list_manifests()] == [
        (first, 8),
        (second, 8),
    ]
    assert await target.get_manifest(first) == b"sealed-1"
    await target.delete_manifest(first)
    await target.delete_manifest(first)
    with pytest.raises(NotFound, match="backup"):
        await target.get_manifest(first)
    assert [m.backup_id for m in await target.list_manifests()] == [second]


async def test_bad_names_refused_before_io(target: BackupTarget) -> None:
    with pytest.raises(InvalidId):
        await target.get_manifest("../../etc/passwd")
    with pytest.raises(ValueError):
        await target.put_segment("../x", _chunks(b""))
    with pytest.raises(ValueError):
        await target.have_segments(["A" * 64])


def test_keys() -> None:
    backup = new_id("backup")
    assert manifest_key(backup) == f"manifests/{backup}.sealed"
    with pytest.raises(InvalidArgument):
        manifest_key("bk_../../x")


def test_prefix_must_be_a_folder() -> None:
    with pytest.raises(ValueError):
        StoreTarget(MemoryStore(), "accounts/a")
    with pytest.raises(InvalidArgument):
        StoreTarget(MemoryStore(), "../x/")
