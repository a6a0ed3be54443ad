"""Keys, chunked stream encryption, sealed containers and keyed hashes.

Everything here is built on libsodium through PyNaCl and streams with bounded
memory: input is re-chunked, output is produced chunk by chunk, and no length
read from untrusted bytes is used to allocate without a bound.

Stream format (:func:`encrypt_chunks`)
======================================

A stream encrypted under a 32-byte key (one per backup segment) is::

    offset  size  field
    0       24    secretstream header (crypto_secretstream_xchacha20poly1305)
    24      ...   frames, each: u32 big-endian length L, then L bytes of ciphertext

Each frame holds one chunk of at most ``chunk_size`` plaintext bytes plus a
17-byte tag. Every frame but the last is tagged ``TAG_MESSAGE``; the last is
tagged ``TAG_FINAL``. Empty input still yields one (empty) final frame. The
caller's ``aad`` is authenticated with every frame. Because secretstream
chains each frame's state on the previous tag, a flipped, dropped or reordered
frame fails authentication; a stream that ends before the final frame is
*truncated*, and any byte after it is rejected.

Sealed container format (:func:`seal`), version 1
=================================================

A fresh random data key encrypts the payload as a stream; the data key is
sealed (``crypto_box_seal``, X25519 + XSalsa20-Poly1305, anonymous sender) to
each recipient's public key::

    offset       size     field
    0            6        magic b"AGSEAL"
    6            1        version, 1
    7            1        recipient count N, 1..16
    8            4        chunk size, u32 big-endian, 1..4 MiB
    12           88 * N   recipient entries, each:
                            8  key id = BLAKE2b-64 of the public key,
                               personalisation b"agseal.keyid.v1"
                            80 crypto_box_seal(data key, public key)
    12 + 88N     24       secretstream header
    36 + 88N     ...      frames, as in the stream format

Bytes 0 .. 12 + 88N (the *header*) followed by the caller's ``aad`` are the
associated data of every frame, so changing any header byte - the chunk size,
another recipient's entry - makes the first frame fail authentication. A reader
finds its entry by key id, opens the data key, and decrypts the frames with a
frame-length bound of the header's chunk size plus 17.

A reader rejects an unknown magic or version; a future version 2 changes the
version byte and keeps the magic.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

import nacl.bindings as sodium
import nacl.exceptions

from shared.errors import IntegrityError, InvalidArgument

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "KEY_SIZE",
    "MAX_CHUNK_SIZE",
    "MAX_RECIPIENTS",
    "SEAL_MAGIC",
    "SEAL_VERSION",
    "BoxKeyPair",
    "KeyedHasher",
    "adecrypt_chunks",
    "aencrypt_chunks",
    "aopen_sealed",
    "aseal",
    "decode_private_key",
    "decode_public_key",
    "decrypt_chunks",
    "encode_private_key",
    "encode_public_key",
    "encrypt_chunks",
    "key_id",
    "keyed_hash",
    "new_stream_key",
    "open_bytes",
    "open_sealed",
    "prompt_aad",
    "seal",
    "seal_bytes",
]

logger = logging.getLogger(__name__)

#: Size of stream keys, X25519 public and private keys.
KEY_SIZE: Final = 32
DEFAULT_CHUNK_SIZE: Final = 64 * 1024
MAX_CHUNK_SIZE: Final = 4 * 1024 * 1024
MAX_RECIPIENTS: Final = 16

SEAL_MAGIC: Final = b"AGSEAL"
SEAL_VERSION: Final = 1

_ABYTES: Final[int] = sodium.crypto_secretstream_xchacha20poly1305_ABYTES
_SS_HEADER: Final[int] = sodium.crypto_secretstream_xchacha20poly1305_HEADERBYTES
_TAG_MESSAGE: Final[int] = sodium.crypto_secretstream_xchacha20poly1305_TAG_MESSAGE
_TAG_FINAL: Final[int] = sodium.crypto_secretstream_xchacha20poly1305_TAG_FINAL
_LEN: Final = 4
_KEY_ID_SIZE: Final = 8
_KEY_ID_PERSON: Final = b"agseal.keyid.v1"
_SEALED_KEY_SIZE: Final[int] = KEY_SIZE + sodium.crypto_box_SEALBYTES
_ENTRY_SIZE: Final = _KEY_ID_SIZE + _SEALED_KEY_SIZE
_FIXED_HEADER: Final = len(SEAL_MAGIC) + 1 + 1 + 4

_PUBLIC_PREFIX: Final = "agpk1_"
_PRIVATE_PREFIX: Final = "agsk1_"
_CHECK_SIZE: Final = 4

_AUTH_FAILED: Final = "authentication failed (wrong key or corrupted data)"
_TRUNCATED: Final = "truncated stream"


# --------------------------------------------------------------------------- keys


def key_id(public_key: bytes) -> bytes:
    """Return the 8-byte id that names ``public_key`` in a sealed header."""
    return hashlib.blake2b(public_key, digest_size=_KEY_ID_SIZE, person=_KEY_ID_PERSON).digest()


def _check_key(field_name: str, key: bytes) -> None:
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_SIZE:
        raise InvalidArgument(field_name, f"must be {KEY_SIZE} bytes")


@dataclass(frozen=True)
class BoxKeyPair:
    """An X25519 key pair: recipients seal to ``public_key``, we open with both.

    ``repr()`` shows only the key id; the private key never appears in it.
    """

    public_key: bytes
    private_key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        _check_key("public_key", self.public_key)
        _check_key("private_key", self.private_key)
        if sodium.crypto_scalarmult_base(bytes(self.private_key)) != bytes(self.public_key):
            raise InvalidArgument("public_key", "does not match the private key")

    @classmethod
    def generate(cls) -> BoxKeyPair:
        """Make a fresh random key pair."""
        public, private = sodium.crypto_box_keypair()
        return cls(public, private)

    @classmethod
    def from_private(cls, private_key: bytes) -> BoxKeyPair:
        """Rebuild a key pair from its 32-byte private key."""
        _check_key("private_key", private_key)
        return cls(sodium.crypto_scalarmult_base(bytes(private_key)), bytes(private_key))

    @property
    def key_id(self) -> bytes:
        """The 8-byte id of the public key (see :func:`key_id`)."""
        return key_id(self.public_key)

    def __repr__(self) -> str:
        return f"BoxKeyPair(key_id={self.key_id.hex()})"


def _checksum(prefix: str, raw: bytes) -> bytes:
    # A short checksum catches a mistyped key instead of silently decoding
    # another valid key (every 32-byte string is a valid X25519 private key).
    return hashlib.blake2b(prefix.encode() + raw, digest_size=_CHECK_SIZE).digest()


def _encode_key(prefix: str, raw: bytes) -> str:
    body = base64.urlsafe_b64encode(raw + _checksum(prefix, raw)).rstrip(b"=")
    return prefix + body.decode("ascii")


def _decode_key(prefix: str, field_name: str, text: str) -> bytes:
    # Messages never echo the text: it may be a private key.
    if not isinstance(text, str) or not text.startswith(prefix):
        raise InvalidArgument(field_name, f"must start with {prefix!r}")
    body = text[len(prefix) :].strip()
    try:
        decoded = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (ValueError, TypeError):
        raise InvalidArgument(field_name, "is not valid base64url") from None
    if len(decoded) != KEY_SIZE + _CHECK_SIZE:
        raise InvalidArgument(field_name, "has the wrong length")
    raw, check = decoded[:KEY_SIZE], decoded[KEY_SIZE:]
    if check != _checksum(prefix, raw):
        raise InvalidArgument(field_name, "checksum mismatch (mistyped key?)")
    return raw


def encode_public_key(public_key: bytes) -> str:
    """Text form of a public key: ``agpk1_`` + base64url(key + 4-byte checksum)."""
    _check_key("public_key", public_key)
    return _encode_key(_PUBLIC_PREFIX, bytes(public_key))


def decode_public_key(text: str) -> bytes:
    """Parse :func:`encode_public_key` output; raise InvalidArgument if malformed."""
    return _decode_key(_PUBLIC_PREFIX, "public_key", text)


def encode_private_key(private_key: bytes) -> str:
    """Text form of a private key: ``agsk1_`` + base64url(key + 4-byte checksum)."""
    _check_key("private_key", private_key)
    return _encode_key(_PRIVATE_PREFIX, bytes(private_key))


def decode_private_key(text: str) -> bytes:
    """Parse :func:`encode_private_key` output; raise InvalidArgument if malformed."""
    return _decode_key(_PRIVATE_PREFIX, "private_key", text)


def new_stream_key() -> bytes:
    """A fresh random 32-byte key for :func:`encrypt_chunks`."""
    key: bytes = sodium.crypto_secretstream_xchacha20poly1305_keygen()
    return key


# ------------------------------------------------------------ sans-I/O stream core


def _check_chunk_size(chunk_size: int, field_name: str = "chunk_size") -> None:
    if not isinstance(chunk_size, int) or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise InvalidArgument(field_name, f"must be between 1 and {MAX_CHUNK_SIZE}")


class _Encryptor:
    """Re-chunks plaintext and frames ciphertext; holds at most one chunk."""

    def __init__(self, key: bytes, chunk_size: int, aad: bytes) -> None:
        self._state = sodium.crypto_secretstream_xchacha20poly1305_state()
        self.header: bytes = sodium.crypto_secretstream_xchacha20poly1305_init_push(
            self._state, bytes(key)
        )
        self._chunk_size = chunk_size
        self._aad = bytes(aad) or None
        self._pending = bytearray()

    def _frame(self, tag: int) -> bytes:
        ct: bytes = sodium.crypto_secretstream_xchacha20poly1305_push(
            self._state, bytes(self._pending), self._aad, tag
        )
        self._pending.clear()
        return len(ct).to_bytes(_LEN, "big") + ct

    def update(self, data: bytes | memoryview) -> list[bytes]:
        out: list[bytes] = []
        view = memoryview(data).cast("B")
        while view:
            # A full chunk is only sent once more data exists, so the last
            # chunk of the stream is always still pending for TAG_FINAL.
            if len(self._pending) == self._chunk_size:
                out.append(self._frame(_TAG_MESSAGE))
            take = min(self._chunk_size - len(self._pending), len(view))
            self._pending += view[:take]
            view = view[take:]
        return out

    def finish(self) -> bytes:
        return self._frame(_TAG_FINAL)


class _Buffer:
    """A byte queue that hands out exact-length pieces without quadratic copying."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._pos = 0

    def __len__(self) -> int:
        return len(self._data) - self._pos

    def feed(self, data: bytes) -> None:
        if self._pos:
            del self._data[: self._pos]
            self._pos = 0
        self._data += data

    def take(self, n: int) -> bytes | None:
        if len(self) < n:
            return None
        out = bytes(self._data[self._pos : self._pos + n])
        self._pos += n
        return out

    def peek(self, n: int) -> bytes:
        return bytes(self._data[self._pos : self._pos + n])

    def rest(self) -> bytes:
        out = bytes(self._data[self._pos :])
        self._data.clear()
        self._pos = 0
        return out


