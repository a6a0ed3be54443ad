"""shared.backup_folder: segments become durable and visible at the commit, in one batch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared.backup_folder import FolderTarget
from shared.backup_target import StoreTarget
from shared.errors import InvalidState
from shared.ids import new_id
from shared.store.folder import FolderStore

ROOT = Path(__file__).resolve().parents[2]


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def _read(target: StoreTarget, name: str) -> bytes:
    return b"".join([c async for c in target.get_segment(name)])


async def test_segments_appear_at_the_commit_in_the_folder_store_format(tmp_path: Path) -> None:
    target = FolderTarget(FolderStore(tmp_path / "t"))
    a, b = os.urandom(32).hex(), os.urandom(32).hex()
    await target.put_segment(a, _chunks(b"one", b"two"))
    await target.put_segment(b, _chunks(b"x" * 5000))
    assert await target.have_segments([a, b]) == {}, "nothing is visible before the commit"
    backup = new_id("backup")
    await target.put_manifest(backup, b"sealed", [a, b])
    # A plain StoreTarget over the same folder (a restore, a prune) reads them.
    plain = StoreTarget(FolderStore(tmp_path / "t"))
    assert await plain.have_segments([a, b]) == {a: 6, b: 5000}
    missing = os.urandom(32).hex()
    assert await target.have_segments([a, b, missing]) == {a: 6, b: 5000}
    assert await _read(plain, a) == b"onetwo"
    assert await plain.get_manifest(backup) == b"sealed"
    # Create-once: a second put of a stored name keeps the stored bytes.
    await target.put_segment(a, _chunks(b"other"))
    await target.flush()
    assert await _read(plain, a) == b"onetwo"
    leftovers = [p.name for p in (tmp_path / "t" / "segments").iterdir()]
    assert sorted(leftovers) == sorted([a, b]), "no temp file is left behind"


_CRASH = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from shared.backup_folder import FolderTarget
    from shared.store.folder import FolderStore

    async def chunks(data):
        yield data

    async def main():
        target = FolderTarget(FolderStore(sys.argv[1]))
        for i in range(20):
            await target.put_segment(f"{i:064x}", chunks(os.urandom(50_000)))
        if sys.argv[2] == "after":
            await target.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(main())
    """
)


def _killed(root: Path, when: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH, str(root), when], cwd=ROOT, capture_output=True, timeout=60
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]


async def test_a_crash_before_the_commit_leaves_no_segment(tmp_path: Path) -> None:
    root = tmp_path / "t"
    _killed(root, "before")
    names = [f"{i:064x}" for i in range(20)]
    assert await StoreTarget(FolderStore(root)).have_segments(names) == {}
    files = [p.name for p in (root / "segments").iterdir()]
    assert len(files) == 20 and all(f.startswith(".") and f.endswith(".tmp") for f in files), (
        "only temp files, which the store's sweep removes"
    )


async def test_a_crash_after_the_flush_leaves_whole_segments(tmp_path: Path) -> None:
    root = tmp_path / "t"
    _killed(root, "after")
    target = StoreTarget(FolderStore(root))
    names = [f"{i:064x}" for i in range(20)]
    assert await target.have_segments(names) == dict.fromkeys(names, 50_000)
    for name in names:
        # get_segment checks the header's SHA-256 against the bytes read.
        assert len(await _read(target, name)) == 50_000


async def test_a_folder_gone_is_named_not_listed_as_empty(tmp_path: Path) -> None:
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    name = os.urandom(32).hex()
    await target.put_segment(name, _chunks(b"one"))
    await target.put_manifest(new_id("backup"), b"sealed", [name])
    root.rename(tmp_path / "moved")
    with pytest.raises(InvalidState, match=f"backup folder {root}: gone"):
        await target.list_manifests()
    with pytest.raises(InvalidState, match="gone"):
        await target.put_segment(os.urandom(32).hex(), _chunks(b"two"))
    root.write_text("a file now")
    with pytest.raises(InvalidState, match="gone"):
        await target.put_manifest(new_id("backup"), b"sealed", [])
    root.unlink()
    (tmp_path / "moved").rename(root)
    assert len(await target.list_manifests()) == 1


async def test_a_segment_put_to_replace_is_written_over_the_stored_one(tmp_path: Path) -> None:
    target = FolderTarget(FolderStore(tmp_path / "t"))
    name = os.urandom(32).hex()
    await target.put_segment(name, _chunks(b"bad"))
    await target.put_manifest(new_id("backup"), b"sealed", [name])
    await target.put_segment(name, _chunks(b"kept?"))
    await target.put_segment(name, _chunks(b"good"), replace=True)
    await target.put_manifest(new_id("backup"), b"sealed", [name])
    assert await _read(target, name) == b"good"


async def test_prune_by_kind_in_the_folder_target(tmp_path: Path) -> None:
    """A folder target (packs) prunes increments with their point, as every target does."""
    target = FolderTarget(FolderStore(tmp_path / "t"))
    made = []
    for kind, t in (("backup", 1000), ("increment", 1500), ("backup", 2000), ("increment", 2500)):
        seg = os.urandom(32).hex()
        await target.put_segment(seg, _chunks(seg.encode()))
        backup = new_id(kind, now_ms=t)
        await target.put_manifest(backup, b"sealed", [seg])
        made.append((backup, seg))
    result = await target.prune(1)
    assert set(result.manifests) == {made[0][0], made[1][0]} and result.segments == 2
    assert [m.backup_id for m in await target.list_manifests()] == [made[2][0], made[3][0]]
    assert set(await target.have_segments([s for _, s in made])) == {made[2][1], made[3][1]}
