"""machine.backups.engine: the engine over a fake source (unit) and a real folder target."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from machine.backups.engine import BackupEngine, validate_keep
from machine.backups.source import AgentItem
from machine.backups.targets.control_plane import newest_authentic
from machine.backups.workers.segment_workers import MadeSegment
from machine.formats.backup import SegmentCompressor, encrypt_segment, segment_key
from shared.backup_folder import FolderTarget
from shared.backup_packs import PackWriter
from shared.backup_target import StoreTarget, manifest_key
from shared.crypto import BoxKeyPair
from shared.errors import IntegrityError, InvalidArgument, NotFound, StoreUnavailable
from shared.ids import id_time_ms, new_id
from shared.store.folder import FolderStore

MACHINE = new_id("machine")


class FakeSource:
    """Agents as byte strings in memory; bumping one changes its marker."""

    def __init__(self, tmp: Path, agents: int) -> None:
        self.data: dict[str, bytes] = {}
        self.version: dict[str, int] = {}
        self.reads = 0
        for i in range(agents):
            agent = new_id("agent")
            self.data[agent] = f"SECRET-CONVERSATION-{i} ".encode() * 2000 + os.urandom(64)
            self.version[agent] = 1
        self.att_dir = tmp / "att"
        self.att_dir.mkdir()
        blob = b"ATTACHMENT-BYTES" * 100
        self.attachment = ("ab" * 32, self.att_dir / ("ab" * 32))
        self.attachment[1].write_bytes(blob)

    def change(self, agent: str) -> None:
        self.data[agent] += b" one more turn"
        self.version[agent] += 1

    async def agents(self) -> list[AgentItem]:
        return [AgentItem(a, str(v)) for a, v in self.version.items()]

    async def write_agent(self, agent_id: str, out: BinaryIO) -> None:
        self.reads += 1
        out.write(self.data[agent_id])

    def segment_maker(
        self, *, naming_key: bytes, work_dir: Path, agents: int, pack_folder: Path | None = None
    ) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext(None)

    async def attachments(self) -> list[tuple[str, Path]]:
        return [self.attachment]

    async def usage(self) -> list[dict[str, Any]]:
        return [{"run_id": new_id("run"), "input_tokens": 5}]

    async def erased(self) -> list[dict[str, Any]]:
        return [{"agent_id": new_id("agent"), "erased_at": 1.0}]

    async def settings(self) -> dict[str, str]:
        return {"backup_keep": "2"}


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        self.now += 60
        return self.now


@pytest.fixture
def parts(tmp_path: Path) -> dict[str, Any]:
    machine_key, recovery = BoxKeyPair.generate(), BoxKeyPair.generate()
    store = FolderStore(tmp_path / "target")
    source = FakeSource(tmp_path, 5)
    clock = Clock()
    engine = BackupEngine(
        source,
        StoreTarget(store),
        machine_id=MACHINE,
        naming_key=os.urandom(32),
        recipients=[machine_key.public_key, recovery.public_key],
        keypair=machine_key,
        work_dir=tmp_path / "work",
        keep=2,
        clock=clock,
    )
    return {
        "engine": engine,
        "clock": clock,
        "source": source,
        "store": store,
        "root": tmp_path / "target",
        "recovery": recovery,
        "tmp": tmp_path,
    }


async def test_full_backup_fetches_byte_equal_with_either_key(parts: dict[str, Any]) -> None:
    engine, source = parts["engine"], parts["source"]
    result = await engine.backup_now()
    assert (result.segments, result.uploaded) == (6, 6)
    for i, key in enumerate([None, parts["recovery"]]):
        fetched = await engine.fetch(result.backup_id, parts["tmp"] / f"f{i}", key)
        assert {a: p.read_bytes() for a, p in fetched.agent_files.items()} == source.data
        sha, path = source.attachment
        assert fetched.attachment_files[sha].read_bytes() == path.read_bytes()
        assert fetched.manifest.settings == {"backup_keep": "2"}
        assert len(fetched.manifest.erased) == 1 and len(fetched.manifest.usage) == 1
    verified = await engine.verify(result.backup_id, parts["recovery"])
    assert verified.segments == 6 and verified.plain_bytes == result.plain_bytes


async def test_nothing_in_the_target_reads_as_plaintext(parts: dict[str, Any]) -> None:
    await parts["engine"].backup_now()
    root = parts["root"]
    blobs = [p.read_bytes() for p in root.rglob("*") if p.is_file()]
    segments, manifests = list((root / "segments").iterdir()), list((root / "manifests").iterdir())
    assert (len(segments), len(manifests)) == (6, 2), "six segments, a manifest and its names"
    for blob in blobs:
        assert b"SECRET-CONVERSATION" not in blob
        assert b"ATTACHMENT-BYTES" not in blob
        for agent in parts["source"].data:
            assert agent.encode() not in blob


async def test_unchanged_agents_are_neither_read_nor_uploaded(parts: dict[str, Any]) -> None:
    engine, source = parts["engine"], parts["source"]
    await engine.backup_now()
    reads = source.reads
    again = await engine.backup_now()
    assert (again.uploaded, source.reads - reads) == (0, 0)
    source.change(next(iter(source.data)))
    third = await engine.backup_now()
    assert third.uploaded == 1 and source.reads - reads == 1
    assert third.uploaded_bytes < third.stored_bytes / 3


async def test_lost_cache_still_reuses_segments_by_name(parts: dict[str, Any]) -> None:
    engine = parts["engine"]
    await engine.backup_now()
    (parts["tmp"] / "work" / "segment-cache.json").unlink()
    assert (await engine.backup_now()).uploaded == 0


async def test_segment_lost_from_target_is_sent_again(parts: dict[str, Any]) -> None:
    engine, root = parts["engine"], parts["root"]
    first = await engine.backup_now()
    victim = next((root / "segments").iterdir())
    victim.unlink()
    second = await engine.backup_now()
    assert second.uploaded == 1
    await engine.verify(second.backup_id)
    # Same content, same name: the first backup is whole again too.
    await engine.verify(first.backup_id)


async def test_missing_segment_is_named(parts: dict[str, Any]) -> None:
    engine, root = parts["engine"], parts["root"]
    result = await engine.backup_now()
    next((root / "segments").iterdir()).unlink()
    with pytest.raises(IntegrityError, match="segment .*: missing from where the backup is stored"):
        await engine.verify(result.backup_id)


async def test_keep_two_prunes_the_first_and_keeps_named_segments(parts: dict[str, Any]) -> None:
    engine, source, root = parts["engine"], parts["source"], parts["root"]
    first = await engine.backup_now()
    source.change(next(iter(source.data)))
    second = await engine.backup_now()
    source.change(next(iter(source.data)))
    third = await engine.backup_now()
    assert third.pruned is not None and third.pruned.manifests == (first.backup_id,)
    assert third.pruned.segments == 1, "only the first backup's old version of the agent"
    assert [i.backup_id for i, _ in await engine.list()] == [second.backup_id, third.backup_id]
    for b in (second, third):
        await engine.verify(b.backup_id)
    assert len(list((root / "segments").iterdir())) == 7


async def test_a_clock_behind_the_newest_backup_never_prunes_the_new_one(
    parts: dict[str, Any],
) -> None:
    engine, source = parts["engine"], parts["source"]
    first = await engine.backup_now()
    second = await engine.backup_now()
    parts["clock"].now -= 86_400  # the clock stepped back a day (it had run ahead)
    source.change(next(iter(source.data)))
    third = await engine.backup_now()
    # Numbered after the newest kept, so keep = 2 drops the oldest, not itself.
    assert third.backup_id > second.backup_id
    assert third.pruned is not None and third.pruned.manifests == (first.backup_id,)
    assert [i.backup_id for i, _ in await engine.list()] == [second.backup_id, third.backup_id]
    await engine.verify(third.backup_id)


async def test_a_planted_far_future_backup_id_does_not_number_the_next_backups(
    parts: dict[str, Any],
) -> None:
    engine, store = parts["engine"], parts["store"]
    first = await engine.backup_now()
    # The last id time there is (2**50 - 1 ms), planted without the keys: numbering
    # after it would wrap every later id to the start of time.
    planted = "bk_" + "z" * 10 + "0" * 16
    await store.put(manifest_key(planted), b"planted")
    second = await engine.backup_now()
    assert first.backup_id < second.backup_id < planted
    assert id_time_ms(second.backup_id) - id_time_ms(first.backup_id) < 3_600_000
    with pytest.raises(ValueError, match="outside the ids' range"):
        new_id("backup", now_ms=id_time_ms(planted) + 1)


async def test_crash_mid_prune_leaves_kept_backups_restorable(
    parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, source = parts["engine"], parts["source"]
    await engine.backup_now()
    source.change(next(iter(source.data)))
    second = await engine.backup_now()
    source.change(next(iter(source.data)))

    store = parts["store"]
    real_delete = store.delete

    async def crash(key: str) -> None:
        if key.startswith("segments/"):
            raise RuntimeError("killed mid-prune")
        await real_delete(key)

    # Killed after the dropped manifest went, before any segment did.
    monkeypatch.setattr(store, "delete", crash)
    with pytest.raises(RuntimeError):
        await engine.backup_now()
    monkeypatch.undo()
    backups = [i.backup_id for i, _ in await engine.list()]
    assert len(backups) == 2 and backups[0] == second.backup_id
    for b in backups:
        await engine.verify(b)
    pruned = await engine.prune()
    assert pruned.segments == 1, "the orphan left by the crash goes at the next prune"


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
async def test_tampered_segments_refused(parts: dict[str, Any], damage: str) -> None:
    engine, root = parts["engine"], parts["root"]
    result = await engine.backup_now()
    seg_a, seg_b = sorted((root / "segments").iterdir())[:2]
    if damage == "flip":
        data = bytearray(seg_a.read_bytes())
        data[len(data) // 2] ^= 1
        seg_a.write_bytes(bytes(data))
    elif damage == "truncate":
        seg_a.write_bytes(seg_a.read_bytes()[:-50])
    else:
        seg_a.write_bytes(seg_b.read_bytes())
    with pytest.raises(IntegrityError):
        await engine.verify(result.backup_id)
    dest = parts["tmp"] / "fetch"
    with pytest.raises(IntegrityError):
        await engine.fetch(result.backup_id, dest)
    assert not dest.exists(), "a refused fetch leaves no staging folder"


async def test_wrong_key_and_foreign_manifest_refused(parts: dict[str, Any]) -> None:
    engine, root = parts["engine"], parts["root"]
    first = await engine.backup_now()
    second = await engine.backup_now()
    with pytest.raises(IntegrityError):
        await engine.verify(first.backup_id, BoxKeyPair.generate())
    manifests = root / "manifests"
    (manifests / f"{second.backup_id}.sealed").write_bytes(
        (manifests / f"{first.backup_id}.sealed").read_bytes()
    )
    with pytest.raises(IntegrityError):
        await engine.verify(second.backup_id)


@pytest.mark.parametrize("bad", [0, 11, -1, True, "3", 2.5])
def test_keep_bounds(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="backup_keep: must be a whole number from 1 to 10"):
        validate_keep(bad)


async def test_an_agent_erased_mid_backup_is_left_out_and_the_backup_goes_on(
    parts: dict[str, Any],
) -> None:
    engine, source = parts["engine"], parts["source"]
    gone = list(source.data)[2]
    write = source.write_agent

    async def erased_meanwhile(agent_id: str, out: BinaryIO) -> None:
        if agent_id == gone:
            raise NotFound("agent", agent_id)  # as the dump finds it once erased
        await write(agent_id, out)

    source.write_agent = erased_meanwhile  # type: ignore[method-assign]
    made = await engine.backup_now()
    manifest = await engine.open(made.backup_id)
    agents = {s.ref for s in manifest.segments if s.kind == "agent"}
    assert agents == set(source.data) - {gone}
    await engine.verify(made.backup_id)


async def test_a_target_sending_more_than_a_segment_holds_is_refused(
    parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, store = parts["engine"], parts["store"]
    made = await engine.backup_now()
    target = engine._target
    real = target.get_segment

    async def padded(name: str) -> AsyncIterator[bytes]:
        async for chunk in real(name):
            yield chunk
        # A hostile or broken target: more than any segment of its plaintext size
        # could take (a segment made again may be a little larger than recorded).
        yield b"\0" * (4 * 1024 * 1024)

    monkeypatch.setattr(target, "get_segment", padded)
    with pytest.raises(IntegrityError, match="longer than the .* bytes its backup names"):
        await engine.verify(made.backup_id)
    with pytest.raises(IntegrityError, match="longer than"):
        await engine.fetch(made.backup_id, parts["tmp"] / "fetch", decode_agents=False)
    assert not (parts["tmp"] / "fetch").exists()
    assert store is not None


async def test_two_verifies_of_a_large_segment_at_once_both_pass(parts: dict[str, Any]) -> None:
    engine, source = parts["engine"], parts["source"]
    big = next(iter(source.data))
    source.data[big] = os.urandom(6 * 1024 * 1024)  # stored past what is held in memory
    source.version[big] += 1
    made = await engine.backup_now()
    first, second = await asyncio.gather(
        engine.verify(made.backup_id), engine.verify(made.backup_id)
    )
    assert first.segments == second.segments == made.segments


@pytest.mark.parametrize("file_gone", [True, False])
async def test_an_attachment_whose_last_agent_was_erased_mid_backup_stays_out(
    parts: dict[str, Any], file_gone: bool
) -> None:
    engine, source = parts["engine"], parts["source"]
    sha, path = source.attachment
    write = source.write_agent

    async def erased_meanwhile(agent_id: str, out: BinaryIO) -> None:
        # The erasure scrubs the attachment no one names any more: its file goes
        # (or has not gone yet when the backup reads it).
        source.attachments = _none  # type: ignore[method-assign]
        if file_gone:
            path.unlink(missing_ok=True)
        await write(agent_id, out)

    async def _none() -> list[tuple[str, Path]]:
        return []

    source.write_agent = erased_meanwhile  # type: ignore[method-assign]
    made = await engine.backup_now()
    manifest = await engine.open(made.backup_id)
    assert sha not in {s.ref for s in manifest.segments}
    assert {s.ref for s in manifest.segments if s.kind == "agent"} == set(source.data)
    await engine.verify(made.backup_id)


async def test_a_repair_passes_over_newer_manifests_that_do_not_open(
    parts: dict[str, Any],
) -> None:
    engine, store, recovery = parts["engine"], parts["store"], parts["recovery"]
    first = await engine.backup_now()
    second = await engine.backup_now()
    # Two newer "backups": garbage, and the second one's sealed manifest written
    # again at a newer id (sealing binds the id: it does not open there).
    stored = await store.get(manifest_key(second.backup_id))
    later = [new_id("backup", now_ms=id_time_ms(second.backup_id) + n) for n in (1, 2)]
    await store.put(manifest_key(later[0]), stored)
    await store.put(manifest_key(later[1]), b"not a manifest")
    listed = await StoreTarget(store).list_manifests()
    assert [i.backup_id for i in listed] == [first.backup_id, second.backup_id, *later]
    chosen, refused = await newest_authentic(engine, listed, recovery)
    assert (chosen, refused) == (second.backup_id, [later[1], later[0]])
    # None opens: one error naming how many there were and why the newest failed.
    with pytest.raises(IntegrityError, match="none of the 2 backups"):
        await newest_authentic(engine, listed[2:], recovery)


async def test_a_listing_says_why_a_backup_does_not_open(parts: dict[str, Any]) -> None:
    engine, store = parts["engine"], parts["store"]
    made = await engine.backup_now()
    planted = new_id("backup", now_ms=id_time_ms(made.backup_id) + 1)
    await store.put(manifest_key(planted), b"not a manifest")
    other = BackupEngine(
        parts["source"],
        StoreTarget(store),
        machine_id=MACHINE,
        naming_key=os.urandom(32),
        recipients=[BoxKeyPair.generate().public_key],
        keypair=BoxKeyPair.generate(),
        work_dir=parts["tmp"] / "other",
        keep=2,
    )
    described = [(i.backup_id, m is not None, p) for i, m, p in await engine.list_described()]
    assert described[0] == (made.backup_id, True, "")
    assert described[1][:2] == (planted, False) and described[1][2].startswith("refused: ")
    theirs = [(m is None, p) for _, m, p in await other.list_described()]
    assert theirs[0] == (True, "another key")  # a genuine backup, sealed to other keys


@pytest.mark.parametrize("kind", ["store", "folder"])
async def test_a_segment_found_damaged_is_sent_again_by_the_next_backup(
    parts: dict[str, Any], kind: str
) -> None:
    """A flipped byte in a stored segment, seen by verify (the nightly restore
    check): the next backup does not reuse it by name but sends it again over
    the bad copy, so neither it nor the older backups naming it stay damaged."""
    engine, root, source = parts["engine"], parts["root"], parts["source"]
    if kind == "folder":  # batched, create-once publishing (a stand-alone machine's)
        keypair = BoxKeyPair.generate()
        engine = BackupEngine(
            source,
            FolderTarget(parts["store"]),
            machine_id=MACHINE,
            naming_key=os.urandom(32),
            recipients=[keypair.public_key],
            keypair=keypair,
            work_dir=parts["tmp"] / "work",
            keep=2,
            clock=parts["clock"],
        )
    first = await engine.backup_now()
    victim = sorted((root / "segments").iterdir())[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    # Unseen, the damage is reused: the target has a segment of that name.
    second = await engine.backup_now()
    assert second.uploaded == 0
    with pytest.raises(IntegrityError):
        await engine.verify(second.backup_id)
    reads = source.reads
    third = await engine.backup_now()
    assert third.uploaded == 1 and source.reads - reads <= 1
    for backup in (third.backup_id, second.backup_id):
        await engine.verify(backup)
    assert (await engine.backup_now()).uploaded == 0, "mended once, then reused again"
    with pytest.raises(NotFound):
        await engine.verify(first.backup_id)  # pruned (keep 2): not a damage left behind


class PackingSource(FakeSource):
    """A source whose segments are made as the segment workers make them for a
    folder target, appended to a pack there, for a backup of 2 agents or more
    (the real source: 32); of fewer, in the daemon's process."""

    def segment_maker(
        self, *, naming_key: bytes, work_dir: Path, agents: int, pack_folder: Path | None = None
    ) -> contextlib.AbstractAsyncContextManager[Any]:
        assert pack_folder is not None, "a folder target hands the workers its packs folder"
        if agents < 2:
            return contextlib.nullcontext(None)
        return self._packing(naming_key, pack_folder)

    @contextlib.asynccontextmanager
    async def _packing(self, naming_key: bytes, folder: Path) -> AsyncIterator[Any]:
        writer = PackWriter(folder, limit=600)
        source = self

        class Maker:
            parallel = 2

            async def __call__(self, agent_id: str) -> MadeSegment:
                source.reads += 1
                compressed = io.BytesIO()
                compressor = SegmentCompressor(naming_key, compressed)
                compressor.write(source.data[agent_id])
                name = compressor.finish()
                key = segment_key(naming_key, name)
                placed = writer.add(encrypt_segment([compressed.getvalue()], name=name, key=key))
                return MadeSegment(name, compressor.plain_size, b"", placed)

        try:
            yield Maker()
        finally:
            writer.close()


