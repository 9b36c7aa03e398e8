"""The Redis tier's keys and values: every check a value must pass before it is loaded, and the
URL checks and redaction (no Redis server needed)."""

from __future__ import annotations

import struct

import pytest

from kvshelf.server.tiers.redis_format import KEY_PREFIX, CorruptValue, ValueCodec, object_key
from kvshelf.server.tiers.redis_link import check_url, redacted

POOL = "m-l-1"
HASH = b"\x01\x02" * 16
PAGE = bytes(range(256)) * 16
SECRET = b"between the nodes"


def encode(secret: bytes | None) -> bytes:
    head, tag = ValueCodec(secret).encode(POOL, 1, HASH, memoryview(PAGE))
    return head + PAGE + tag


def decode(value: bytes, secret: bytes | None = SECRET, **key: object) -> bytes:
    page = bytearray(len(PAGE))
    args = {"pool": POOL, "rank": 1, "block_hash": HASH, **key}
    codec = ValueCodec(secret)
    codec.decode_into(value, args["pool"], args["rank"], args["block_hash"], memoryview(page))
    return bytes(page)


@pytest.mark.parametrize("secret", [SECRET, None])
def test_a_value_round_trips_and_has_its_stated_size(secret: bytes | None) -> None:
    value = encode(secret)
    assert len(value) == ValueCodec(secret).value_bytes(POOL, HASH, len(PAGE))
    assert decode(value, secret) == PAGE


def test_keys_name_version_pool_rank_and_hash_without_hash_tags() -> None:
    key = object_key(POOL, 3, HASH)
    assert key == KEY_PREFIX + b"m-l-1:3:" + HASH.hex().encode()
    assert b"{" not in key
    assert object_key(POOL, 2, HASH) != key != object_key("other", 3, HASH)


def test_every_damage_or_forgery_is_refused() -> None:
    value = encode(SECRET)
    flipped = bytearray(value)
    flipped[len(value) // 2] ^= 1
    unsigned = encode(None)
    header = bytearray(value)
    header[30] ^= 1  # the checksum field, unused (0) in a tagged value: covered by the tag
    bad = {
        "flipped payload byte": (bytes(flipped), {}),
        "truncated": (value[:-1], {}),
        "longer": (value + b"x", {}),
        "too short for a header": (value[:10], {}),
        "another rank": (value, {"rank": 2}),
        "another pool": (value, {"pool": "m-l-2"}),
        "another hash": (value, {"block_hash": b"\x09" * 32}),
        "no tag where one is required": (unsigned, {}),
        "a header byte changed": (bytes(header), {}),
        "flipped tag byte": (value[:-1] + bytes([value[-1] ^ 1]), {}),
    }
    for data, key in bad.values():
        with pytest.raises(CorruptValue):
            decode(data, **key)
    with pytest.raises(CorruptValue, match="tag mismatch"):
        decode(value, b"another secret")
    with pytest.raises(CorruptValue, match="no secret"):
        decode(value, None)
    # Without a secret: the header is checked field by field (the names split otherwise)...
    shifted = bytearray(unsigned)
    shifted[8:12] = struct.pack("<HH", len(POOL) - 1, len(HASH) + 1)
    with pytest.raises(CorruptValue, match="another key"):
        decode(bytes(shifted), None)
    # ...and the checksum catches damage (not forgery).
    damaged = bytearray(unsigned)
    damaged[-5] ^= 1
    with pytest.raises(CorruptValue, match="checksum"):
        decode(bytes(damaged), None)


def test_urls_are_checked_and_logged_without_credentials() -> None:
    for url in ("redis://h:6379", "rediss://u:p@h:6380/2", "redis://[::1]:7000"):
        assert check_url(url) is None, url
    assert "scheme" in (check_url("http://h:1") or "")
    assert "database" in (check_url("redis://h:1/x") or "")
    assert check_url("redis://h:99999") is not None
    assert check_url("redis://:1") == "no host"
    assert redacted("rediss://user:pw@h:6380/2") == "rediss://h:6380/2"
