"""Sealed backups, version 1: segments and the manifest that names them.

A backup is one sealed **manifest** naming sealed **segments**:

* A segment holds one agent's history (or one attachment) as plaintext in the
  export format (docs/formats/export.md). Its name is the keyed BLAKE2b of
  that plaintext under the machine's *naming key*, so an unchanged agent
  gives the same name and its segment is reused, while the store learns
  nothing from names. Its 32-byte key is derived from the naming key and the
  name, so the same segment always has the same key.
* On the wire and at rest a segment is zstd-compressed, then encrypted with
  secretstream in 1 MiB chunks under its key, with the segment's name as
  associated data: a segment stored under another name (from another backup,
  or another machine) fails to open.
* The manifest lists every segment with its key, kind, agent and sizes, plus
  the usage and time history, the erased list and the settings that are not
  secrets. It is sealed to the machine's backup key and the account's
  recovery key, with the machine id and backup id as associated data, so a
  manifest renamed or moved to another machine's folder fails to open.

A continuous backup's **increment** is a manifest of the same format whose id
is an increment's (``bki_...``, :func:`shared.backup_target.is_increment`). It
names the backup it continues (``base``: the daily point, or the increment
before), a **delta** segment for each agent changed since (the agent's files
after ``base_seq``: :mod:`machine.formats.backup_delta`), the attachments new
since, the agents gone since (``removed``) and the usage rows of the runs its
deltas hold. A point never names a delta; an increment never names a whole
agent.

The full specification is docs/formats/backup.md.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Final

import zstandard

from shared.crypto import (
    BoxKeyPair,
    KeyedHasher,
    decrypt_chunks,
    encrypt_chunks,
    keyed_hash,
    open_bytes,
    seal_bytes,
)
from shared.errors import IntegrityError
from shared.ids import is_backup_id, is_increment, is_valid_id

__all__ = [
    "MANIFEST_VERSION",
    "SEGMENT_CHUNK",
    "BackupManifest",
    "SegmentRef",
    "SegmentCompressor",
    "IterReader",
    "decode_segment",
    "decompress_segment",
    "decrypt_segment",
    "encode_segment",
    "encrypt_segment",
    "manifest_aad",
    "open_manifest",
    "seal_manifest",
    "segment_key",
    "segment_name",
]

logger = logging.getLogger(__name__)

MANIFEST_VERSION: Final = 1
#: Plaintext bytes per secretstream chunk of a segment.
SEGMENT_CHUNK: Final = 1024 * 1024
#: zstd level. In bench/backup.py level 2 stores what level 3 (zstd's default)
#: does, 82 MB, with an eighth less compression time; level 1 is a third faster
#: than 3 but stores 11 % more (91 MB, more than restic). A reader takes any level.
ZSTD_LEVEL: Final = 2
_SEGMENT_AAD: Final = b"agents.backup.segment.v1:"
_MANIFEST_AAD: Final = b"agents.backup.manifest.v1:"
_KEY_PERSON: Final = b"agents.segkey.v1"[:16]
#: Segment kinds: a point names agents and attachments, an increment deltas
#: (an agent's files after ``base_seq``) and attachments.
KINDS: Final = frozenset({"agent", "attachment", "delta"})
#: A sealed manifest's plaintext is its JSON compressed with zstd (one row per run
#: ever made: the usage history grows with the machine's age, and JSON of such rows
#: shrinks about tenfold). Older manifests are plain JSON; both open.
_ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
#: The most plaintext a manifest may open to (a forged frame cannot claim more).
MAX_MANIFEST_PLAIN: Final = 256 * 1024 * 1024


def segment_name(naming_key: bytes, plaintext: Iterable[bytes]) -> str:
    """The segment's name: keyed BLAKE2b-256 (hex) of its plaintext."""
    return keyed_hash(naming_key, plaintext)


def segment_key(naming_key: bytes, name: str) -> bytes:
    """The segment's 32-byte encryption key, derived from the naming key and its name."""
    return hashlib.blake2b(
        name.encode(), key=naming_key, digest_size=32, person=_KEY_PERSON
    ).digest()


def _segment_aad(name: str) -> bytes:
    return _SEGMENT_AAD + name.encode()