async def test_packed_segments_restore_mend_and_prune(tmp_path: Path) -> None:
    """A folder target's packs through the engine: byte-equal fetch, a flipped byte
    in a pack refused then mended by the next backup, and a prune that repacks."""
    source = PackingSource(tmp_path, 12)
    root = tmp_path / "target"
    recovery = BoxKeyPair.generate()
    keypair = BoxKeyPair.generate()
    engine = BackupEngine(
        source,
        FolderTarget(FolderStore(root)),
        machine_id=MACHINE,
        naming_key=os.urandom(32),
        recipients=[keypair.public_key, recovery.public_key],
        keypair=keypair,
        work_dir=tmp_path / "work",
        keep=2,
        clock=Clock(),
    )
    first = await engine.backup_now()
    assert (first.segments, first.uploaded) == (13, 13)
    packs = sorted(p for p in (root / "packs").iterdir() if not p.name.endswith(".index"))
    assert len(packs) > 1, "segments go into packs of a bounded size"
    assert len(list((root / "segments").iterdir())) == 1, "the attachment, made in-process"
    fetched = await engine.fetch(first.backup_id, tmp_path / "f", recovery)
    assert {a: p.read_bytes() for a, p in fetched.agent_files.items()} == source.data
    for blob in (p.read_bytes() for p in root.rglob("*") if p.is_file()):
        assert b"SECRET-CONVERSATION" not in blob

    data = bytearray(packs[0].read_bytes())
    data[len(data) // 2] ^= 1
    packs[0].write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        await engine.verify(first.backup_id)
    packs_before = len(list((root / "packs").iterdir()))
    second = await engine.backup_now()
    assert second.uploaded == 1, "the damaged segment is sent again, in the daemon's process"
    assert len(list((root / "packs").iterdir())) == packs_before + 2, "into a pack of its own"
    await engine.verify(second.backup_id)
    await engine.verify(first.backup_id)  # the newer copy is the one read

    source.change(next(iter(source.data)))
    third = await engine.backup_now()
    assert third.uploaded == 1 and third.pruned is not None
    assert third.pruned.manifests == (first.backup_id,)
    # Nothing named only by the first backup; the damaged pack was repacked away.
    assert packs[0].exists() is False
    for backup in (second, third):
        await engine.verify(backup.backup_id)
    again = await engine.fetch(third.backup_id, tmp_path / "g", recovery)
    assert {a: p.read_bytes() for a, p in again.agent_files.items()} == source.data


class _LostAnswers(StoreTarget):
    """A target whose first manifest put lands and then loses its answer, and whose
    prune fails ``prune_failures`` times (a control plane whose store answered 503)."""

    def __init__(self, store: FolderStore, prune_failures: int = 0) -> None:
        super().__init__(store)
        self.lose_manifest = True
        self.prune_failures = prune_failures

    async def put_manifest(self, backup_id: str, blob: bytes, names: Any) -> None:
        await super().put_manifest(backup_id, blob, names)
        if self.lose_manifest:
            self.lose_manifest = False
            raise StoreUnavailable(f"put manifest {backup_id}: server answered SlowDown")

    async def prune(self, keep: int) -> Any:
        if self.prune_failures:
            self.prune_failures -= 1
            raise StoreUnavailable("list manifests/: server answered SlowDown")
        return await super().prune(keep)


def _engine_on(parts: dict[str, Any], target: StoreTarget) -> BackupEngine:
    return BackupEngine(
        parts["source"],
        target,
        machine_id=MACHINE,
        naming_key=os.urandom(32),
        recipients=[parts["recovery"].public_key],
        keypair=parts["recovery"],
        work_dir=parts["tmp"] / "work-lost",
        keep=2,
        clock=parts["clock"],
    )


async def test_a_committed_backup_whose_answer_was_lost_is_reported_made(
    parts: dict[str, Any],
) -> None:
    """Before: the lost answer failed ``backup now`` while the manifest was stored (a
    backup reported failed that exists, and kept by the next prune)."""
    engine = _engine_on(parts, _LostAnswers(parts["store"]))
    made = await engine.backup_now()
    assert [i.backup_id for i, _ in await engine.list()] == [made.backup_id]
    await engine.verify(made.backup_id)


async def test_a_prune_that_fails_after_the_commit_does_not_fail_the_backup(
    parts: dict[str, Any],
) -> None:
    """Before: the prune's error failed ``backup now`` after its manifest was stored."""
    target = _LostAnswers(parts["store"], prune_failures=100)
    target.lose_manifest = False
    engine = _engine_on(parts, target)
    made = await engine.backup_now()
    assert made.pruned is None  # not pruned: the next backup does it
    assert [i.backup_id for i, _ in await engine.list()] == [made.backup_id]
    # A prune that fails once is tried again.
    target.prune_failures = 1
    again = await engine.backup_now()
    assert again.pruned is not None
