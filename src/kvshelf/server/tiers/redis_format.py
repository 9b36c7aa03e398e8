"""The Redis tier's keys and values: versioned key names, and a checked, authenticated value.

Key: ``kvshelf:v1:<pool>:<rank>:<block hash, hex>``. The pool name carries the model, the KV
layout and the world size (:func:`kvshelf.protocol.pool_name`), so engines of another model or
layout never read each other's objects. No ``{hash tag}``: in a Redis Cluster every key hashes
to its own slot, so the objects spread over all the masters.

Value: a fixed header, the pool name, the block hash, the page bytes, and (with a secret) an
HMAC-SHA256 tag::

    magic "KVSH" | format version u16 | auth u8 | 0 u8 | pool length u16 | hash length u16 |
    rank u32 | payload length u64 | XXH3-64 of the payload u64 | pool | hash | payload | [tag]

``auth`` is 1 when the tag is there: HMAC-SHA256, keyed by the secret the nodes share, over
every byte before it. A value is loaded only if the header names exactly the key asked for
(pool, rank, hash) and the page size, the checksum matches, and, when this node has a secret,
the tag verifies; anything else is :class:`CorruptValue`. The checksum catches damage; only
the tag catches a forgery (whoever can write to Redis can compute a checksum).

Must not import torch or vLLM.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import xxhash

FORMAT_VERSION = 1
# Every key kvshelf writes starts with this (what a clear of kvshelf's keys would match).
KEY_PREFIX = b"kvshelf:v%d:" % FORMAT_VERSION
# What kvshelf clear --shared deletes: the keys of every format version, nothing else.
KEY_PATTERN = b"kvshelf:v[0-9]*:*"
MAGIC = b"KVSH"
_HEADER = struct.Struct("<4sHBBHHIQQ")
TAG_BYTES = hashlib.sha256().digest_size


class CorruptValue(Exception):
    """A value that fails its checks: never loaded."""


def object_key(pool: str, rank: int, block_hash: bytes) -> bytes:
    """The Redis key of one object."""
    return b"%s%s:%d:%s" % (KEY_PREFIX, pool.encode(), rank, block_hash.hex().encode())


def value_bytes(pool: str, block_hash: bytes, page_bytes: int, secret: bytes | None) -> int:
    """The size of an object's value in Redis."""
    tag = TAG_BYTES if secret else 0
    return _HEADER.size + len(pool.encode()) + len(block_hash) + page_bytes + tag


def encode_value(
    pool: str, rank: int, block_hash: bytes, payload: memoryview, secret: bytes | None
) -> bytes:
    """The value of one object: header, pool, hash, payload and (with a secret) the tag."""
    pool_bytes = pool.encode()
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        1 if secret else 0,
        0,
        len(pool_bytes),
        len(block_hash),
        rank,
        payload.nbytes,
        xxhash.xxh3_64_intdigest(payload),
    )
    body = b"".join((header, pool_bytes, block_hash, payload))
    if not secret:
        return body
    return body + hmac.new(secret, body, hashlib.sha256).digest()


def decode_into(
    value: bytes,
    pool: str,
    rank: int,
    block_hash: bytes,
    page: memoryview,
    secret: bytes | None,
) -> None:
    """Check ``value`` against the key asked for and copy its payload into ``page``.

    Raises:
        CorruptValue: any check failed; ``page`` may hold part of the bytes then.
    """
    size = len(value)
    if size < _HEADER.size:
        raise CorruptValue(f"{size} bytes: shorter than the header")
    magic, version, auth, _, pool_len, hash_len, got_rank, length, checksum = _HEADER.unpack_from(
        value
    )
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptValue(f"not a kvshelf v{FORMAT_VERSION} value")
    if secret and auth != 1:
        raise CorruptValue("no HMAC tag, and this node requires one (--l3-secret-file)")
    tag = TAG_BYTES if auth else 0
    start = _HEADER.size + pool_len + hash_len
    if size != start + length + tag or length != page.nbytes:
        raise CorruptValue(f"{size} bytes for a payload of {length}; expected {page.nbytes}")
    data = memoryview(value)
    name = data[_HEADER.size : _HEADER.size + pool_len]
    if (
        got_rank != rank
        or name != pool.encode()
        or data[_HEADER.size + pool_len : start] != (block_hash)
    ):
        raise CorruptValue("the header names another key")
    if secret:
        expected = hmac.new(secret, data[: size - tag], hashlib.sha256).digest()
        if not hmac.compare_digest(expected, data[size - tag :]):
            raise CorruptValue("HMAC mismatch: not written by a node with this secret")
    payload = data[start : start + length]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise CorruptValue("checksum mismatch")
    page[:] = payload
