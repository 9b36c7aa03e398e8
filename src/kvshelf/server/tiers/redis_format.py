"""The Redis tier's keys and values: versioned key names, and a checked, authenticated value.

Key: ``kvshelf:v2:<pool>:<rank>:<block hash, hex>``. The pool name carries the model, the KV
layout and the world size (:func:`kvshelf.protocol.pool_name`), so engines of another model or
layout never read each other's objects. No ``{hash tag}``: in a Redis Cluster every key hashes
to its own slot, so the objects spread over all the masters. The version in the key is the
value format's: values of format 1 (``kvshelf:v1:...``, HMAC-SHA256 tags) are never asked for,
so to this version they are misses; ``kvshelf clear --shared`` deletes them.

Value: a fixed header, the pool name, the block hash, the page bytes, and (with a secret) a
tag::

    magic "KVSH" | format version u16 | auth u8 | 0 u8 | pool length u16 | hash length u16 |
    rank u32 | payload length u64 | checksum u64 | pool | hash | payload | [tag]

Without a secret, ``auth`` is 0, there is no tag and the checksum is the XXH3-64 of the
payload. With one, ``auth`` is 1, the checksum field is 0 and the tag is a keyed BLAKE3 (32
bytes, keyed by a key derived from the secret the nodes share) over every byte before it: one
hash pass over the page, which catches damage and forgery alike. A value is loaded only if
the header names exactly the key asked for (pool, rank, hash), the page size and this node's
``auth``, and its checksum or tag matches; anything else is :class:`CorruptValue`. Whoever can
write to Redis can compute a checksum; only the tag catches a forgery.

:class:`ValueCodec` checks a value as it is received (:meth:`ValueCodec.receive_into`: the
header, then the payload into the page, hashed piece by piece as it lands, then the tag) or
from bytes (:meth:`ValueCodec.decode_into`). Must not import torch or vLLM.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Callable
from typing import Protocol

import blake3
import xxhash

FORMAT_VERSION = 2
# Every key kvshelf writes starts with this (what a clear of kvshelf's keys would match).
KEY_PREFIX = b"kvshelf:v%d:" % FORMAT_VERSION
# What kvshelf clear --shared deletes: the keys of every format version, nothing else.
KEY_PATTERN = b"kvshelf:v[0-9]*:*"
MAGIC = b"KVSH"
_HEADER = struct.Struct("<4sHBBHHIQQ")
TAG_BYTES = 32
# Derives the tag's key from the secret (BLAKE3's key derivation: application, date, purpose).
_KEY_CONTEXT = "kvshelf 2026-12-02 redis value tag v2"


class CorruptValue(Exception):
    """A value that fails its checks: never loaded."""


class ValueSource(Protocol):
    """Where a value's bytes come from as they are received (a RESP reply reader)."""

    def read_into(
        self, dest: memoryview, landed: Callable[[memoryview], object] | None = None
    ) -> None: ...

    def exact(self, size: int) -> bytes: ...

    def skip(self, size: int) -> None: ...


def object_key(pool: str, rank: int, block_hash: bytes) -> bytes:
    """The Redis key of one object."""
    return b"%s%s:%d:%s" % (KEY_PREFIX, pool.encode(), rank, block_hash.hex().encode())