class _Decryptor:
    """Parses the stream format and yields authenticated plaintext chunks."""

    def __init__(self, key: bytes, *, aad: bytes, max_chunk_size: int, what: str) -> None:
        self._key = bytes(key)
        self._aad = bytes(aad) or None
        self._max_frame = max_chunk_size + _ABYTES
        self._what = what
        self._buf = _Buffer()
        self._state: sodium.crypto_secretstream_xchacha20poly1305_state | None = None
        self._frame_len: int | None = None
        self._done = False

    def _fail(self, reason: str) -> IntegrityError:
        return IntegrityError(self._what, reason)

    def feed(self, data: bytes) -> list[bytes]:
        if self._done:
            if data:
                raise self._fail("data after the final chunk")
            return []
        self._buf.feed(data)
        out: list[bytes] = []
        while not self._done:
            if self._state is None:
                header = self._buf.take(_SS_HEADER)
                if header is None:
                    break
                state = sodium.crypto_secretstream_xchacha20poly1305_state()
                sodium.crypto_secretstream_xchacha20poly1305_init_pull(state, header, self._key)
                self._state = state
            if self._frame_len is None:
                raw = self._buf.take(_LEN)
                if raw is None:
                    break
                n = int.from_bytes(raw, "big")
                if not _ABYTES <= n <= self._max_frame:
                    raise self._fail(f"frame length {n} out of range {_ABYTES}..{self._max_frame}")
                self._frame_len = n
            ct = self._buf.take(self._frame_len)
            if ct is None:
                break
            self._frame_len = None
            try:
                msg, tag = sodium.crypto_secretstream_xchacha20poly1305_pull(
                    self._state, ct, self._aad
                )
            except nacl.exceptions.CryptoError:
                raise self._fail(_AUTH_FAILED) from None
            if tag == _TAG_FINAL:
                self._done = True
                if len(self._buf):
                    raise self._fail("data after the final chunk")
            elif tag != _TAG_MESSAGE:
                raise self._fail(f"unexpected chunk tag {tag}")
            if msg:
                out.append(msg)
        return out

    def finish(self) -> None:
        if not self._done:
            raise self._fail(_TRUNCATED)


