"""The tier's RESP reply reader fed random, damaged and truncated byte streams through a real
socket pair: a page is reported loaded only with exactly the bytes written for its key, every
other outcome is a miss, a framing error or a closed connection, and a stream read without
an error was consumed exactly (the connection is in step). Also: commands sent in pieces with
one scatter-gather call arrive byte for byte as RESP."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshelf.server.tiers.redis_format import CorruptValue, ValueCodec
from kvshelf.server.tiers.redis_resp import (
    FramingError,
    Redirect,
    ReplyReader,
    send_all,
    set_command,
)
from kvshelf.server.tiers.redis_stream import read_gets

POOL = "m-l-1"
SECRET = b"between the nodes"


def block(i: int) -> bytes:
    return b"%031d!" % i


def reply(codec: ValueCodec, i: int, data: bytes) -> bytes:
    head, tag = codec.encode(POOL, 0, block(i), memoryview(data))
    value = head + data + tag
    return b"$%d\r\n%s\r\n" % (len(value), value)


def read_stream(
    stream: bytes, codec: ValueCodec, count: int, page_bytes: int
) -> tuple[list[bytes | str], BaseException | None, bool]:
    """Read ``count`` GET replies off a socket fed ``stream``: each key's page or outcome, the
    error that stopped the reading, and whether the stream was consumed exactly."""
    ours, theirs = socket.socketpair()
    ours.settimeout(5)
    writer = threading.Thread(
        target=lambda: (theirs.sendall(stream), theirs.shutdown(socket.SHUT_WR))
    )
    writer.start()
    pages = [bytearray(page_bytes) for _ in range(count)]
    results: list[bytes | str] = ["not read"] * count

    def receive(i: int, reader: ReplyReader, size: int) -> None:
        try:
            codec.receive_into(reader, size, POOL, 0, block(i), memoryview(pages[i]))
            results[i] = bytes(pages[i])
        except CorruptValue:
            results[i] = "corrupt"

    def take(i: int, value: bytes | None) -> None:
        assert value is None
        results[i] = "missing"

    reader = ReplyReader(ours)
    error: BaseException | None = None
    try:
        for i in read_gets(reader, range(count), receive, take):
            results[i] = "redirected"
        exact = reader.pending == 0 and ours.recv(1) == b""
    except (FramingError, ConnectionError) as exc:
        error, exact = exc, False
    writer.join()
    ours.close()
    theirs.close()
    return results, error, exact


def valid_stream(codec: ValueCodec, pages: list[bytes | None]) -> bytes:
    return b"".join(
        b"$-1\r\n" if data is None else reply(codec, i, data) for i, data in enumerate(pages)
    )


page_sizes = st.sampled_from([1, 100, 4096, 40000])


@settings(max_examples=150, deadline=None)
@given(
    secret=st.sampled_from([None, SECRET]),
    page_bytes=page_sizes,
    present=st.lists(st.booleans(), min_size=1, max_size=4),
    seed=st.binary(min_size=1, max_size=8),
    damage=st.sampled_from(["none", "truncate", "flip", "insert", "delete"]),
    where=st.floats(0, 1, exclude_max=True),
    noise=st.binary(min_size=1, max_size=16),
)
def test_damaged_or_truncated_streams_never_land_a_wrong_page(
    secret: bytes | None,
    page_bytes: int,
    present: list[bool],
    seed: bytes,
    damage: str,
    where: float,
    noise: bytes,
) -> None:
    codec = ValueCodec(secret)
    unit = seed + bytes([len(seed)])
    pages = [
        ((unit * (page_bytes // len(unit) + 1))[:page_bytes] + bytes([i]))[1:] if here else None
        for i, here in enumerate(present)
    ]
    stream = valid_stream(codec, pages)
    at = int(where * len(stream))
    damaged = {
        "none": stream,
        "truncate": stream[:at],
        "flip": stream[:at] + bytes([stream[at] ^ noise[0] or 1]) + stream[at + 1 :],
        "insert": stream[:at] + noise + stream[at:],
        "delete": stream[:at] + stream[at + len(noise) :],
    }[damage]
    results, error, exact = read_stream(damaged, codec, len(pages), page_bytes)
    for i, result in enumerate(results):
        if isinstance(result, bytes):
            assert result == pages[i], f"key {i}: a wrong page reported loaded"
    if damage == "none":
        assert error is None and exact
        assert results == [p if p is not None else "missing" for p in pages]
    if error is None and damage != "none":
        # Read to the end without a framing error: the damage hit one value's bytes only,
        # which is then a miss, and the stream was consumed exactly.
        assert exact or damage in ("insert", "flip")


@settings(max_examples=200, deadline=None)
@given(stream=st.binary(max_size=300), count=st.integers(1, 3))
def test_random_bytes_are_framing_errors_misses_or_closed_connections(
    stream: bytes, count: int
) -> None:
    results, error, _ = read_stream(stream, ValueCodec(None), count, 64)
    assert not any(isinstance(result, bytes) for result in results)
    assert error is None or isinstance(error, (FramingError, ConnectionError))


def test_error_replies_and_redirects() -> None:
    cases = {
        b"-MOVED 3999 127.0.0.1:6381\r\n": "redirected",
        b"-ASK 3999 127.0.0.1:6381\r\n": "redirected",
        b"_\r\n": "missing",
    }
    for stream, outcome in cases.items():
        results, error, exact = read_stream(stream, ValueCodec(None), 1, 64)
        assert (results, error, exact) == ([outcome], None, True)
    for stream in (b"-ERR wrong\r\n", b"+OK\r\n", b"$abc\r\n", b"$+5\r\nhello\r\n", b"*1\r\n"):
        _, error, _ = read_stream(stream, ValueCodec(None), 1, 64)
        assert isinstance(error, FramingError), stream
    _, error, _ = read_stream(b"$" + b"9" * 5000, ValueCodec(None), 1, 64)
    assert isinstance(error, FramingError)


@pytest.mark.parametrize("px_ms", [None, 1500])
def test_a_set_sent_in_pieces_arrives_as_one_resp_command(px_ms: int | None) -> None:
    page = memoryview(bytes(range(256)) * 8192)  # 2 MiB: more than one sendmsg's worth
    pieces = set_command(b"k", [b"head", page, b"tag"], px_ms) * 3
    ours, theirs = socket.socketpair()
    got = bytearray()
    reader = threading.Thread(target=lambda: _receive_all(theirs, got))
    reader.start()
    send_all(ours, pieces)
    ours.shutdown(socket.SHUT_WR)
    reader.join()
    ours.close()
    theirs.close()
    value = b"head" + bytes(page) + b"tag"
    one = b"*%d\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n%s\r\n" % (
        3 if px_ms is None else 5,
        len(value),
        value,
    )
    if px_ms is not None:
        one += b"$2\r\nPX\r\n$4\r\n1500\r\n"
    assert bytes(got) == one * 3


def test_a_status_reply_is_ok_or_a_redirect_and_a_bulk_string_ends_with_crlf() -> None:
    ours, theirs = socket.socketpair()
    theirs.sendall(b"+OK\r\n-MOVED 1 h:2\r\n-OOM no\r\n$3\r\nabc\r\n$3\r\nabcXY")
    reader = ReplyReader(ours)
    assert reader.status() is None
    assert isinstance(reader.status(), Redirect)
    with pytest.raises(FramingError, match="OOM"):
        reader.status()
    assert (reader.bulk(), reader.exact(3), reader.end()) == (3, b"abc", None)
    assert (reader.bulk(), reader.exact(3)) == (3, b"abc")
    with pytest.raises(FramingError, match="CRLF"):
        reader.end()
    ours.close()
    theirs.close()


def test_an_integer_reply_is_a_count_or_a_redirect() -> None:
    ours, theirs = socket.socketpair()
    theirs.sendall(b":1\r\n:0\r\n-ASK 1 h:2\r\n$1\r\n:-3\r\n")
    reader = ReplyReader(ours)
    assert (reader.integer(), reader.integer()) == (1, 0)
    assert isinstance(reader.integer(), Redirect)
    for _ in range(2):
        with pytest.raises(FramingError):
            reader.integer()
    ours.close()
    theirs.close()


def test_a_peer_sending_a_byte_at_a_time_fails_the_read_by_its_deadline() -> None:
    """Each byte comes well within the socket's 1 s timeout; the reply does not come within
    the deadline: every receive gets only the time left."""
    ours, theirs = socket.socketpair()
    ours.settimeout(1.0)
    stop = threading.Event()

    def dribble() -> None:
        for byte in b"$100\r\n" + bytes(100):
            if stop.wait(0.1):
                return
            theirs.sendall(bytes([byte]))

    writer = threading.Thread(target=dribble)
    writer.start()
    started = time.monotonic()
    reader = ReplyReader(ours, deadline=started + 0.5)
    with pytest.raises(TimeoutError, match="deadline"):
        size = reader.bulk()
        reader.exact(size)
    assert time.monotonic() - started < 0.8
    # A send past its deadline fails before sending anything.
    with pytest.raises(TimeoutError, match="deadline"):
        send_all(ours, [b"PING"], deadline=started)
    stop.set()
    writer.join()
    ours.close()
    theirs.close()


def _receive_all(sock: socket.socket, into: bytearray) -> None:
    while chunk := sock.recv(1 << 20):
        into += chunk
