"""shared.backup_packs and a folder target's packs: written by workers, published at
the commit, read by name, pruned (repacked) without ever losing a kept segment."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared.backup_folder import FolderTarget
from shared.backup_packs import (
    INDEX_SUFFIX,
    PackedSegment,
    PackEntry,
    PackWriter,
    decode_index,
    encode_index,
    is_pack_id,
    temp_pack_id,
)
from shared.errors import IntegrityError, NotFound
from shared.ids import new_id
from shared.object_file import HEADER_LEN, PendingObject
from shared.store.folder import FolderStore

ROOT = Path(__file__).resolve().parents[2]


def _name() -> str:
    return os.urandom(32).hex()


def _packs(root: Path) -> list[str]:
    """Published pack ids (a pack file with its index)."""
    files = {p.name for p in (root / "packs").iterdir()}
    return sorted(f for f in files if is_pack_id(f) and f + INDEX_SUFFIX in files)


def _files(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "packs").iterdir())


async def _read(target: FolderTarget, name: str) -> bytes:
    return b"".join([c async for c in target.get_segment(name)])


async def _backup(
    target: FolderTarget, segments: dict[str, bytes], *, limit: int = 1 << 20
) -> list[str]:
    """One backup whose segments a worker packs (as machine.backups.workers does)."""
    writer = PackWriter(target.pack_folder(), limit=limit)
    have = await target.have_segments(segments)
    for name, data in segments.items():
        placed = writer.add([data[:7], data[7:]])
        target.add_packed(name, placed, keep=name not in have)
    writer.close()
    backup = new_id("backup")
    await target.put_manifest(backup, b"sealed", list(segments))
    return [backup]


async def test_packed_segments_appear_at_the_commit_and_read_by_name(tmp_path: Path) -> None:
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    segments = {_name(): os.urandom(3000 + i) for i in range(5)}
    writer = PackWriter(target.pack_folder(), limit=7000)
    for name, data in segments.items():
        target.add_packed(name, writer.add([data]), keep=True)
    writer.close()
    assert await target.have_segments(segments) == {}, "nothing is visible before the commit"
    assert _packs(root) == []
    await target.put_manifest(new_id("backup"), b"sealed", list(segments))
    # A pack is closed at the segment that takes it past the limit: 3 + 2.
    assert len(_packs(root)) == 2
    assert len(_files(root)) == 4, "no temp file is left behind"
    again = FolderTarget(FolderStore(root))  # another reader: a restore, a prune
    assert await again.have_segments(segments) == {n: len(d) for n, d in segments.items()}
    for name, data in segments.items():
        assert await _read(again, name) == data
        with again.segment_reader(name) as f:
            assert f.read() == data
    # Each pack is a folder store object (its header names its content's SHA-256).
    listed = [i async for i in FolderStore(root).list("packs/")]
    assert len(listed) == 4


async def test_a_segment_not_kept_is_not_indexed_and_an_empty_pack_goes(tmp_path: Path) -> None:
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    kept, dropped = _name(), _name()
    writer = PackWriter(target.pack_folder())
    target.add_packed(kept, writer.add([b"k" * 100]), keep=True)
    target.add_packed(dropped, writer.add([b"d" * 100]), keep=False)
    other = PackWriter(target.pack_folder())
    target.add_packed(_name(), other.add([b"x" * 10]), keep=False)
    writer.close()
    other.close()
    await target.flush()
    assert len(_packs(root)) == 1 and len(_files(root)) == 2, _files(root)
    assert await target.have_segments([kept, dropped]) == {kept: 100}


async def test_a_failed_backup_leaves_no_pack_behind(tmp_path: Path) -> None:
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    writer = PackWriter(target.pack_folder(), limit=150)
    target.add_packed(_name(), writer.add([b"a" * 200]), keep=True)
    writer.add([b"b" * 100])  # a segment whose answer never reached the daemon
    writer.close()
    assert len(_files(root)) == 2
    target.discard_pending()
    assert _files(root) == []
    await target.flush()
    assert _files(root) == []


async def test_a_pack_its_worker_did_not_finish_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    writer = PackWriter(target.pack_folder())
    target.add_packed(_name(), writer.add([b"a" * 200]), keep=True)
    try:
        with pytest.raises(IntegrityError, match="did not finish"):
            await target.flush()
    finally:
        writer.discard()
    assert _files(root) == []


async def test_prune_keeps_whole_packs_deletes_dead_ones_and_repacks_the_rest(
    tmp_path: Path,
) -> None:
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    a = {_name(): os.urandom(500) for _ in range(3)}  # one pack, all kept
    b = {_name(): os.urandom(500) for _ in range(3)}  # one pack, none kept
    c = {_name(): os.urandom(500) for _ in range(3)}  # one pack, one kept
    for group in (a, b, c):
        await _backup(target, group)
    assert len(_packs(root)) == 3
    (keep_c,) = list(c)[:1]
    named = set(a) | {keep_c}
    removed = await target._prune_segments(named)
    assert removed == 5
    packs = _packs(root)
    assert len(packs) == 2 and len(_files(root)) == 4, _files(root)
    have = await FolderTarget(FolderStore(root)).have_segments([*a, *b, *c])
    assert have == {n: 500 for n in named}
    for name in named:
        assert await _read(target, name) == (a | c)[name]
    # The repacked pack holds exactly the kept segment.
    assert os.stat(root / "packs" / packs[-1]).st_size == HEADER_LEN + 500
    # Nothing left to do: a second prune changes nothing.
    assert await target._prune_segments(named) == 0
    assert _packs(root) == packs


async def test_bytes_no_index_names_are_pruned_away(tmp_path: Path) -> None:
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    kept = _name()
    writer = PackWriter(target.pack_folder())
    target.add_packed(kept, writer.add([b"k" * 300]), keep=True)
    target.add_packed(_name(), writer.add([b"s" * 300]), keep=False)  # stored already
    writer.close()
    await target.flush()
    (pack,) = _packs(root)
    assert os.stat(root / "packs" / pack).st_size == HEADER_LEN + 600
    assert await target._prune_segments({kept}) == 0
    (repacked,) = _packs(root)
    assert repacked != pack and os.stat(root / "packs" / repacked).st_size == HEADER_LEN + 300
    assert await _read(target, kept) == b"k" * 300


async def test_two_copies_of_a_segment_the_newer_is_read_and_the_older_pruned(
    tmp_path: Path,
) -> None:
    """As a crash between a repack's publish and its deletes leaves them, or a
    segment sent again over a damaged copy."""
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    name = _name()
    await _backup(target, {name: b"old copy"})
    writer = PackWriter(target.pack_folder())
    target.add_packed(name, writer.add([b"new copy"]), keep=True)  # replace=True
    writer.close()
    await target.flush()
    assert len(_packs(root)) == 2
    assert await _read(FolderTarget(FolderStore(root)), name) == b"new copy"
    assert await target._prune_segments({name}) == 0
    assert len(_packs(root)) == 1
    assert await _read(FolderTarget(FolderStore(root)), name) == b"new copy"


async def test_a_pack_without_its_index_is_never_read_and_pruned_as_debris(
    tmp_path: Path,
) -> None:
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    lone, orphan_index = _name(), _name()
    await _backup(target, {lone: b"one"})
    await _backup(target, {orphan_index: b"two"})
    first, second = _packs(root)
    (root / "packs" / (first + INDEX_SUFFIX)).unlink()  # a crash between a prune's deletes
    (root / "packs" / second).unlink()  # damage: an index alone
    fresh = FolderTarget(FolderStore(root))
    assert await fresh.have_segments([lone, orphan_index]) == {}
    with pytest.raises(NotFound):
        await _read(fresh, lone)
    assert await fresh._prune_segments({lone, orphan_index}) == 0
    assert _files(root) == []


@pytest.mark.parametrize("damage", ["flipped", "version"])
async def test_an_index_that_does_not_read_leaves_every_pack_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """A flipped hex digit of a name (the index is still valid JSON: its checksum
    catches it), or an index of an unknown version (checksum right): the pack's
    segments read as not stored, and a prune, missing a kept segment, rewrites
    no pack, not even one it could otherwise drop bytes from."""
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    name, other = _name(), _name()
    await _backup(target, {name: b"segment"})
    writer = PackWriter(target.pack_folder())
    target.add_packed(other, writer.add([b"other"]), keep=True)
    target.add_packed(_name(), writer.add([b"not kept"]), keep=False)
    writer.close()
    await target.flush()
    pack, second = _packs(root)
    index = root / "packs" / (pack + INDEX_SUFFIX)
    raw = index.read_bytes()
    if damage == "flipped":
        digit = raw.index(name[5].encode(), HEADER_LEN + raw[HEADER_LEN:].index(name.encode()) + 5)
        index.write_bytes(
            raw[:digit] + (b"0" if raw[digit : digit + 1] != b"0" else b"1") + raw[digit + 1 :]
        )
        why = "does not match its checksum"
    else:
        obj = PendingObject.create("packs/x", index)
        obj.write(raw[HEADER_LEN:].replace(b'"version":1', b'"version":9'))
        obj.close(sync=True)
        os.replace(obj.temp, index)
        why = "unknown version"
    fresh = FolderTarget(FolderStore(root))
    with caplog.at_level(logging.WARNING):
        assert await fresh.have_segments([name, other]) == {other: 5}
    assert f"backup pack {pack} left alone" in caplog.text and why in caplog.text
    before = _files(root)
    assert await fresh._prune_segments({name, other}) == 0
    assert _files(root) == before, "no pack deleted nor rewritten"
    assert "packs left as they are" in caplog.text


def test_an_index_is_checked_against_its_pack() -> None:
    pack = "0" * 32
    name = _name()
    good = encode_index(10, [PackEntry(name, 0, 4), PackEntry(_name(), 4, 6)])
    assert [e.size for e in decode_index(good, pack, 10)] == [4, 6]

    def index(**body: object) -> bytes:
        return json.dumps({"version": 1, "size": 10, "segments": [], **body}).encode()

    cases = {
        b"not json": "not JSON",
        index(version=2): "unknown version",
        index(size=11): "names 11 bytes",
        index(segments={}): "lists no segments",
        index(segments=[["../x", 0, 4]]): "malformed entry",
        index(segments=[[name, 0, True]]): "malformed entry",
        index(segments=[[name, 8, 4]]): "outside the pack",
        index(segments=[[name, 0, 0]]): "outside the pack",
        index(segments=[[name, 0, 6], [name, 4, 2]]): "over another",
        index(segments=[[name, -1, 2]]): "outside the pack",
    }
    for data, why in cases.items():
        with pytest.raises(IntegrityError, match=why):
            decode_index(data, pack, 10)


def test_pack_ids_sort_by_age_and_temp_names_are_recognised(tmp_path: Path) -> None:
    writer = PackWriter(tmp_path, limit=1)
    first = writer.add([b"a"])
    second = writer.add([b"b"])
    assert first.pack < second.pack and is_pack_id(first.pack)
    assert temp_pack_id(first.temp) == first.pack
    assert temp_pack_id("." + first.pack + ".tmp") is None
    assert temp_pack_id("../" + first.temp) is None


_PRUNE = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys
    from shared.backup_folder import FolderTarget
    from shared.store.folder import FolderStore

    steps = 0

    def step():
        global steps
        steps += 1
        if steps == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)

    target = FolderTarget(FolderStore(sys.argv[1]), after_delete=step)
    asyncio.run(target._prune_segments(set(json.loads(sys.argv[3]))))
    """
)