def _seal_header(data_key: bytes, recipients: Sequence[bytes], chunk_size: int) -> bytes:
    if not 1 <= len(recipients) <= MAX_RECIPIENTS:
        raise InvalidArgument("recipients", f"need 1 to {MAX_RECIPIENTS} public keys")
    seen: set[bytes] = set()
    parts = [
        SEAL_MAGIC,
        bytes([SEAL_VERSION, len(recipients)]),
        chunk_size.to_bytes(4, "big"),
    ]
    for pk in recipients:
        _check_key("recipients", pk)
        pk = bytes(pk)
        if pk in seen:
            raise InvalidArgument("recipients", "duplicate public key")
        seen.add(pk)
        try:
            sealed: bytes = sodium.crypto_box_seal(data_key, pk)
        except nacl.exceptions.CryptoError:
            raise InvalidArgument("recipients", "not a valid X25519 public key") from None
        parts += [key_id(pk), sealed]
    return b"".join(parts)


class _Opener:
    """Parses a sealed container's header, then hands the rest to a _Decryptor."""

    def __init__(self, keypair: BoxKeyPair, *, aad: bytes, what: str) -> None:
        self._keypair = keypair
        self._aad = bytes(aad)
        self._what = what
        self._buf = _Buffer()
        self._fixed: bytes | None = None
        self._inner: _Decryptor | None = None

    def _fail(self, reason: str) -> IntegrityError:
        return IntegrityError(self._what, reason)

    def _parse_fixed(self, fixed: bytes) -> tuple[int, int]:
        if fixed[: len(SEAL_MAGIC)] != SEAL_MAGIC:
            raise self._fail("bad magic (not a sealed container)")
        version, count = fixed[6], fixed[7]
        if version != SEAL_VERSION:
            raise self._fail(f"unsupported version {version} (this build reads {SEAL_VERSION})")
        if not 1 <= count <= MAX_RECIPIENTS:
            raise self._fail(f"recipient count {count} out of range 1..{MAX_RECIPIENTS}")
        chunk_size = int.from_bytes(fixed[8:12], "big")
        if not 1 <= chunk_size <= MAX_CHUNK_SIZE:
            raise self._fail(f"chunk size {chunk_size} out of range 1..{MAX_CHUNK_SIZE}")
        return count, chunk_size

    def _open_data_key(self, entries: bytes) -> bytes:
        mine = self._keypair.key_id
        matched = False
        for off in range(0, len(entries), _ENTRY_SIZE):
            if entries[off : off + _KEY_ID_SIZE] != mine:
                continue
            matched = True
            sealed = entries[off + _KEY_ID_SIZE : off + _ENTRY_SIZE]
            try:
                data_key: bytes = sodium.crypto_box_seal_open(
                    sealed, self._keypair.public_key, self._keypair.private_key
                )
            except nacl.exceptions.CryptoError:
                continue
            if len(data_key) == KEY_SIZE:
                return data_key
        if matched:
            raise self._fail("sealed data key " + _AUTH_FAILED)
        raise self._fail("not sealed to this key")

    def feed(self, data: bytes) -> list[bytes]:
        if self._inner is not None:
            return self._inner.feed(data)
        self._buf.feed(data)
        if self._fixed is None:
            # Check the magic as soon as it is there, before waiting for more.
            if len(self._buf) < _FIXED_HEADER:
                if not SEAL_MAGIC.startswith(self._buf.peek(len(SEAL_MAGIC))):
                    raise self._fail("bad magic (not a sealed container)")
                return []
            fixed = self._buf.take(_FIXED_HEADER)
            assert fixed is not None
            self._fixed = fixed
        count, chunk_size = self._parse_fixed(self._fixed)
        entries = self._buf.take(count * _ENTRY_SIZE)
        if entries is None:
            return []
        data_key = self._open_data_key(entries)
        self._inner = _Decryptor(
            data_key,
            aad=self._fixed + entries + self._aad,
            max_chunk_size=chunk_size,
            what=self._what,
        )
        return self._inner.feed(self._buf.rest())

    def finish(self) -> None:
        if self._inner is None:
            raise self._fail(_TRUNCATED)
        self._inner.finish()


