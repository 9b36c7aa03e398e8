"""The wire codec: round trips, and every kind of bad frame maps to the right error code."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshelf.protocol import (
    MAX_FRAME_BYTES,
    MAX_HASHES_PER_REQUEST,
    MAX_OBJECTS_PER_REQUEST,
    MAX_WORLD_SIZE,
    PROTOCOL_VERSION,
    REPLY_TYPES,
    REQUEST_TYPES,
    Abort,
    Ack,
    Commit,
    Error,
    ErrorCode,
    Events,
    EventsReply,
    Lookup,
    LookupReply,
    MsgType,
    PageLayout,
    Ping,
    Pong,
    ProtocolError,
    Register,
    Registered,
    Release,
    Reserve,
    ReserveReply,
    Stats,
    StatsReply,
    decode_reply,
    decode_request,
    encode,
    max_request_keys,
    pool_name,
)

LAYOUT = PageLayout(
    model_fingerprint="model", layout_fingerprint="layout", page_bytes=4096, world_size=2, rank=1
)
HASHES = [bytes([i]) * 32 for i in range(3)]

REQUESTS = [
    Ping(request_id=1),
    Register(request_id=2, layout=LAYOUT),
    Lookup(request_id=3, pool="p", hashes=HASHES, world_size=2, lock=True),
    Reserve(request_id=4, pool="p", rank=1, hashes=HASHES),
    Commit(request_id=5, reservation_id=7),
    Abort(request_id=6, reservation_id=7),
    Release(request_id=7, lock_id=9, rank=0),
    Stats(request_id=8),
]
REPLIES = [
    Error(request_id=1, boot_id="b", code=ErrorCode.UNKNOWN_LOCK, message="no"),
    Pong(request_id=2, boot_id="b"),
    Registered(request_id=3, boot_id="b", pool="p", shm_name="s", arena_bytes=8, page_bytes=4),
    LookupReply(request_id=4, boot_id="b", num_hit_blocks=2, lock_id=3, pages=[[1, 2], [3, 4]]),
    ReserveReply(request_id=5, boot_id="b", reservation_id=6, pages=[1, None, 2]),
    Ack(request_id=6, boot_id="b"),
    StatsReply(request_id=7, boot_id="b", stats={"a": 1}),
]


def _raw(**fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_request_round_trip(msg: object) -> None:
    assert decode_request(encode(msg)) == msg


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_reply_round_trip(msg: object) -> None:
    assert decode_reply(encode(msg)) == msg


def test_every_type_is_a_request_or_a_reply() -> None:
    assert {int(t) for t in MsgType} == REQUEST_TYPES | REPLY_TYPES
    assert not REQUEST_TYPES & REPLY_TYPES


def test_every_message_carries_version_and_request_id() -> None:
    for msg in REQUESTS + REPLIES:
        wire = msgspec.msgpack.decode(encode(msg))
        assert wire["version"] == PROTOCOL_VERSION
        assert "request_id" in wire
    for msg in REPLIES:
        assert "boot_id" in msgspec.msgpack.decode(encode(msg))


@pytest.mark.parametrize(
    ("frame", "code", "request_id"),
    [
        (b"", ErrorCode.MALFORMED, 0),
        (b"\xc1", ErrorCode.MALFORMED, 0),
        (msgspec.msgpack.encode([1, 2, 3]), ErrorCode.MALFORMED, 0),
        (encode(Ping(request_id=5))[:-1], ErrorCode.MALFORMED, 0),
        (_raw(type=1, version=PROTOCOL_VERSION + 1, request_id=5), ErrorCode.BAD_VERSION, 5),
        (_raw(type=1, version="1", request_id=5), ErrorCode.BAD_VERSION, 5),
        (_raw(type=99, version=PROTOCOL_VERSION, request_id=5), ErrorCode.UNKNOWN_TYPE, 5),
        (_raw(type="ping", version=PROTOCOL_VERSION, request_id=5), ErrorCode.UNKNOWN_TYPE, 5),
        (encode(Pong(request_id=5, boot_id="b")), ErrorCode.UNKNOWN_TYPE, 5),
        (
            _raw(type=int(MsgType.COMMIT), version=PROTOCOL_VERSION, request_id=5),
            ErrorCode.MALFORMED,
            5,
        ),
        (
            _raw(
                type=int(MsgType.COMMIT), version=PROTOCOL_VERSION, request_id=5, reservation_id=-1
            ),
            ErrorCode.MALFORMED,
            5,
        ),
        (
            _raw(type=int(MsgType.PING), version=PROTOCOL_VERSION, request_id=-3),
            ErrorCode.MALFORMED,
            0,
        ),
        (b"\x00" * (MAX_FRAME_BYTES + 1), ErrorCode.FRAME_TOO_LARGE, 0),
    ],
)
def test_bad_request_frames(frame: bytes, code: ErrorCode, request_id: int) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_request(frame)
    assert info.value.code is code
    assert info.value.request_id == request_id


TOO_MANY = MAX_HASHES_PER_REQUEST + 1


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (
            Lookup(request_id=5, pool="p", hashes=[b"h"] * TOO_MANY, world_size=1, lock=False),
            "hashes",
        ),
        (
            Lookup(
                request_id=5, pool="p", hashes=[], world_size=1, lock=False, ends=[[]] * TOO_MANY
            ),
            "ends",
        ),
        (
            Lookup(
                request_id=5,
                pool="p",
                hashes=[b"h"],
                world_size=1,
                lock=False,
                ends=[[b"s"] * TOO_MANY],
            ),
            "ends[0]",
        ),
        (Reserve(request_id=5, pool="p", rank=0, hashes=[b"h"] * TOO_MANY), "hashes"),
        (Events(request_id=5, pool="p", probe=[b"h"] * TOO_MANY), "probe"),
    ],
    ids=["hashes", "ends", "an end's keys", "reserve", "probe"],
)
def test_every_list_of_a_request_is_bounded_naming_the_field(request_: object, field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_request(encode(request_))
    assert info.value.code is ErrorCode.MALFORMED
    assert info.value.request_id == 5
    assert f"length <= {MAX_HASHES_PER_REQUEST} - at `$.{field}`" in info.value.message


@pytest.mark.parametrize(
    ("reply", "field"),
    [
        (
            LookupReply(
                request_id=5,
                boot_id="b",
                num_hit_blocks=0,
                lock_id=0,
                pages=[[]] * (MAX_WORLD_SIZE + 1),
            ),
            "pages",
        ),
        (
            ReserveReply(request_id=5, boot_id="b", reservation_id=1, pages=[None] * TOO_MANY),
            "pages",
        ),
        (
            EventsReply(request_id=5, boot_id="b", kinds=[1] * TOO_MANY, hashes=[], next_seq=0),
            "kinds",
        ),
    ],
    ids=["lookup pages", "reserve pages", "event kinds"],
)
def test_reply_lists_are_bounded(reply: object, field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_reply(encode(reply))
    assert f"at `$.{field}`" in info.value.message


def test_a_request_names_at_most_the_objects_bound() -> None:
    assert max_request_keys(1) == MAX_HASHES_PER_REQUEST
    assert max_request_keys(8) * 8 == MAX_OBJECTS_PER_REQUEST
    assert max_request_keys(MAX_WORLD_SIZE) * MAX_WORLD_SIZE == MAX_OBJECTS_PER_REQUEST
    assert max_request_keys(3) * 3 <= MAX_OBJECTS_PER_REQUEST


def test_layout_rank_must_be_below_world_size() -> None:
    with pytest.raises(ValueError, match="rank"):
        PageLayout(
            model_fingerprint="m", layout_fingerprint="l", page_bytes=1, world_size=2, rank=2
        )
    frame = _raw(
        type=int(MsgType.REGISTER),
        version=PROTOCOL_VERSION,
        request_id=1,
        layout={
            "model_fingerprint": "m",
            "layout_fingerprint": "l",
            "page_bytes": 1,
            "world_size": 2,
            "rank": 2,
        },
    )
    with pytest.raises(ProtocolError) as info:
        decode_request(frame)
    assert info.value.code is ErrorCode.MALFORMED


def test_pool_name_is_stable_and_distinguishes_its_inputs() -> None:
    name = pool_name("m", "l", 2)
    assert name == pool_name("m", "l", 2)
    # Fixed value: pool names must agree across processes, restarts and versions.
    assert name == "pool-e8973f012a0df6fb8948066098d644b5"
    others = {pool_name("m", "l", 1), pool_name("ml", "", 2), pool_name("m", "l2", 2)}
    assert name not in others and len(others) == 3


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_decoding_random_bytes_raises_only_protocol_errors(frame: bytes) -> None:
    for decode in (decode_request, decode_reply):
        with contextlib.suppress(ProtocolError):
            decode(frame)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["type", "version", "request_id", "pool", "hashes", "rank", "lock"]),
        st.one_of(
            st.integers(-(2**63), 2**64 - 1), st.binary(max_size=40), st.text(max_size=5), st.none()
        ),
    )
)
def test_decoding_random_maps_raises_only_protocol_errors(fields: dict) -> None:
    with contextlib.suppress(ProtocolError):
        decode_request(msgspec.msgpack.encode(fields))
