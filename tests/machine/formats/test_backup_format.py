"""machine.formats.backup: segments and manifests open only as sealed."""

from __future__ import annotations

import os

import pytest

from machine.formats.backup import (
    SEGMENT_CHUNK,
    BackupManifest,
    SegmentRef,
    decode_segment,
    encode_segment,
    manifest_aad,
    open_manifest,
    seal_manifest,
    segment_key,
    segment_name,
)
from shared.crypto import BoxKeyPair, seal_bytes
from shared.errors import IntegrityError
from shared.ids import new_id

NAMING = os.urandom(32)
MACHINE = new_id("machine")
BACKUP = new_id("backup")


def _segment(plain: bytes) -> tuple[str, bytes, bytes]:
    name = segment_name(NAMING, [plain])
    key = segment_key(NAMING, name)
    return name, key, b"".join(encode_segment([plain], name=name, key=key))


def _decode(stored: bytes, name: str, key: bytes, max_plain: int = 1 << 30) -> bytes:
    return b"".join(decode_segment([stored], name=name, key=key, max_plain=max_plain))


def test_segment_round_trip_and_names_are_stable() -> None:
    plain = b"conversation line\n" * 200_000 + os.urandom(1000)
    name, key, stored = _segment(plain)
    assert len(stored) < len(plain) // 5, "segments are compressed"
    assert _decode(stored, name, key) == plain
    assert segment_name(NAMING, [plain[:10], plain[10:]]) == name
    assert segment_key(NAMING, name) == key
    assert segment_name(os.urandom(32), [plain]) != name, "names depend on the key"
    assert b"conversation line" not in stored