# ------------------------------------------------------------------ I/O drivers


def _run_encrypt(
    enc: _Encryptor, prefix: bytes, chunks: Iterable[bytes | memoryview]
) -> Iterator[bytes]:
    yield prefix + enc.header
    for chunk in chunks:
        yield from enc.update(chunk)
    yield enc.finish()


async def _arun_encrypt(
    enc: _Encryptor, prefix: bytes, chunks: AsyncIterable[bytes]
) -> AsyncIterator[bytes]:
    yield prefix + enc.header
    async for chunk in chunks:
        for frame in enc.update(chunk):
            yield frame
    yield enc.finish()


def _run_decrypt(dec: _Decryptor | _Opener, data: Iterable[bytes]) -> Iterator[bytes]:
    for piece in data:
        yield from dec.feed(piece)
    dec.finish()


async def _arun_decrypt(
    dec: _Decryptor | _Opener, data: AsyncIterable[bytes]
) -> AsyncIterator[bytes]:
    async for piece in data:
        for chunk in dec.feed(piece):
            yield chunk
    dec.finish()


def _new_encryptor(key: bytes, chunk_size: int, aad: bytes) -> _Encryptor:
    _check_key("key", key)
    _check_chunk_size(chunk_size)
    return _Encryptor(key, chunk_size, aad)


