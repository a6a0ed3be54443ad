"""Tests for shared.crypto: keys, chunked streams, sealed containers, keyed hashes."""

from __future__ import annotations

import hashlib
import itertools
import random
import tracemalloc
from collections.abc import AsyncIterator, Iterable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import crypto
from shared.crypto import (
    BoxKeyPair,
    KeyedHasher,
    adecrypt_chunks,
    aencrypt_chunks,
    aopen_sealed,
    aseal,
    decode_private_key,
    decode_public_key,
    decrypt_chunks,
    encode_private_key,
    encode_public_key,
    encrypt_chunks,
    keyed_hash,
    new_stream_key,
    open_bytes,
    open_sealed,
    seal,
    seal_bytes,
)
from shared.errors import IntegrityError, InvalidArgument

MIB = 1024 * 1024
SIZES = [0, 1, 10 * MIB]


def payload(size: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(size)


def pieces(data: bytes, size: int) -> Iterator[bytes]:
    """Split ``data`` into ``size``-byte pieces (one empty piece for empty data)."""
    if not data:
        yield b""
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def apieces(items: Iterable[bytes]) -> AsyncIterator[bytes]:
    for item in items:
        yield item


async def acollect(it: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in it])


def split_frames(stream: bytes, prefix_len: int) -> tuple[bytes, list[bytes]]:
    """Split a stream into (prefix incl. secretstream header, [length-prefixed frames])."""
    head_len = prefix_len + 24
    head, rest, frames = stream[:head_len], stream[head_len:], []
    while rest:
        n = int.from_bytes(rest[:4], "big")
        frames.append(rest[: 4 + n])
        rest = rest[4 + n :]
    return head, frames


def flip(data: bytes, index: int) -> bytes:
    out = bytearray(data)
    out[index] ^= 0x01
    return bytes(out)


@pytest.fixture(scope="module")
def key() -> bytes:
    return new_stream_key()


@pytest.fixture(scope="module")
def keypairs() -> list[BoxKeyPair]:
    return [BoxKeyPair.generate() for _ in range(4)]


# ------------------------------------------------------------------------ keys


def test_keypair_from_private_rebuilds_public() -> None:
    kp = BoxKeyPair.generate()
    again = BoxKeyPair.from_private(kp.private_key)
    assert again == kp
    assert len(kp.public_key) == 32 and len(kp.key_id) == 8


def test_keypair_repr_hides_private_key() -> None:
    kp = BoxKeyPair.generate()
    text = repr(kp) + str(kp)
    assert kp.private_key.hex() not in text
    assert encode_private_key(kp.private_key) not in text
    assert kp.key_id.hex() in text


def test_keypair_rejects_mismatched_halves() -> None:
    a, b = BoxKeyPair.generate(), BoxKeyPair.generate()
    with pytest.raises(InvalidArgument, match="public_key"):
        BoxKeyPair(a.public_key, b.private_key)
    with pytest.raises(InvalidArgument, match="private_key: must be 32 bytes"):
        BoxKeyPair.from_private(b"short")


def test_key_text_round_trip() -> None:
    kp = BoxKeyPair.generate()
    pub, priv = encode_public_key(kp.public_key), encode_private_key(kp.private_key)
    assert pub.startswith("agpk1_") and priv.startswith("agsk1_")
    assert "=" not in pub and "+" not in pub and "/" not in pub
    assert decode_public_key(pub) == kp.public_key
    assert decode_private_key(priv) == kp.private_key


def test_key_text_rejects_typos_without_echoing_the_key() -> None:
    kp = BoxKeyPair.generate()
    priv = encode_private_key(kp.private_key)
    typo = priv[:10] + ("A" if priv[10] != "A" else "B") + priv[11:]
    with pytest.raises(InvalidArgument, match="checksum mismatch") as err:
        decode_private_key(typo)
    assert priv[6:] not in str(err.value) and typo[6:] not in str(err.value)
    with pytest.raises(InvalidArgument, match="must start with 'agpk1_'"):
        decode_public_key(priv)
    with pytest.raises(InvalidArgument, match="wrong length"):
        decode_public_key("agpk1_AAAA")
    with pytest.raises(InvalidArgument, match="base64url"):
        decode_public_key("agpk1_A")