class ValueCodec:
    """Values' encoding and checks for one node.

    Args:
        secret: the secret the nodes share (``--l3-secret-file``); None: checksums only.
    """

    def __init__(self, secret: bytes | None) -> None:
        self._key = (
            blake3.blake3(secret, derive_key_context=_KEY_CONTEXT).digest() if secret else None
        )
        self._tag_bytes = TAG_BYTES if secret else 0

    def value_bytes(self, pool: str, block_hash: bytes, page_bytes: int) -> int:
        """The size of an object's value in Redis."""
        return _HEADER.size + len(pool.encode()) + len(block_hash) + page_bytes + self._tag_bytes

    def encode(
        self, pool: str, rank: int, block_hash: bytes, payload: memoryview
    ) -> tuple[bytes, bytes]:
        """An object's value as the bytes before the payload and the tag after it (the payload
        is sent as it is, never joined with them)."""
        if self._key is None:
            checksum = xxhash.xxh3_64_intdigest(payload)
            return _head(pool, rank, block_hash, payload.nbytes, checksum, 0), b""
        head = _head(pool, rank, block_hash, payload.nbytes, 0, 1)
        tagger = blake3.blake3(head, key=self._key)
        tagger.update(payload)
        return head, tagger.digest()

    def receive_into(
        self,
        source: ValueSource,
        size: int,
        pool: str,
        rank: int,
        block_hash: bytes,
        page: memoryview,
    ) -> None:
        """Receive a value of ``size`` bytes from ``source`` into ``page``, checking it as it
        lands. The value's bytes are consumed whether it is loaded or not.

        Raises:
            CorruptValue: any check failed; ``page`` may hold part of the bytes then.
        """
        head_bytes = _HEADER.size + len(pool.encode()) + len(block_hash)
        head = source.exact(min(size, head_bytes))
        try:
            checksum = self._check_head(head, size, pool, rank, block_hash, page.nbytes)
        except CorruptValue:
            source.skip(size - len(head))
            raise
        if self._key is None:
            hasher = xxhash.xxh3_64()
            source.read_into(page, hasher.update)
            if hasher.intdigest() != checksum:
                raise CorruptValue("checksum mismatch")
            return
        tagger = blake3.blake3(head, key=self._key)
        source.read_into(page, tagger.update)
        if not hmac.compare_digest(tagger.digest(), source.exact(TAG_BYTES)):
            raise CorruptValue("tag mismatch: not written by a node with this secret")

    def decode_into(
        self, value: bytes, pool: str, rank: int, block_hash: bytes, page: memoryview
    ) -> None:
        """Check ``value`` (whole, in memory) and copy its payload into ``page``.

        Raises:
            CorruptValue: any check failed; ``page`` may hold part of the bytes then.
        """
        self.receive_into(_BytesSource(value), len(value), pool, rank, block_hash, page)

    def _check_head(
        self, head: bytes, size: int, pool: str, rank: int, block_hash: bytes, page_bytes: int
    ) -> int:
        """The checksum the header states, once the header matches the key asked for."""
        if len(head) < _HEADER.size:
            raise CorruptValue(f"{size} bytes: shorter than the header")
        magic, version, auth, _, pool_len, hash_len, got_rank, length, checksum = (
            _HEADER.unpack_from(head)
        )
        if magic != MAGIC or version != FORMAT_VERSION:
            raise CorruptValue(f"not a kvshelf v{FORMAT_VERSION} value")
        if auth != (self._key is not None):
            raise CorruptValue(
                "no tag, and this node requires one (--l3-secret-file)"
                if self._key is not None
                else "tagged by a node with --l3-secret-file; this node has no secret to check it"
            )
        if size != self.value_bytes(pool, block_hash, page_bytes) or length != page_bytes:
            raise CorruptValue(f"{size} bytes for a payload of {length}; expected {page_bytes}")
        pool_bytes = pool.encode()
        if (
            got_rank != rank
            or (pool_len, hash_len) != (len(pool_bytes), len(block_hash))
            or head[_HEADER.size :] != pool_bytes + block_hash
        ):
            raise CorruptValue("the header names another key")
        return checksum


def _head(pool: str, rank: int, block_hash: bytes, length: int, checksum: int, auth: int) -> bytes:
    pool_bytes = pool.encode()
    fields = (MAGIC, FORMAT_VERSION, auth, 0, len(pool_bytes), len(block_hash), rank, length)
    return _HEADER.pack(*fields, checksum) + pool_bytes + block_hash


class _BytesSource:
    """A value already in memory, read as a :class:`ValueSource`."""

    def __init__(self, value: bytes) -> None:
        self._data = memoryview(value)
        self._at = 0

    def read_into(
        self, dest: memoryview, landed: Callable[[memoryview], object] | None = None
    ) -> None:
        dest[:] = self._take(dest.nbytes)
        if landed is not None:
            landed(dest)

    def exact(self, size: int) -> bytes:
        return bytes(self._take(size))

    def skip(self, size: int) -> None:
        self._take(size)

    def _take(self, size: int) -> memoryview:
        if self._at + size > self._data.nbytes:
            raise CorruptValue("truncated")
        piece = self._data[self._at : self._at + size]
        self._at += size
        return piece
