"""shared.backup_target: the target contract, over every store a target is built on."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared.backup_target import BackupTarget, StoreTarget, kept_by_points, manifest_key
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
    await neighbour.put_manifest(new_id("backup", now_ms=1500), b"theirs", ["f" * 64])
    await neighbour.put_segment("f" * 64, _chunks(b"theirs"))
    return StoreTarget(shared, "accounts/a/backups/mine/")


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def _read(target: BackupTarget, name: str) -> bytes:
    return b"".join([c async for c in target.get_segment(name)])


def _name() -> str:
    return os.urandom(32).hex()


async def test_segments_are_write_once(target: BackupTarget) -> None:
    a, b = _name(), _name()
    await target.put_segment(a, _chunks(b"one", b"two"))
    await target.put_segment(a, _chunks(b"ignored: same name, same content by design"))
    assert await _read(target, a) == b"onetwo"
    assert await target.have_segments([a, b]) == {a: 6}
    assert await target.have_segments([]) == {}
    with pytest.raises(NotFound, match="segment"):
        await _read(target, b)


async def test_manifests_create_once_and_sorted(target: BackupTarget) -> None:
    first, second = new_id("backup", now_ms=1000), new_id("backup", now_ms=2000)
    await target.put_manifest(second, b"sealed-2", [])
    await target.put_manifest(first, b"sealed-1", [])
    with pytest.raises(PreconditionFailed):
        await target.put_manifest(first, b"overwrite", [])
    assert [(m.backup_id, m.size) for m in await target.list_manifests()] == [
        (first, 8),
        (second, 8),
    ]
    assert await target.get_manifest(first) == b"sealed-1"
    with pytest.raises(NotFound, match="backup"):
        await target.get_manifest(new_id("backup"))


async def test_a_manifest_put_again_with_the_same_bytes_is_done(target: BackupTarget) -> None:
    """A put sent again after its answer was lost (it had landed) is the same backup;
    before, the second put failed PreconditionFailed and the backup was reported
    failed though it was stored."""
    backup = new_id("backup", now_ms=1000)
    await target.put_manifest(backup, b"sealed", ["a" * 64])
    await target.put_manifest(backup, b"sealed", ["a" * 64])
    assert [m.backup_id for m in await target.list_manifests()] == [backup]
    with pytest.raises(PreconditionFailed):
        await target.put_manifest(backup, b"other bytes", ["a" * 64])
    assert await target.get_manifest(backup) == b"sealed"


async def test_prune_keeps_what_kept_backups_name(target: BackupTarget) -> None:
    shared_seg, old_only, debris = _name(), _name(), _name()
    for n in (shared_seg, old_only, debris):
        await target.put_segment(n, _chunks(n.encode()))
    b1, b2, b3 = (new_id("backup", now_ms=t) for t in (1000, 2000, 3000))
    await target.put_manifest(b1, b"1", [shared_seg, old_only])
    await target.put_manifest(b2, b"2", [shared_seg])
    await target.put_manifest(b3, b"3", [shared_seg])
    result = await target.prune(2)
    assert result.manifests == (b1,) and result.segments == 2
    assert [m.backup_id for m in await target.list_manifests()] == [b2, b3]
    assert await target.have_segments([shared_seg, old_only, debris]) == {shared_seg: 64}
    again = await target.prune(2)
    assert again.manifests == () and again.segments == 0
    with pytest.raises(ValueError):
        await target.prune(0)


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


async def _chain(target: BackupTarget) -> dict[str, tuple[str, str]]:
    """Two days of points with increments between them: each backup's id and the
    one segment only it names."""
    out: dict[str, tuple[str, str]] = {}
    for label, kind, t in (
        ("p1", "backup", 1000), ("i1a", "increment", 1100), ("i1b", "increment", 1200),
        ("p2", "backup", 2000), ("i2a", "increment", 2100),
        ("p3", "backup", 3000), ("i3a", "increment", 3100), ("i3b", "increment", 3200),
    ):  # fmt: skip
        seg = _name()
        await target.put_segment(seg, _chunks(seg.encode()))
        backup = new_id(kind, now_ms=t)
        await target.put_manifest(backup, label.encode(), [seg])
        out[label] = (backup, seg)
    return out


async def test_prune_keeps_points_and_the_increments_after_them(target: BackupTarget) -> None:
    made = await _chain(target)
    listed = [m.backup_id for m in await target.list_manifests()]
    # Points and increments sort by time together, though their prefixes differ.
    assert listed == [b for b, _ in made.values()]
    assert [m.increment for m in await target.list_manifests()] == [
        False, True, True, False, True, False, True, True,
    ]  # fmt: skip
    result = await target.prune(2)
    gone = {"p1", "i1a", "i1b"}
    assert set(result.manifests) == {made[k][0] for k in gone} and result.segments == 3
    assert [m.backup_id for m in await target.list_manifests()] == [
        b for k, (b, _) in made.items() if k not in gone
    ]
    segments = [s for _, s in made.values()]
    assert set(await target.have_segments(segments)) == {
        s for k, (_, s) in made.items() if k not in gone
    }
    # Keep one: the newest point and the increments after it.
    await target.prune(1)
    assert [m.backup_id for m in await target.list_manifests()] == [
        made["p3"][0], made["i3a"][0], made["i3b"][0],
    ]  # fmt: skip


def test_kept_by_points_before_any_point_keeps_everything() -> None:
    a, b = new_id("increment", now_ms=1), new_id("increment", now_ms=2)
    assert kept_by_points([a, b], 1) == ([a, b], [])
    p = new_id("backup", now_ms=3)
    assert kept_by_points([a, b, p], 1) == ([p], [a, b])