# ----------------------------------------------------------- symmetric streams


@pytest.mark.parametrize("size", SIZES)
def test_stream_round_trip(key: bytes, size: int) -> None:
    data = payload(size)
    stream = b"".join(encrypt_chunks(key, pieces(data, 100_000)))
    if size >= 64:
        assert data[:64] not in stream  # it is really encrypted
    # Feed the ciphertext back in awkward piece sizes.
    assert b"".join(decrypt_chunks(key, pieces(stream, 7777))) == data


@pytest.mark.parametrize("size", SIZES)
async def test_stream_round_trip_async(key: bytes, size: int) -> None:
    data = payload(size)
    stream = await acollect(aencrypt_chunks(key, apieces(pieces(data, 100_000))))
    assert await acollect(adecrypt_chunks(key, apieces(pieces(stream, 5000)))) == data
    # Sync and async produce the same format.
    assert b"".join(decrypt_chunks(key, [stream])) == data


def test_empty_input_is_one_final_frame(key: bytes) -> None:
    stream = b"".join(encrypt_chunks(key, []))
    head, frames = split_frames(stream, 0)
    assert len(head) == 24 and len(frames) == 1
    assert len(frames[0]) == 4 + 17
    assert b"".join(decrypt_chunks(key, [stream])) == b""


def test_stream_rechunks_to_chunk_size(key: bytes) -> None:
    data = payload(10_000)
    stream = b"".join(encrypt_chunks(key, pieces(data, 1), chunk_size=4096))
    _, frames = split_frames(stream, 0)
    assert [len(f) - 4 - 17 for f in frames] == [4096, 4096, 1808]
    # Exact multiple: the last full chunk carries TAG_FINAL, no empty trailer.
    stream = b"".join(encrypt_chunks(key, [data[:8192]], chunk_size=4096))
    assert len(split_frames(stream, 0)[1]) == 2


def test_aad_is_authenticated(key: bytes) -> None:
    stream = b"".join(encrypt_chunks(key, [b"hello"], aad=b"segment-1"))
    assert b"".join(decrypt_chunks(key, [stream], aad=b"segment-1")) == b"hello"
    with pytest.raises(IntegrityError, match="authentication failed"):
        b"".join(decrypt_chunks(key, [stream], aad=b"segment-2"))


def _multi_frame_stream(key: bytes) -> bytes:
    return b"".join(encrypt_chunks(key, [payload(5000)], chunk_size=1000))


@pytest.mark.parametrize("where", ["ss_header", "length", "first", "middle", "last"])
def test_flipped_byte_rejected(key: bytes, where: str) -> None:
    stream = _multi_frame_stream(key)
    index = {
        "ss_header": 3,
        "length": 24 + 3,  # low byte of the first frame's length
        "first": 24 + 4 + 10,
        "middle": len(stream) // 2,
        "last": len(stream) - 1,
    }[where]
    with pytest.raises(IntegrityError) as err:
        b"".join(decrypt_chunks(key, [flip(stream, index)], what="segment s1"))
    msg = str(err.value)
    assert msg.startswith("decrypt segment s1: ")
    assert "authentication failed (wrong key or corrupted data)" in msg or "truncated" in msg


@pytest.mark.parametrize(
    "cut",
    ["empty", "inside header", "header only", "inside a frame", "final dropped", "one short"],
)
def test_truncated_stream_rejected(key: bytes, cut: str) -> None:
    stream = _multi_frame_stream(key)
    head, frames = split_frames(stream, 0)
    truncated = {
        "empty": b"",
        "inside header": stream[:10],
        "header only": head,
        "inside a frame": stream[: len(head) + 100],
        "final dropped": head + b"".join(frames[:-1]),
        "one short": stream[:-1],
    }[cut]
    with pytest.raises(IntegrityError, match=r"^decrypt stream: truncated stream$"):
        b"".join(decrypt_chunks(key, [truncated]))