def encode_segment(plaintext: Iterable[bytes], *, name: str, key: bytes) -> Iterator[bytes]:
    """Compress then encrypt ``plaintext`` into the segment's stored bytes, lazily."""
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)

    def compressed() -> Iterator[bytes]:
        chunker = compressor.chunker(chunk_size=SEGMENT_CHUNK)
        for piece in plaintext:
            yield from chunker.compress(piece)
        yield from chunker.finish()  # type: ignore[no-untyped-call]

    return encrypt_segment(compressed(), name=name, key=key)


def encrypt_segment(
    compressed: Iterable[bytes | memoryview], *, name: str, key: bytes
) -> Iterator[bytes]:
    """Encrypt an already compressed segment (see :class:`SegmentCompressor`), lazily."""
    return encrypt_chunks(key, compressed, chunk_size=SEGMENT_CHUNK, aad=_segment_aad(name))


class SegmentCompressor:
    """Names and compresses a segment's plaintext in one pass, before its key is known.

    Write the plaintext (it is a writable file object, so a tar can be written
    straight into it); :meth:`finish` gives the name. The compressed bytes go
    to ``out``; :func:`encrypt_segment` of them under the name's key gives the
    same stored format as :func:`encode_segment`. Reading the plaintext once
    instead of twice (once to name it, once to encode it) is most of a full
    backup's saving.
    """

    def __init__(self, naming_key: bytes, out: IO[bytes]) -> None:
        self._hash = KeyedHasher(naming_key)
        self._zstd = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compressobj()
        self._out = out
        self.plain_size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._hash.update(data)
        self.plain_size += len(data)
        piece = self._zstd.compress(bytes(data))
        if piece:
            self._out.write(piece)
        return len(data)

    def flush(self) -> None:
        """Nothing to do: :meth:`finish` ends the stream."""

    def finish(self) -> str:
        """End the compressed stream; return the segment's name."""
        self._out.write(self._zstd.flush())
        return self._hash.hexdigest()


class IterReader(io.RawIOBase):
    """A file-like reader over an iterator of byte strings."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._pending:
            try:
                self._pending = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def decode_segment(
    stored: Iterable[bytes], *, name: str, key: bytes, max_plain: int
) -> Iterator[bytes]:
    """Decrypt and decompress a stored segment, yielding plaintext chunks.

    Every chunk is authenticated before it is decompressed; the plaintext is
    complete only when iteration ends without error. IntegrityError for a
    wrong key or name, any tampering, truncation, a zstd stream that does not
    decode, or more than ``max_plain`` bytes of plaintext.
    """
    return decompress_segment(
        decrypt_segment(stored, name=name, key=key), name=name, max_plain=max_plain
    )


def decrypt_segment(stored: Iterable[bytes], *, name: str, key: bytes) -> Iterator[bytes]:
    """Authenticate and decrypt a stored segment, yielding its compressed plaintext
    (complete only when iteration ends without error)."""
    return decrypt_chunks(key, stored, aad=_segment_aad(name), what=f"segment {name[:16]}")


def decompress_segment(
    compressed: Iterable[bytes], *, name: str, max_plain: int
) -> Iterator[bytes]:
    """Decompress a segment's compressed plaintext (:func:`decrypt_segment`),
    refusing a stream that does not decode or passes ``max_plain`` bytes."""
    what = f"segment {name[:16]}"
    reader = IterReader(iter(compressed))
    total = 0
    try:
        for piece in zstandard.ZstdDecompressor().read_to_iter(
            reader,  # type: ignore[arg-type]  # a readable RawIOBase; the stub wants IO[bytes]
            read_size=SEGMENT_CHUNK,
            write_size=SEGMENT_CHUNK,
        ):
            total += len(piece)
            if total > max_plain:
                raise IntegrityError(what, f"decodes to more than {max_plain} bytes")
            yield piece
    except zstandard.ZstdError as e:
        raise IntegrityError(what, f"not a valid zstd stream ({e})") from None


@dataclass(frozen=True)
class SegmentRef:
    """One segment as the manifest names it."""

    name: str
    key: bytes
    kind: str
    """"agent" or "attachment"."""
    ref: str
    """The agent id, or the attachment's SHA-256."""
    size: int
    """Stored (compressed, encrypted) bytes."""
    plain_size: int
    base_seq: int = 0
    """A delta's: the agent's events after this seq (0: the agent whole)."""

    def to_dict(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "key": self.key.hex(),
            "kind": self.kind,
            "ref": self.ref,
            "size": self.size,
            "plain_size": self.plain_size,
        }
        if self.kind == "delta":
            out["base_seq"] = self.base_seq
        return out