def test_empty_segment() -> None:
    name, key, stored = _segment(b"")
    assert _decode(stored, name, key) == b""


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap_chunks", "drop_chunk", "append"])
def test_tampered_segment_refused(damage: str) -> None:
    plain = os.urandom(3 * 1024 * 1024 + 5)  # incompressible: 4 frames of ciphertext
    name, key, stored = _segment(plain)
    frames = _frames(stored)
    assert len(frames) >= 3
    if damage == "flip":
        b = bytearray(stored)
        b[len(b) // 2] ^= 1
        bad = bytes(b)
    elif damage == "truncate":
        bad = stored[: len(stored) - 100]
    elif damage == "swap_chunks":
        bad = stored[:24] + frames[1] + frames[0] + b"".join(frames[2:])
    elif damage == "drop_chunk":
        bad = stored[:24] + frames[0] + b"".join(frames[2:])
    else:
        bad = stored + b"x"
    with pytest.raises(IntegrityError):
        _decode(bad, name, key)


def _frames(stored: bytes) -> list[bytes]:
    out, pos = [], 24
    while pos < len(stored):
        n = int.from_bytes(stored[pos : pos + 4], "big")
        out.append(stored[pos : pos + 4 + n])
        pos += 4 + n
    return out


def test_segment_under_another_name_refused() -> None:
    name_a, key_a, stored_a = _segment(b"agent a history")
    name_b, key_b, _ = _segment(b"agent b history")
    with pytest.raises(IntegrityError):
        _decode(stored_a, name_b, key_b)
    with pytest.raises(IntegrityError):
        _decode(stored_a, name_b, key_a)


def test_decompression_bound() -> None:
    name, key, stored = _segment(b"\0" * (8 * 1024 * 1024))
    with pytest.raises(IntegrityError, match="more than"):
        _decode(stored, name, key, max_plain=1024 * 1024)


def _manifest() -> BackupManifest:
    seg = SegmentRef("a" * 64, os.urandom(32), "agent", new_id("agent"), 10, 20)
    att = SegmentRef("b" * 64, os.urandom(32), "attachment", "c" * 64, 1, 1)
    return BackupManifest(
        BACKUP,
        MACHINE,
        1.5,
        NAMING,
        (seg, att),
        usage=({"run_id": new_id("run"), "input_tokens": 3},),
        erased=({"agent_id": new_id("agent"), "erased_at": 2.0},),
        settings={"backup_keep": "3"},
    )


def test_manifest_opens_for_either_recipient() -> None:
    machine_key, recovery = BoxKeyPair.generate(), BoxKeyPair.generate()
    manifest = _manifest()
    blob = seal_manifest(manifest, [machine_key.public_key, recovery.public_key])
    for kp in (machine_key, recovery):
        assert open_manifest(blob, kp, machine_id=MACHINE, backup_id=BACKUP) == manifest
    with pytest.raises(IntegrityError):
        open_manifest(blob, BoxKeyPair.generate(), machine_id=MACHINE, backup_id=BACKUP)


def test_manifest_is_sealed_compressed_and_older_plain_ones_still_open() -> None:
    kp = BoxKeyPair.generate()
    runs = tuple({"id": new_id("run"), "input_tokens": i, "state": "finished"} for i in range(5000))
    manifest = BackupManifest(BACKUP, MACHINE, 1.5, NAMING, (), usage=runs)
    blob = seal_manifest(manifest, [kp.public_key])
    assert len(blob) < len(manifest.to_json()) / 3  # a long usage history shrinks
    assert open_manifest(blob, kp, machine_id=MACHINE, backup_id=BACKUP) == manifest
    aad = manifest_aad(MACHINE, BACKUP)
    older = seal_bytes(manifest.to_json(), [kp.public_key], chunk_size=SEGMENT_CHUNK, aad=aad)
    assert open_manifest(older, kp, machine_id=MACHINE, backup_id=BACKUP) == manifest
    # Compressed garbage, sealed as a manifest: refused as such, not a traceback.
    junk = seal_bytes(
        b"\x28\xb5\x2f\xfd" + os.urandom(64), [kp.public_key], chunk_size=SEGMENT_CHUNK, aad=aad
    )
    with pytest.raises(IntegrityError, match="does not decompress"):
        open_manifest(junk, kp, machine_id=MACHINE, backup_id=BACKUP)


def test_manifest_bound_to_its_machine_and_id() -> None:
    kp = BoxKeyPair.generate()
    blob = seal_manifest(_manifest(), [kp.public_key])
    with pytest.raises(IntegrityError):
        open_manifest(blob, kp, machine_id=new_id("machine"), backup_id=BACKUP)
    with pytest.raises(IntegrityError):
        open_manifest(blob, kp, machine_id=MACHINE, backup_id=new_id("backup"))
    flipped = bytearray(blob)
    flipped[-30] ^= 1
    with pytest.raises(IntegrityError):
        open_manifest(bytes(flipped), kp, machine_id=MACHINE, backup_id=BACKUP)


@pytest.mark.parametrize(
    "raw",
    [
        b"[]",
        b'{"version": 2}',
        b'{"version": 1, "backup_id": "bk_x"}',
    ],
)
def test_malformed_manifest_refused(raw: bytes) -> None:
    with pytest.raises(IntegrityError):
        BackupManifest.parse(raw, "backup x")


def test_an_increment_round_trips_and_the_kinds_do_not_mix() -> None:
    kp = BoxKeyPair.generate()
    increment, agent = new_id("increment"), new_id("agent")
    delta = SegmentRef("d" * 64, os.urandom(32), "delta", agent, 10, 20, 41)
    made = BackupManifest(
        increment, MACHINE, 2.5, NAMING, (delta,), base=BACKUP, removed=(new_id("agent"),)
    )
    assert made.increment and not _manifest().increment
    opened = open_manifest(
        seal_manifest(made, [kp.public_key]), kp, machine_id=MACHINE, backup_id=increment
    )
    assert opened == made and opened.segments[0].base_seq == 41
    whole = SegmentRef("a" * 64, os.urandom(32), "agent", agent, 10, 20)
    for bad, why in (
        (BackupManifest(increment, MACHINE, 2.5, NAMING, (delta,)), "base malformed"),
        (BackupManifest(increment, MACHINE, 2.5, NAMING, (whole,), base=BACKUP), "whole agent"),
        (BackupManifest(BACKUP, MACHINE, 2.5, NAMING, (delta,)), "names a delta"),
    ):
        with pytest.raises(IntegrityError, match=why):
            BackupManifest.parse(bad.to_json(), "backup x")