def test_reordered_chunk_rejected(key: bytes) -> None:
    head, frames = split_frames(_multi_frame_stream(key), 0)
    frames[1], frames[2] = frames[2], frames[1]
    with pytest.raises(IntegrityError, match="authentication failed"):
        b"".join(decrypt_chunks(key, [head, *frames]))


def test_dropped_chunk_rejected(key: bytes) -> None:
    head, frames = split_frames(_multi_frame_stream(key), 0)
    del frames[1]
    with pytest.raises(IntegrityError, match="authentication failed"):
        b"".join(decrypt_chunks(key, [head, *frames]))


def test_wrong_key_rejected(key: bytes) -> None:
    stream = _multi_frame_stream(key)
    with pytest.raises(
        IntegrityError,
        match=r"^decrypt stream: authentication failed \(wrong key or corrupted data\)$",
    ):
        b"".join(decrypt_chunks(new_stream_key(), [stream]))


def test_data_after_final_chunk_rejected(key: bytes) -> None:
    stream = b"".join(encrypt_chunks(key, [b"abc"]))
    for extra in ([stream + b"x"], [stream, b"x"], [stream, stream]):
        with pytest.raises(IntegrityError, match="data after the final chunk"):
            b"".join(decrypt_chunks(key, extra))


def test_oversized_frame_length_rejected_before_allocating(key: bytes) -> None:
    stream = b"".join(encrypt_chunks(key, [b"abc"]))
    bad = stream[:24] + (2**32 - 1).to_bytes(4, "big")
    with pytest.raises(IntegrityError, match="frame length 4294967295 out of range"):
        b"".join(decrypt_chunks(key, [bad]))
    big = b"".join(encrypt_chunks(key, [payload(3000)], chunk_size=3000))
    with pytest.raises(IntegrityError, match="out of range"):
        b"".join(decrypt_chunks(key, [big], max_chunk_size=1000))


def test_bad_arguments_raise_at_call_time(key: bytes) -> None:
    with pytest.raises(InvalidArgument, match="key: must be 32 bytes"):
        encrypt_chunks(b"short", [])
    with pytest.raises(InvalidArgument, match="chunk_size"):
        encrypt_chunks(key, [], chunk_size=0)
    with pytest.raises(InvalidArgument, match="chunk_size"):
        encrypt_chunks(key, [], chunk_size=crypto.MAX_CHUNK_SIZE + 1)
    with pytest.raises(InvalidArgument, match="key"):
        decrypt_chunks(b"", [])


async def test_async_errors_match_sync(key: bytes) -> None:
    head, frames = split_frames(_multi_frame_stream(key), 0)
    with pytest.raises(IntegrityError, match="truncated stream"):
        await acollect(adecrypt_chunks(key, apieces([head, *frames[:-1]])))
    with pytest.raises(IntegrityError, match="authentication failed"):
        await acollect(adecrypt_chunks(key, apieces([head, frames[0], frames[2]])))