def _is_hex(value: object, length: int) -> bool:
    return (
        isinstance(value, str)
        and len(value) == length
        and all(c in "0123456789abcdef" for c in value)
    )


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_segment(row: object, where: str) -> SegmentRef:
    if not isinstance(row, dict):
        raise IntegrityError(where, "not an object")
    name, key, kind, ref = row.get("name"), row.get("key"), row.get("kind"), row.get("ref")
    if not _is_hex(name, 64) or not _is_hex(key, 64):
        raise IntegrityError(where, "name or key malformed")
    if kind not in KINDS:
        raise IntegrityError(where, f"unknown segment kind {kind!r}")
    if not isinstance(ref, str):
        raise IntegrityError(where, "ref malformed")
    good_ref = is_valid_id("agent", ref) if kind != "attachment" else _is_hex(ref, 64)
    if not good_ref:
        raise IntegrityError(where, "ref malformed")
    size, plain = row.get("size"), row.get("plain_size")
    if not _int(size) or not _int(plain):
        raise IntegrityError(where, "sizes malformed")
    base_seq = row.get("base_seq", 0)
    if kind == "delta" and not _int(base_seq):
        raise IntegrityError(where, "base_seq malformed")
    assert isinstance(name, str) and isinstance(key, str)  # narrowed by _is_hex
    assert isinstance(size, int) and isinstance(plain, int)
    seq = int(base_seq) if kind == "delta" else 0
    return SegmentRef(name, bytes.fromhex(key), str(kind), ref, size, plain, seq)


@dataclass(frozen=True)
class BackupManifest:
    """What one backup holds; sealed, it is the only object a reader needs first."""

    backup_id: str
    machine_id: str
    created_at: float
    naming_key: bytes
    """The machine's segment naming key, so a machine restored from this
    backup goes on naming (and so reusing) the same segments."""
    segments: tuple[SegmentRef, ...]
    usage: tuple[dict[str, Any], ...] = ()
    """Usage and time history: one row per run."""
    erased: tuple[dict[str, Any], ...] = ()
    """The erased list: agents that restore and import must skip."""
    settings: dict[str, str] = field(default_factory=dict)
    """Settings that are not secrets."""
    version: int = MANIFEST_VERSION
    base: str = ""
    """An increment's: the backup it continues (a point, or the increment before)."""
    removed: tuple[str, ...] = ()
    """An increment's: agents gone (erased, deleted) since its base."""

    @property
    def increment(self) -> bool:
        """An increment of continuous backups (else a daily point)."""
        return is_increment(self.backup_id)

    def to_json(self) -> bytes:
        data = {
            "version": self.version,
            "backup_id": self.backup_id,
            "machine_id": self.machine_id,
            "created_at": self.created_at,
            "naming_key": self.naming_key.hex(),
            "segments": [s.to_dict() for s in self.segments],
            "usage": list(self.usage),
            "erased": list(self.erased),
            "settings": dict(sorted(self.settings.items())),
        }
        if self.increment:
            data["base"] = self.base
            data["removed"] = sorted(self.removed)
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, raw: bytes, what: str) -> BackupManifest:
        """Read an opened manifest; IntegrityError for anything malformed."""
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise IntegrityError(what, "not valid JSON") from None
        if not isinstance(data, dict):
            raise IntegrityError(what, "not a JSON object")
        if data.get("version") != MANIFEST_VERSION:
            raise IntegrityError(what, f"unknown manifest version {data.get('version')!r}")
        backup_id, machine_id = data.get("backup_id"), data.get("machine_id")
        if not isinstance(backup_id, str) or not is_backup_id(backup_id):
            raise IntegrityError(what, "backup_id malformed")
        if not isinstance(machine_id, str) or not is_valid_id("machine", machine_id):
            raise IntegrityError(what, "machine_id malformed")
        created, naming = data.get("created_at"), data.get("naming_key")
        if not isinstance(created, int | float) or isinstance(created, bool):
            raise IntegrityError(what, "created_at malformed")
        if not _is_hex(naming, 64):
            raise IntegrityError(what, "naming_key malformed")
        assert isinstance(naming, str)
        rows = data.get("segments")
        usage, erased = data.get("usage", []), data.get("erased", [])
        settings = data.get("settings", {})
        if not isinstance(rows, list) or not isinstance(usage, list):
            raise IntegrityError(what, "segments or usage malformed")
        if not isinstance(erased, list) or not isinstance(settings, dict):
            raise IntegrityError(what, "erased or settings malformed")
        segments = tuple(_parse_segment(r, f"{what} segment {i}") for i, r in enumerate(rows))
        if len({s.name for s in segments}) != len(segments):
            raise IntegrityError(what, "a segment is listed twice")
        if not all(isinstance(r, dict) for r in (*usage, *erased)):
            raise IntegrityError(what, "usage or erased rows malformed")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in settings.items()):
            raise IntegrityError(what, "settings malformed")
        base, removed = _chain_fields(data, backup_id, segments, what)
        return cls(
            backup_id,
            machine_id,
            float(created),
            bytes.fromhex(naming),
            segments,
            tuple(usage),
            tuple(erased),
            dict(settings),
            base=base,
            removed=removed,
        )