@pytest.mark.parametrize("kill_after", [1, 2, 3, 4, 5])
async def test_sigkill_at_each_step_of_a_pack_prune_loses_no_kept_segment(
    tmp_path: Path, kill_after: int
) -> None:
    """Three packs: one all kept, one all dropped, one with one segment kept. The
    prune deletes the second (index, pack), repacks the third (publish), then
    deletes it (index, pack): a real process killed after each of those five steps
    leaves every kept segment readable, and the next prune ends where one
    uninterrupted prune does."""
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    groups = [{_name(): os.urandom(700 + i) for i in range(3)} for _ in range(3)]
    for group in groups:
        await _backup(target, group)
    everything = groups[0] | groups[1] | groups[2]
    named = set(groups[0]) | set(list(groups[2])[:1])
    proc = subprocess.run(
        [sys.executable, "-c", _PRUNE, str(root), str(kill_after), json.dumps(sorted(named))],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    after = FolderTarget(FolderStore(root))
    have = await after.have_segments(everything)
    assert named <= have.keys(), f"a kept segment lost after step {kill_after}"
    for name in named:
        assert await _read(after, name) == everything[name]
    await after._prune_segments(named)
    assert await FolderTarget(FolderStore(root)).have_segments(everything) == {
        n: len(everything[n]) for n in named
    }
    assert len(_packs(root)) == 2 and len(_files(root)) == 4, _files(root)


async def test_a_pruned_pack_temp_goes_once_stale(tmp_path: Path) -> None:
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    writer = PackWriter(target.pack_folder())
    fresh = writer.add([b"a"])
    writer.close()
    other = PackWriter(target.pack_folder())
    old = other.add([b"b"])
    other.close()
    hours_ago = time.time() - 7200
    os.utime(root / "packs" / old.temp, (hours_ago, hours_ago))
    await target._prune_segments(set())
    assert _files(root) == [fresh.temp], "a backup killed an hour ago left it; a fresh one stays"


async def test_a_packed_segment_sent_again_over_a_damaged_copy_is_read_from_then_on(
    tmp_path: Path,
) -> None:
    """The next backup sends a damaged segment again (``replace``), usually in the
    daemon's process: it goes into a new pack, which is read before the old."""
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    name = _name()
    await _backup(target, {name: b"damaged copy"})

    async def chunks() -> AsyncIterator[bytes]:
        yield b"good "
        yield b"copy"

    await target.put_segment(name, chunks(), replace=True)
    await target.flush()
    assert len(_packs(root)) == 2 and not (root / "segments").exists()
    assert await _read(FolderTarget(FolderStore(root)), name) == b"good copy"
    assert await target.have_segments([name]) == {name: 9}
    await target._prune_segments({name})
    assert len(_packs(root)) == 1
    assert await _read(FolderTarget(FolderStore(root)), name) == b"good copy"


async def test_a_pack_made_after_the_clock_stepped_back_is_still_the_newer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment sent again over a damaged copy with the clock an hour behind the
    pack holding that copy: the new pack's id still sorts after it, so the new copy
    is read, and the prune keeps it rather than the damaged one."""
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    name = _name()
    await _backup(target, {name: b"damaged copy"})
    behind = time.time_ns() - 3600 * 10**9
    monkeypatch.setattr(time, "time_ns", lambda: behind)

    async def chunks() -> AsyncIterator[bytes]:
        yield b"good copy"

    await target.put_segment(name, chunks(), replace=True)
    await target.flush()
    first, second = _packs(root)
    assert int(second[:16], 16) == int(first[:16], 16) + 1
    assert await _read(FolderTarget(FolderStore(root)), name) == b"good copy"
    await target._prune_segments({name})
    assert _packs(root) == [second]
    assert await _read(FolderTarget(FolderStore(root)), name) == b"good copy"


async def test_a_segment_repacked_by_another_reader_is_found_in_its_new_pack(
    tmp_path: Path,
) -> None:
    root = tmp_path / "t"
    writer_side = FolderTarget(FolderStore(root))
    kept, dropped = _name(), _name()
    await _backup(writer_side, {kept: b"kept bytes", dropped: b"dropped"})
    reader = FolderTarget(FolderStore(root))  # a restore with --from this folder
    assert await reader.have_segments([kept]) == {kept: 10}  # its lookup, cached
    await writer_side._prune_segments({kept})  # the daemon's prune repacks meanwhile
    with reader.segment_reader(kept) as f:
        assert f.read() == b"kept bytes"
    assert await _read(reader, kept) == b"kept bytes"


async def test_an_index_temp_left_by_a_kill_goes_once_stale(tmp_path: Path) -> None:
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    await _backup(target, {_name(): b"x"})
    (pack,) = _packs(root)
    temp = root / "packs" / f".{pack}.index.{'ab' * 6}.tmp"
    temp.write_bytes(b"half an index")
    hours_ago = time.time() - 7200
    os.utime(temp, (hours_ago, hours_ago))
    await target._prune_segments(set())
    assert not temp.exists()


async def test_damaged_packed_segments_sent_again_at_once_all_go_into_the_own_pack(
    tmp_path: Path,
) -> None:
    """A backup sends several segments again over damaged packed copies, in the
    daemon's process, up to eight at a time (each in its own thread)."""
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    names = [_name() for _ in range(16)]
    await _backup(target, {n: b"damaged " + n.encode() for n in names})

    async def chunks(name: str) -> AsyncIterator[bytes]:
        yield b"good "
        yield name.encode()

    await asyncio.gather(*(target.put_segment(n, chunks(n), replace=True) for n in names))
    await target.flush()
    fresh = FolderTarget(FolderStore(root))
    for name in names:
        assert await _read(fresh, name) == b"good " + name.encode()


async def test_no_pack_is_rewritten_while_an_index_does_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A damaged copy in an old pack that also holds dropped segments, the good copy
    sent again into a newer pack whose index fails to read for a moment (too many
    open files, say): the prune must not copy the damaged one above the good one."""
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    x, dropped = _name(), _name()
    await _backup(target, {x: b"damaged", dropped: b"dropped"})
    writer = PackWriter(target.pack_folder())
    target.add_packed(x, writer.add([b"good"]), keep=True)
    writer.close()
    await target.flush()
    old, new = _packs(root)
    real = FolderTarget._read_index

    def failing(self: FolderTarget, pack: str) -> object:
        if pack == new:
            raise OSError(24, "Too many open files")
        return real(self, pack)

    pruner = FolderTarget(FolderStore(root))
    monkeypatch.setattr(FolderTarget, "_read_index", failing)
    assert await pruner._prune_segments({x}) == 0
    assert _packs(root) == [old, new], "nothing rewritten"
    monkeypatch.setattr(FolderTarget, "_read_index", real)
    assert await pruner._prune_segments({x}) == 1
    assert _packs(root) == [new]
    assert await _read(FolderTarget(FolderStore(root)), x) == b"good"


async def test_a_flush_removes_this_backups_unused_pack_temps_only(tmp_path: Path) -> None:
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    await _backup(target, {_name(): b"first"})
    # A backup killed before its commit (a daemon since restarted: a new target).
    earlier = PackWriter(FolderTarget(FolderStore(root)).pack_folder())
    left = earlier.add([b"left by a kill"])
    earlier.close()
    ours = PackWriter(target.pack_folder())
    unused = ours.add([b"answer lost"])  # written, never handed over
    ours.close()
    kept = PackWriter(target.pack_folder())
    target.add_packed(_name(), kept.add([b"kept"]), keep=True)
    kept.close()
    assert unused.pack > left.pack
    await target.flush()
    temps = [n for n in _files(root) if n.endswith(".tmp")]
    assert temps == [left.temp], "another backup's temp waits for the stale sweep"
    assert len(_packs(root)) == 2


def test_a_new_pack_sorts_after_packs_being_written(tmp_path: Path) -> None:
    ahead = "ffff" + "0" * 28  # a temp of a pack made with the clock far ahead
    (tmp_path / f".{ahead}.{'ab' * 6}.tmp").write_bytes(b"")
    writer = PackWriter(tmp_path)
    placed = writer.add([b"x"])
    writer.close()
    assert placed.pack > ahead


async def test_a_pack_whose_index_would_not_read_fails_the_commit(tmp_path: Path) -> None:
    root = tmp_path / "t"
    target = FolderTarget(FolderStore(root))
    writer = PackWriter(target.pack_folder())
    placed = writer.add([b"twelve bytes"])
    writer.close()
    beyond = PackedSegment(placed.pack, placed.temp, placed.offset + 8, placed.size)
    target.add_packed(_name(), beyond, keep=True)
    with pytest.raises(IntegrityError, match="outside the pack"):
        await target.flush()
    assert _files(root) == []


def test_a_pack_another_process_wrote_is_fsynced_again_when_published(tmp_path: Path) -> None:
    obj = PendingObject.create("packs/x", tmp_path / "x")
    obj.write(b"content")
    obj.close(sync=True)
    adopted = PendingObject.adopt("packs/x", tmp_path / "x", obj.temp)
    assert adopted.synced is False, "publish fsyncs it: its writer's fsync is not proven"


_FLUSH = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from shared.backup_folder import FolderTarget
    from shared.backup_packs import PackWriter
    from shared.store.folder import FolderStore

    renames = 0
    real = os.replace

    def replace(src, dst):
        global renames
        real(src, dst)
        renames += 1
        if renames == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)

    async def main():
        target = FolderTarget(FolderStore(sys.argv[1]))
        writer = PackWriter(target.pack_folder())
        for name in sys.argv[3:]:
            target.add_packed(name, writer.add([name.encode()]), keep=True)
        writer.close()
        os.replace = replace
        await target.flush()

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("kill_after", [1, 2])
async def test_sigkill_between_a_packs_renames_leaves_no_half_pack(
    tmp_path: Path, kill_after: int
) -> None:
    """A real process killed after the pack's rename (its index still a temp file),
    or after both (the manifest, the commit point, never written): either way no
    backup names the pack, and the next prune leaves no pack behind."""
    root = tmp_path / "t"
    names = [_name(), _name()]
    proc = subprocess.run(
        [sys.executable, "-c", _FLUSH, str(root), str(kill_after), *names],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    target = FolderTarget(FolderStore(root))
    have = await target.have_segments(names)
    assert have == ({} if kill_after == 1 else {n: 64 for n in names}), (
        "a pack counts with its index"
    )
    await target._prune_segments(set())
    assert [f for f in _files(root) if not f.endswith(".tmp")] == []
