"""Fuzz a running server with 10,000+ hostile frames; it must answer each and keep working."""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import msgspec
import zmq

from kvshelf.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Commit,
    Lookup,
    MsgType,
    PageLayout,
    Ping,
    Register,
    Release,
    Reserve,
    Stats,
    decode_reply,
    encode,
)
from testbed.server import ServerProcess, map_arena_file

PAGE = 4096
NUM_FRAMES = 10_000
BATCH = 100
SEED = 20241129
LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="fuzz", page_bytes=PAGE, world_size=1, rank=0
)


class FrameFactory:
    """Seeded generator of hostile frames.

    Each generator returns ``(frames, surely_bad)``: the multipart message to send and whether
    the server must reject it (some mutations happen to stay valid).
    """

    def __init__(self, rng: random.Random, pool: str) -> None:
        self.rng = rng
        self.pool = pool
        self.kinds: list[Callable[[], tuple[list[bytes], bool]]] = [
            self.random_bytes,
            self.mutated_field,
            self.truncated,
            self.bit_flipped,
            self.wrong_version,
            self.unknown_type,
            self.out_of_order,
            self.extra_frames,
        ]

    def frame(self) -> tuple[list[bytes], bool]:
        return self.rng.choice(self.kinds)()

    def valid(self) -> msgspec.Struct:
        rng = self.rng
        hashes = [rng.randbytes(32) for _ in range(rng.randrange(1, 4))]
        rid = rng.randrange(1, 2**40)
        return rng.choice(
            [
                Ping(request_id=rid),
                Stats(request_id=rid),
                Register(request_id=rid, layout=LAYOUT),
                Lookup(request_id=rid, pool=self.pool, hashes=hashes, world_size=1, lock=False),
                Reserve(request_id=rid, pool=self.pool, rank=0, hashes=hashes),
                Commit(request_id=rid, reservation_id=rng.randrange(1, 50)),
                Abort(request_id=rid, reservation_id=rng.randrange(1, 50)),
                Release(request_id=rid, lock_id=rng.randrange(1, 50), rank=0),
            ]
        )

    def random_value(self) -> object:
        rng = self.rng
        return rng.choice(
            [
                None,
                rng.randrange(-(2**63), 2**64),
                rng.random(),
                rng.randbytes(rng.randrange(0, 300)),
                "x" * rng.randrange(0, 2000),
                [rng.randrange(-5, 5) for _ in range(3)],
                {"a": 1},
                True,
            ]
        )

    def random_bytes(self) -> tuple[list[bytes], bool]:
        return [self.rng.randbytes(self.rng.randrange(0, 200))], False

    def mutated_field(self) -> tuple[list[bytes], bool]:
        fields = msgspec.to_builtins(self.valid())
        name = self.rng.choice([*fields, "junk"])
        action = self.rng.randrange(3)
        if action == 0:
            fields.pop(name, None)
        else:
            fields[name] = self.random_value()
        return [msgspec.msgpack.encode(fields)], False

    def truncated(self) -> tuple[list[bytes], bool]:
        frame = encode(self.valid())
        return [frame[: self.rng.randrange(0, len(frame))]], True

    def bit_flipped(self) -> tuple[list[bytes], bool]:
        frame = bytearray(encode(self.valid()))
        for _ in range(self.rng.randrange(1, 4)):
            frame[self.rng.randrange(len(frame))] ^= 1 << self.rng.randrange(8)
        return [bytes(frame)], False

    def wrong_version(self) -> tuple[list[bytes], bool]:
        fields = msgspec.to_builtins(self.valid())
        fields["version"] = self.rng.choice([0, PROTOCOL_VERSION + 1, 2**40, "1", None])
        return [msgspec.msgpack.encode(fields)], True

    def unknown_type(self) -> tuple[list[bytes], bool]:
        fields = msgspec.to_builtins(self.valid())
        known = {int(t) for t in MsgType}
        replies = [int(MsgType.PONG), int(MsgType.ERROR), int(MsgType.ACK)]
        fields["type"] = self.rng.choice([*replies, max(known) + 1, 255, -1, "lookup"])
        return [msgspec.msgpack.encode(fields)], True

    def out_of_order(self) -> tuple[list[bytes], bool]:
        rng = self.rng
        rid = rng.randrange(1, 2**40)
        never_made = 10**12 + rng.randrange(10**6)
        bad_layout = PageLayout(
            model_fingerprint="m",
            layout_fingerprint="fuzz",
            page_bytes=2 * PAGE,
            world_size=1,
            rank=0,
        )
        msg = rng.choice(
            [
                Commit(request_id=rid, reservation_id=never_made),
                Abort(request_id=rid, reservation_id=never_made),
                Release(request_id=rid, lock_id=never_made, rank=0),
                Reserve(request_id=rid, pool="pool-unregistered", rank=0, hashes=[b"h"]),
                Reserve(request_id=rid, pool=self.pool, rank=1, hashes=[b"h"]),
                Lookup(request_id=rid, pool=self.pool, hashes=[b"h"], world_size=2, lock=True),
                Register(request_id=rid, layout=bad_layout),
            ]
        )
        return [encode(msg)], True

    def extra_frames(self) -> tuple[list[bytes], bool]:
        payload = encode(self.valid())
        return [b"", payload] if self.rng.random() < 0.5 else [payload, payload], True