def _chain_fields(
    data: dict[str, Any], backup_id: str, segments: tuple[SegmentRef, ...], what: str
) -> tuple[str, tuple[str, ...]]:
    """An increment's base and removed agents, checked; a point has neither, nor deltas."""
    if not is_increment(backup_id):
        if any(s.kind == "delta" for s in segments) or "base" in data:
            raise IntegrityError(what, "a daily backup names a delta")
        return "", ()
    base, removed = data.get("base"), data.get("removed", [])
    if not isinstance(base, str) or not is_backup_id(base):
        raise IntegrityError(what, "base malformed")
    if any(s.kind == "agent" for s in segments):
        raise IntegrityError(what, "an increment names a whole agent")
    if not isinstance(removed, list) or not all(
        isinstance(a, str) and is_valid_id("agent", a) for a in removed
    ):
        raise IntegrityError(what, "removed malformed")
    return base, tuple(removed)


def manifest_aad(machine_id: str, backup_id: str) -> bytes:
    """Associated data binding a sealed manifest to its machine and backup id."""
    return _MANIFEST_AAD + f"{machine_id}/{backup_id}".encode()


def seal_manifest(manifest: BackupManifest, recipients: Sequence[bytes]) -> bytes:
    """The manifest sealed to each recipient (machine backup key, account recovery key)."""
    return seal_bytes(
        zstandard.ZstdCompressor(level=3).compress(manifest.to_json()),
        recipients,
        chunk_size=SEGMENT_CHUNK,
        aad=manifest_aad(manifest.machine_id, manifest.backup_id),
    )


def open_manifest(
    blob: bytes, keypair: BoxKeyPair, *, machine_id: str, backup_id: str
) -> BackupManifest:
    """Open a sealed manifest stored as ``machine_id``'s backup ``backup_id``.

    IntegrityError when the key is not a recipient, the blob was altered, or
    it is another backup's or another machine's manifest.
    """
    what = f"backup {backup_id}"
    raw = open_bytes(blob, keypair, aad=manifest_aad(machine_id, backup_id), what=what)
    manifest = BackupManifest.parse(_manifest_json(raw, what), what)
    if manifest.backup_id != backup_id or manifest.machine_id != machine_id:
        raise IntegrityError(what, "manifest names another backup or machine")
    return manifest


def _manifest_json(raw: bytes, what: str) -> bytes:
    """The JSON of an opened manifest: decompressed (bounded), or as it is (older ones)."""
    if not raw.startswith(_ZSTD_MAGIC):
        return raw
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(raw) as reader:
            while piece := reader.read(SEGMENT_CHUNK):
                out += piece
                if len(out) > MAX_MANIFEST_PLAIN:
                    raise IntegrityError(
                        what, f"manifest opens to more than {MAX_MANIFEST_PLAIN} bytes"
                    )
    except zstandard.ZstdError:
        raise IntegrityError(what, "manifest does not decompress") from None
    return bytes(out)