def _new_decryptor(key: bytes, aad: bytes, max_chunk_size: int, what: str) -> _Decryptor:
    _check_key("key", key)
    _check_chunk_size(max_chunk_size, "max_chunk_size")
    return _Decryptor(key, aad=aad, max_chunk_size=max_chunk_size, what=f"decrypt {what}")


# ------------------------------------------------------------ symmetric streams


def encrypt_chunks(
    key: bytes,
    chunks: Iterable[bytes | memoryview],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    aad: bytes = b"",
) -> Iterator[bytes]:
    """Encrypt ``chunks`` under ``key`` into the stream format, lazily.

    Input is re-chunked to ``chunk_size``; at most one chunk is held. ``aad``
    is authenticated with every frame and must be given again to decrypt.
    Raises InvalidArgument at once for a bad key or chunk size.
    """
    return _run_encrypt(_new_encryptor(key, chunk_size, aad), b"", chunks)


def aencrypt_chunks(
    key: bytes,
    chunks: AsyncIterable[bytes],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    aad: bytes = b"",
) -> AsyncIterator[bytes]:
    """Async :func:`encrypt_chunks` over an async iterable."""
    return _arun_encrypt(_new_encryptor(key, chunk_size, aad), b"", chunks)


def decrypt_chunks(
    key: bytes,
    data: Iterable[bytes],
    *,
    aad: bytes = b"",
    max_chunk_size: int = MAX_CHUNK_SIZE,
    what: str = "stream",
) -> Iterator[bytes]:
    """Decrypt a stream made by :func:`encrypt_chunks`, yielding plaintext chunks.

    ``data`` may be split anywhere. Each yielded chunk is authenticated, but
    the stream as a whole is complete only when iteration ends without error:
    IntegrityError("decrypt <what>: ...") is raised for a wrong key, a
    flipped, dropped or reordered chunk, a truncated stream or trailing data.
    """
    return _run_decrypt(_new_decryptor(key, aad, max_chunk_size, what), data)


def adecrypt_chunks(
    key: bytes,
    data: AsyncIterable[bytes],
    *,
    aad: bytes = b"",
    max_chunk_size: int = MAX_CHUNK_SIZE,
    what: str = "stream",
) -> AsyncIterator[bytes]:
    """Async :func:`decrypt_chunks` over an async iterable."""
    return _arun_decrypt(_new_decryptor(key, aad, max_chunk_size, what), data)


# ------------------------------------------------------------ sealed containers


def _new_sealer(
    recipients: Sequence[bytes], chunk_size: int, aad: bytes
) -> tuple[_Encryptor, bytes]:
    _check_chunk_size(chunk_size)
    if isinstance(recipients, bytes | bytearray):
        # A single key passed by mistake would otherwise be read as 32 "keys".
        raise InvalidArgument("recipients", "must be a sequence of public keys")
    data_key = new_stream_key()
    header = _seal_header(data_key, recipients, chunk_size)
    return _Encryptor(data_key, chunk_size, header + bytes(aad)), header