def exchange(socket: zmq.Socket, batch: list[list[bytes]]) -> list[bytes]:
    """Send a batch, then collect exactly one reply per message."""
    for frames in batch:
        socket.send_multipart(frames)
    replies = []
    for _ in batch:
        assert socket.poll(10_000), "the server stopped answering"
        replies.append(socket.recv())
    return replies


def test_fuzzed_server_keeps_serving_and_counts_bad_requests() -> None:
    rng = random.Random(SEED)
    with ServerProcess(lease_timeout_s=2.0) as server, server.client(timeout_s=5.0) as client:
        registration = client.register(LAYOUT)
        factory = FrameFactory(rng, registration.pool)
        bad_before = client.stats()["bad_requests_total"]

        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"tcp://{server.host}:{server.port}")
        try:
            messages = [factory.frame() for _ in range(NUM_FRAMES)]
            oversized = os.urandom(MAX_FRAME_BYTES + 1)
            messages += [([oversized[: MAX_FRAME_BYTES + 1 + i]], True) for i in range(3)]
            errors = surely_bad = 0
            for start in range(0, len(messages), BATCH):
                batch = messages[start : start + BATCH]
                for reply in exchange(socket, [frames for frames, _ in batch]):
                    errors += type(decode_reply(reply)).__name__ == "Error"
                surely_bad += sum(bad for _, bad in batch)
        finally:
            socket.close()

        assert server.returncode is None, server.log()
        stats = client.stats()
        assert stats["bad_requests_total"] - bad_before == errors
        assert errors >= surely_bad > NUM_FRAMES // 2

        # The cache still works: a store/load round trip is bit-exact.
        hashes = [b"after-fuzz" + bytes([i]) * 22 for i in range(4)]
        payload = [os.urandom(PAGE) for _ in hashes]
        arena = map_arena_file(registration.shm_name)
        try:
            reservation = client.reserve(registration.pool, 0, hashes)
            for page, data in zip(reservation.pages, payload, strict=True):
                assert page is not None
                arena[page * PAGE : (page + 1) * PAGE] = data
            client.commit(reservation.reservation_id)
            result = client.lookup(registration.pool, hashes, world_size=1, lock=True)
            assert result.num_hit_blocks == len(hashes)
            for page, data in zip(result.pages[0], payload, strict=True):
                assert arena[page * PAGE : (page + 1) * PAGE] == data
            client.release(result.lock_id, 0)
        finally:
            arena.close()