@settings(max_examples=30, deadline=None)
@given(
    size=st.integers(min_value=0, max_value=20_000),
    chunk_size=st.integers(min_value=1, max_value=5000),
    in_piece=st.integers(min_value=1, max_value=9000),
    out_piece=st.integers(min_value=1, max_value=9000),
    aad=st.binary(max_size=40),
)
def test_stream_round_trip_property(
    size: int, chunk_size: int, in_piece: int, out_piece: int, aad: bytes
) -> None:
    key = new_stream_key()
    data = payload(size, seed=size)
    stream = b"".join(encrypt_chunks(key, pieces(data, in_piece), chunk_size=chunk_size, aad=aad))
    expected_frames = max(1, -(-size // chunk_size))
    assert len(split_frames(stream, 0)[1]) == expected_frames
    out = list(decrypt_chunks(key, pieces(stream, out_piece), aad=aad))
    assert b"".join(out) == data
    assert all(0 < len(chunk) <= chunk_size for chunk in out)


# ----------------------------------------------------------- bounded memory


class CountingIter:
    """Wraps an iterator and counts how many items were taken from it."""

    def __init__(self, items: Iterable[bytes]) -> None:
        self._it = iter(items)
        self.taken = 0

    def __iter__(self) -> CountingIter:
        return self

    def __next__(self) -> bytes:
        item = next(self._it)
        self.taken += 1
        return item


def test_decrypt_yields_before_input_is_exhausted(key: bytes) -> None:
    stream = b"".join(encrypt_chunks(key, [payload(MIB)], chunk_size=4096))
    source = CountingIter(pieces(stream, 1000))
    total = -(-len(stream) // 1000)
    out = decrypt_chunks(key, source)
    first = next(out)
    assert len(first) == 4096
    assert source.taken < 10 < total


def test_open_sealed_yields_before_input_is_exhausted(keypairs: list[BoxKeyPair]) -> None:
    blob = seal_bytes(payload(MIB), [keypairs[0].public_key], chunk_size=4096)
    source = CountingIter(pieces(blob, 1000))
    out = open_sealed(source, keypairs[0])
    assert len(next(out)) == 4096
    assert source.taken < 10 < -(-len(blob) // 1000)


def test_encrypt_is_lazy_over_endless_input(key: bytes) -> None:
    endless = itertools.repeat(b"x" * 1000)
    out = encrypt_chunks(key, endless, chunk_size=4096)
    assert len(next(out)) == 24  # secretstream header
    assert len(next(out)) == 4 + 4096 + 17


def test_pipeline_memory_is_bounded(key: bytes, keypairs: list[BoxKeyPair]) -> None:
    """20 MiB through encrypt -> decrypt and seal -> open without holding it."""
    total = 20 * MIB

    def source() -> Iterator[bytes]:
        rng = random.Random(7)
        for _ in range(total // 65536):
            yield rng.randbytes(65536)

    tracemalloc.start()
    try:
        got = hashlib.sha256()
        for chunk in decrypt_chunks(key, encrypt_chunks(key, source())):
            got.update(chunk)
        sealed = seal(source(), [keypairs[0].public_key])
        for chunk in open_sealed(sealed, keypairs[0]):
            got.update(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    want = hashlib.sha256()
    for _ in range(2):
        for chunk in source():
            want.update(chunk)
    assert got.digest() == want.digest()
    assert peak < 2 * MIB, f"peak {peak} bytes"


# ----------------------------------------------------------- sealed containers


@pytest.mark.parametrize("size", SIZES)
def test_sealed_round_trip(keypairs: list[BoxKeyPair], size: int) -> None:
    data = payload(size)
    blob = b"".join(seal(pieces(data, 300_000), [keypairs[0].public_key]))
    assert blob.startswith(b"AGSEAL\x01\x01")
    assert b"".join(open_sealed(pieces(blob, 9999), keypairs[0])) == data
    assert open_bytes(blob, keypairs[0]) == data


@pytest.mark.parametrize("size", SIZES)
async def test_sealed_round_trip_async(keypairs: list[BoxKeyPair], size: int) -> None:
    data = payload(size)
    blob = await acollect(aseal(apieces(pieces(data, 300_000)), [keypairs[0].public_key]))
    assert await acollect(aopen_sealed(apieces(pieces(blob, 4321)), keypairs[0])) == data
    assert open_bytes(blob, keypairs[0]) == data


def test_header_layout_matches_the_documented_offsets(keypairs: list[BoxKeyPair]) -> None:
    pubs = [kp.public_key for kp in keypairs[:3]]
    blob = seal_bytes(b"hi", pubs, chunk_size=1000)
    assert blob[0:6] == b"AGSEAL"
    assert blob[6] == 1 and blob[7] == 3
    assert int.from_bytes(blob[8:12], "big") == 1000
    for i, kp in enumerate(keypairs[:3]):
        off = 12 + 88 * i
        assert blob[off : off + 8] == kp.key_id == crypto.key_id(kp.public_key)
    # header (12 + 88*3) + secretstream header (24) + one frame (4 + 2 + 17)
    assert len(blob) == 12 + 88 * 3 + 24 + 4 + 2 + 17


def test_any_of_three_recipients_can_open(keypairs: list[BoxKeyPair]) -> None:
    data = payload(100_000)
    blob = seal_bytes(data, [kp.public_key for kp in keypairs[:3]], chunk_size=8192)
    for kp in keypairs[:3]:
        assert open_bytes(blob, kp) == data


def test_non_recipient_cannot_open(keypairs: list[BoxKeyPair]) -> None:
    blob = seal_bytes(b"secret", [kp.public_key for kp in keypairs[:3]])
    with pytest.raises(IntegrityError, match=r"^open manifest m1: not sealed to this key$"):
        open_bytes(blob, keypairs[3], what="manifest m1")


def test_two_seals_use_fresh_data_keys(keypairs: list[BoxKeyPair]) -> None:
    a = seal_bytes(b"same", [keypairs[0].public_key])
    b = seal_bytes(b"same", [keypairs[0].public_key])
    assert a != b and a[:20] == b[:20]


@pytest.mark.parametrize(
    ("index", "reason"),
    [
        (8 + 3, "authentication failed"),  # chunk size field
        (12 + 88 + 20, "authentication failed"),  # the other recipient's sealed key
        (12 + 88 + 2, "authentication failed"),  # the other recipient's key id
        (12 + 20, "sealed data key authentication failed"),  # our own sealed key
        (12 + 2, "not sealed to this key"),  # our own key id
    ],
)
def test_tampered_header_rejected(keypairs: list[BoxKeyPair], index: int, reason: str) -> None:
    blob = seal_bytes(b"payload" * 100, [keypairs[0].public_key, keypairs[1].public_key])
    with pytest.raises(IntegrityError, match=reason):
        open_bytes(flip(blob, index), keypairs[0])


def test_swapped_recipient_entries_detected(keypairs: list[BoxKeyPair]) -> None:
    blob = seal_bytes(b"payload", [keypairs[0].public_key, keypairs[1].public_key])
    e0, e1 = blob[12:100], blob[100:188]
    swapped = blob[:12] + e1 + e0 + blob[188:]
    with pytest.raises(IntegrityError, match="authentication failed"):
        open_bytes(swapped, keypairs[0])


def test_bad_magic_and_version_rejected(keypairs: list[BoxKeyPair]) -> None:
    blob = seal_bytes(b"x", [keypairs[0].public_key])
    with pytest.raises(IntegrityError, match=r"^open sealed container: bad magic"):
        open_bytes(b"NOTSEAL" + blob[7:], keypairs[0])
    # The magic is checked as soon as the first bytes arrive.
    with pytest.raises(IntegrityError, match="bad magic"):
        next(open_sealed(iter([b"PK\x03"]), keypairs[0]))
    with pytest.raises(IntegrityError, match="unsupported version 2 \\(this build reads 1\\)"):
        open_bytes(blob[:6] + b"\x02" + blob[7:], keypairs[0])


def test_bad_counts_rejected_before_allocating(keypairs: list[BoxKeyPair]) -> None:
    blob = seal_bytes(b"x", [keypairs[0].public_key])
    for count in (0, 17, 255):
        with pytest.raises(IntegrityError, match=f"recipient count {count} out of range 1..16"):
            open_bytes(blob[:7] + bytes([count]) + blob[8:], keypairs[0])
    for size in (0, crypto.MAX_CHUNK_SIZE + 1, 2**32 - 1):
        bad = blob[:8] + size.to_bytes(4, "big") + blob[12:]
        with pytest.raises(IntegrityError, match=f"chunk size {size} out of range"):
            open_bytes(bad, keypairs[0])


def test_truncated_container_rejected(keypairs: list[BoxKeyPair]) -> None:
    blob = seal_bytes(payload(5000), [keypairs[0].public_key], chunk_size=1000)
    for cut in (0, 5, 11, 12, 50, 12 + 88, 12 + 88 + 24, len(blob) - 1):
        with pytest.raises(IntegrityError, match=r"^open sealed container: truncated stream$"):
            open_bytes(blob[:cut], keypairs[0])


def test_sealed_flipped_and_reordered_frames_rejected(keypairs: list[BoxKeyPair]) -> None:
    blob = seal_bytes(payload(5000), [keypairs[0].public_key], chunk_size=1000)
    with pytest.raises(IntegrityError, match="authentication failed"):
        open_bytes(flip(blob, len(blob) - 3), keypairs[0])
    head, frames = split_frames(blob, 12 + 88)
    frames[0], frames[1] = frames[1], frames[0]
    with pytest.raises(IntegrityError, match="authentication failed"):
        open_bytes(head + b"".join(frames), keypairs[0])


def test_sealed_aad_is_authenticated(keypairs: list[BoxKeyPair]) -> None:
    blob = seal_bytes(b"prompt", [keypairs[0].public_key], aad=b"acct_1/mc_1")
    assert open_bytes(blob, keypairs[0], aad=b"acct_1/mc_1") == b"prompt"
    with pytest.raises(IntegrityError, match="authentication failed"):
        open_bytes(blob, keypairs[0], aad=b"acct_2/mc_1")


def test_seal_rejects_bad_recipients(keypairs: list[BoxKeyPair]) -> None:
    pk = keypairs[0].public_key
    with pytest.raises(InvalidArgument, match="recipients: need 1 to 16"):
        seal_bytes(b"x", [])
    with pytest.raises(InvalidArgument, match="recipients: need 1 to 16"):
        seal_bytes(b"x", [BoxKeyPair.generate().public_key for _ in range(17)])
    with pytest.raises(InvalidArgument, match="duplicate"):
        seal_bytes(b"x", [pk, pk])
    with pytest.raises(InvalidArgument, match="must be a sequence"):
        seal_bytes(b"x", pk)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="must be 32 bytes"):
        seal_bytes(b"x", [pk[:31]])
    with pytest.raises(InvalidArgument, match="not a valid X25519 public key"):
        seal_bytes(b"x", [bytes(32)])


def test_sixteen_recipients_allowed() -> None:
    kps = [BoxKeyPair.generate() for _ in range(16)]
    blob = seal_bytes(b"many", [kp.public_key for kp in kps])
    assert open_bytes(blob, kps[-1]) == b"many"


@settings(max_examples=30, deadline=None)
@given(
    size=st.integers(min_value=0, max_value=20_000),
    chunk_size=st.integers(min_value=1, max_value=5000),
    out_piece=st.integers(min_value=1, max_value=9000),
)
def test_sealed_round_trip_property(size: int, chunk_size: int, out_piece: int) -> None:
    kp = BoxKeyPair.generate()
    data = payload(size, seed=size)
    blob = seal_bytes(data, [kp.public_key], chunk_size=chunk_size)
    assert b"".join(open_sealed(pieces(blob, out_piece), kp)) == data


# ------------------------------------------------------------------ keyed hash


def test_keyed_hash_matches_blake2b_and_chunking() -> None:
    hkey = b"k" * 32
    data = payload(100_000)
    want = hashlib.blake2b(data, key=hkey, digest_size=32).hexdigest()
    assert keyed_hash(hkey, data) == want
    assert keyed_hash(hkey, pieces(data, 777)) == want
    hasher = KeyedHasher(hkey)
    for piece in pieces(data, 4096):
        hasher.update(piece)
    assert hasher.hexdigest() == want and hasher.digest().hex() == want
    assert len(want) == 64


def test_keyed_hash_depends_on_key() -> None:
    assert keyed_hash(b"a" * 32, b"data") != keyed_hash(b"b" * 32, b"data")
    assert keyed_hash(b"a" * 32, b"data") != hashlib.blake2b(b"data", digest_size=32).hexdigest()
    with pytest.raises(InvalidArgument, match="key: must be 16 to 64 bytes"):
        keyed_hash(b"short", b"data")
    assert "k" * 16 not in repr(KeyedHasher(b"k" * 16))