def seal(
    chunks: Iterable[bytes],
    recipients: Sequence[bytes],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    aad: bytes = b"",
) -> Iterator[bytes]:
    """Encrypt ``chunks`` under a fresh data key sealed to each recipient.

    Any one of ``recipients`` (1 to 16 distinct X25519 public keys) can open
    the result with :func:`open_sealed`. Raises InvalidArgument at once for
    bad recipients or chunk size.
    """
    enc, header = _new_sealer(recipients, chunk_size, aad)
    return _run_encrypt(enc, header, chunks)


def aseal(
    chunks: AsyncIterable[bytes],
    recipients: Sequence[bytes],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    aad: bytes = b"",
) -> AsyncIterator[bytes]:
    """Async :func:`seal` over an async iterable."""
    enc, header = _new_sealer(recipients, chunk_size, aad)
    return _arun_encrypt(enc, header, chunks)


def _new_opener(keypair: BoxKeyPair, aad: bytes, what: str) -> _Opener:
    if not isinstance(keypair, BoxKeyPair):
        raise InvalidArgument("keypair", "must be a BoxKeyPair")
    return _Opener(keypair, aad=aad, what=f"open {what}")


def open_sealed(
    data: Iterable[bytes],
    keypair: BoxKeyPair,
    *,
    aad: bytes = b"",
    what: str = "sealed container",
) -> Iterator[bytes]:
    """Open a container made by :func:`seal`, yielding plaintext chunks.

    Raises IntegrityError("open <what>: ...") for a bad magic or version, a
    container not sealed to ``keypair``, a tampered header or frame, or a
    truncated stream. As with :func:`decrypt_chunks`, the plaintext is
    complete only when iteration ends without error.
    """
    return _run_decrypt(_new_opener(keypair, aad, what), data)


def aopen_sealed(
    data: AsyncIterable[bytes],
    keypair: BoxKeyPair,
    *,
    aad: bytes = b"",
    what: str = "sealed container",
) -> AsyncIterator[bytes]:
    """Async :func:`open_sealed` over an async iterable."""
    return _arun_decrypt(_new_opener(keypair, aad, what), data)


def seal_bytes(
    data: bytes,
    recipients: Sequence[bytes],
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    aad: bytes = b"",
) -> bytes:
    """Seal a small in-memory value (a manifest, a prompt) in one call."""
    return b"".join(seal([data], recipients, chunk_size=chunk_size, aad=aad))


def prompt_aad(prompt_id: str, agent_id: str) -> bytes:
    """What a queued prompt's seal is bound to (the control plane seals, the
    machine opens): a sealed prompt cannot be replayed under another prompt id
    or for another agent."""
    return f"agents-prompt:{prompt_id}:{agent_id}".encode()


def open_bytes(
    blob: bytes,
    keypair: BoxKeyPair,
    *,
    aad: bytes = b"",
    what: str = "sealed container",
) -> bytes:
    """Open a container made by :func:`seal_bytes` (or :func:`seal`) in one call."""
    return b"".join(open_sealed([blob], keypair, aad=aad, what=what))


# ------------------------------------------------------------------ keyed hashes

_HASH_SIZE: Final = 32


class KeyedHasher:
    """Incremental keyed BLAKE2b-256; same result as :func:`keyed_hash`."""

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes | bytearray) or not 16 <= len(key) <= 64:
            raise InvalidArgument("key", "must be 16 to 64 bytes")
        self._h = hashlib.blake2b(key=bytes(key), digest_size=_HASH_SIZE)

    def __repr__(self) -> str:
        return "KeyedHasher()"

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Add ``data`` to the hash."""
        self._h.update(data)

    def digest(self) -> bytes:
        """The 32-byte hash of everything added so far."""
        return self._h.digest()

    def hexdigest(self) -> str:
        """The hash as 64 lower-case hex characters."""
        return self._h.hexdigest()


def keyed_hash(key: bytes, data_or_chunks: bytes | bytearray | memoryview | Iterable[bytes]) -> str:
    """Keyed BLAKE2b-256 (hex) of ``data_or_chunks``, used to name segments.

    Without the key, the name reveals nothing about the plaintext; with it,
    the same plaintext always gets the same name, so segments are reused.
    """
    hasher = KeyedHasher(key)
    if isinstance(data_or_chunks, bytes | bytearray | memoryview):
        hasher.update(data_or_chunks)
    else:
        for chunk in data_or_chunks:
            hasher.update(chunk)
    return hasher.hexdigest()
