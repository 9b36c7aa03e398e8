"""What one request may cost a real server (issue 33): every list a request carries is bounded
by the schema, a lookup or probe names at most ``MAX_OBJECTS_PER_REQUEST`` keys x ranks, a
frame over the transport limit never reaches memory, a lookup without fetch ends where L1
holds its state, lease ids cannot be guessed, and the costliest legal requests leave the loop
answering pings.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvshelf.client import KVShelfClient, ServerError
from kvshelf.protocol import (
    MAX_FRAME_BYTES,
    MAX_HASHES_PER_REQUEST,
    MAX_OBJECTS_PER_REQUEST,
    Error,
    ErrorCode,
    Events,
    Lookup,
    LookupReply,
    PageLayout,
    Ping,
    Pong,
    Reply,
    Request,
    decode_reply,
    encode,
    max_request_keys,
)
from kvshelf.server.limits import CLIENT_BUFFER_BYTES, TRANSPORT_MAX_MESSAGE_BYTES
from testbed.server import ServerProcess

PAGE = 4096


def layout(world_size: int, name: str = "cost") -> PageLayout:
    return PageLayout(
        model_fingerprint=name,
        layout_fingerprint="l",
        page_bytes=PAGE,
        world_size=world_size,
        rank=0,
    )


def keys(tag: str, count: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(count)]


def store(client: KVShelfClient, pool: str, hashes: list[bytes], ranks: range) -> None:
    """Commit ``hashes`` for ``ranks`` (the page bytes do not matter here)."""
    for rank in ranks:
        reservation = client.reserve(pool, rank, hashes)
        client.commit(reservation.reservation_id)


def anon_rss(pid: int) -> int:
    """The server's private resident memory (the shared arena excluded)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


class Peer:
    """A bare DEALER socket: sends frames no :class:`KVShelfClient` would, and times replies."""

    def __init__(self, context: zmq.Context, server: ServerProcess) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 1000)
        self.socket.connect(f"tcp://{server.host}:{server.port}")

    def send(self, request: Request | bytes) -> None:
        self.socket.send(request if isinstance(request, bytes) else encode(request))

    def reply(self, timeout_s: float) -> Reply | None:
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        return decode_reply(self.socket.recv())

    def ask(self, request: Request | bytes, timeout_s: float = 30.0) -> tuple[Reply, float]:
        """The reply and its round trip in seconds."""
        started = time.perf_counter()
        self.send(request)
        reply = self.reply(timeout_s)
        assert reply is not None, "no reply"
        return reply, time.perf_counter() - started


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def refused(call: object, code: ErrorCode, field: str) -> str:
    """Run ``call``, which the server must refuse with ``code`` naming ``field``."""
    with pytest.raises(ServerError) as info:
        call()  # type: ignore[operator]
    assert info.value.code is code, info.value
    assert field in info.value.message, info.value
    return info.value.message


def ping_during(context: zmq.Context, server: ServerProcess, frames: list[bytes]) -> float:
    """Send ``frames`` from one peer, then a ping from another: the ping's round trip."""
    flood, pinger = Peer(context, server), Peer(context, server)
    assert isinstance(pinger.ask(Ping(request_id=1))[0], Pong)  # connected
    for frame in frames:
        flood.send(frame)
    time.sleep(0.05)  # the flood reaches the server first
    reply, elapsed = pinger.ask(Ping(request_id=2))
    assert isinstance(reply, Pong)
    for _ in frames:
        assert flood.reply(30.0) is not None
    return elapsed


# D1: every list of a request is bounded by the schema.


def test_an_ends_flood_is_refused_at_decoding_naming_the_field_and_pings_stay_fast(
    kvshelf_server: ServerProcess, context: zmq.Context
) -> None:
    with kvshelf_server.client() as client:
        pool = client.register(layout(1)).pool
        before = client.stats()
        # One block more than a request may have: refused, naming the list, nothing counted.
        too_many = [[] for _ in range(MAX_HASHES_PER_REQUEST + 1)]
        message = refused(
            lambda: client.lookup(pool, [], world_size=1, lock=False, block_keys=0, ends=too_many),
            ErrorCode.MALFORMED,
            "`$.ends`",
        )
        assert f"length <= {MAX_HASHES_PER_REQUEST}" in message
        after = client.stats()
        assert after["lookup_requests_total"] == before["lookup_requests_total"]
        assert after["bad_requests_total"] == before["bad_requests_total"] + 1
    # A frame as large as the protocol allows, all empty lists (about 4 M of them), three times:
    # each is refused from its header, and a ping from another client is answered at once.
    flood = Lookup(
        request_id=7, pool=pool, hashes=[], world_size=1, lock=False, block_keys=0, ends=[]
    )
    # Spelled out rather than encoded: 4 M Python lists take seconds to build.
    empty = encode(flood)
    count = MAX_FRAME_BYTES - len(empty) - 4
    frame = empty.replace(
        b"\xa4ends\x90", b"\xa4ends\xdd" + count.to_bytes(4, "big") + b"\x90" * count
    )
    assert len(frame) == MAX_FRAME_BYTES
    elapsed = ping_during(context, kvshelf_server, [frame] * 3)
    print(f"ping during 3 ends floods of {len(frame)} bytes: {elapsed * 1000:.1f} ms")
    assert elapsed < 1.0


def test_the_largest_legal_ends_lookups_start_no_full_garbage_collection(
    kvshelf_server: ServerProcess, context: zmq.Context
) -> None:
    """A lookup whose ``ends`` fill a request decodes to 4,096 lists; answered while the
    collector could run, they were promoted to its old generation, and every ~17 such lookups
    started a full collection, which walks every pool's structures (150-200 ms at 300,000
    keys, the loop waiting). Answered with the collector off, they start none."""
    blocks = 4096
    per_end = MAX_HASHES_PER_REQUEST // blocks
    with kvshelf_server.client() as client:
        pool = client.register(layout(1, "ends-gc")).pool
        hashes = keys("ends-gc", blocks)
        store(client, pool, hashes[:1], range(1))
        ends = [keys(f"end{i}-", per_end) for i in range(blocks)]
        frame = encode(
            Lookup(
                request_id=9,
                pool=pool,
                hashes=hashes,
                world_size=1,
                lock=False,
                fetch=False,
                ends=ends,
            )
        )
        before = client.stats()["gc_full_collections_total"]
        peer = Peer(context, kvshelf_server)
        for _ in range(60):
            reply, _ = peer.ask(frame)
            assert isinstance(reply, LookupReply), reply
        after = client.stats()["gc_full_collections_total"]
    assert after == before, f"{after - before} full collections during 60 ends lookups"


# D2: a lookup or probe names at most MAX_OBJECTS_PER_REQUEST keys x ranks.

WIDE = 256  # ranks of the wide pool: max_request_keys(WIDE) keys per request


@pytest.fixture
def wide(kvshelf_server: ServerProcess) -> Iterator[tuple[KVShelfClient, str, bytes]]:
    """A client, a pool of WIDE ranks and one key committed for all of them."""
    with kvshelf_server.client(timeout_s=10.0) as client:
        pool = client.register(layout(WIDE, "wide")).pool
        (key,) = keys("wide", 1)
        store(client, pool, [key], range(WIDE))
        yield client, pool, key


def test_a_lookup_over_the_object_budget_is_refused_before_any_look_up(
    wide: tuple[KVShelfClient, str, bytes],
) -> None:
    client, pool, key = wide
    most = max_request_keys(WIDE)
    assert most * WIDE == MAX_OBJECTS_PER_REQUEST
    before = client.stats()
    # The review's stall: one key repeated 64k times at 256 ranks (16.7 M look-ups before).
    for count in (most + 1, MAX_HASHES_PER_REQUEST):
        for lock in (False, True):
            refused(
                lambda c=count, lk=lock: client.lookup(pool, [key] * c, world_size=WIDE, lock=lk),
                ErrorCode.INVALID_ARGUMENT,
                f"hashes holds {count} keys of {WIDE} ranks",
            )
    after = client.stats()
    for counter in ("lookup_requests_total", "locked_objects_total", "lookup_hit_objects_total"):
        assert after[counter] == before[counter], counter
    assert after["bad_requests_total"] == before["bad_requests_total"] + 4
    # At the bound: answered, the repeated key hit every time. Locked (within the pool's
    # default lease units, one short of the bound's objects): every rank's share.
    assert client.lookup(pool, [key] * most, world_size=WIDE, lock=False).num_hit_blocks == most
    result = client.lookup(pool, [key] * (most // 2), world_size=WIDE, lock=True)
    assert result.num_hit_blocks == most // 2 and len(result.pages) == WIDE
    for rank in range(WIDE):
        client.release(result.lock_id, rank)
    assert client.stats()["locked_objects"] == 0


def test_ends_count_in_the_budget_with_their_hashes(
    wide: tuple[KVShelfClient, str, bytes],
) -> None:
    client, pool, key = wide
    half = max_request_keys(WIDE) // 2
    before = client.stats()
    refused(
        lambda: client.lookup(
            pool,
            [key] * half,
            world_size=WIDE,
            lock=False,
            block_keys=1,
            ends=[[key]] * (half - 1) + [[key, key]],
        ),
        ErrorCode.INVALID_ARGUMENT,
        "hashes and ends",
    )
    assert client.stats()["lookup_requests_total"] == before["lookup_requests_total"]
    result = client.lookup(
        pool, [key] * half, world_size=WIDE, lock=False, block_keys=1, ends=[[key]] * half
    )
    assert (result.end_block, result.num_hit_blocks) == (half, half + 1)


def test_an_events_probe_over_the_object_budget_is_refused(
    wide: tuple[KVShelfClient, str, bytes],
) -> None:
    client, pool, key = wide
    most = max_request_keys(WIDE)
    others = [i.to_bytes(32, "big") for i in range(1, most + 1)]
    refused(
        lambda: client.events(pool, probe=[key, *others]),
        ErrorCode.INVALID_ARGUMENT,
        f"probe holds {most + 1} keys of {WIDE} ranks",
    )
    # A repeated hash is looked up once: it costs one key, however often it is named.
    assert client.events(pool, probe=[key] * (4 * most)).present == [1] * (4 * most)


# D3: ZeroMQ never reads a frame over the transport limit, and buffers a bounded amount.


def test_a_frame_over_the_transport_limit_is_dropped_unread(
    kvshelf_server: ServerProcess, context: zmq.Context
) -> None:
    peer = Peer(context, kvshelf_server)
    # Just over the protocol's limit: read, and answered why.
    reply, _ = peer.ask(b"\x00" * TRANSPORT_MAX_MESSAGE_BYTES)
    assert isinstance(reply, Error) and reply.code == ErrorCode.FRAME_TOO_LARGE
    # Over the transport's: ZeroMQ drops the connection at the frame's header; no reply.
    peer.send(b"\x00" * (TRANSPORT_MAX_MESSAGE_BYTES + 1))
    assert peer.reply(1.0) is None
    with kvshelf_server.client() as client:
        assert client.ping()
        assert client.stats()["requests_total"] >= 1


def test_a_client_buffers_at_most_the_stated_bytes_while_the_loop_is_busy(
    kvshelf_server: ServerProcess, context: zmq.Context
) -> None:
    with kvshelf_server.client(timeout_s=10.0) as client:
        pool = client.register(layout(8, "busy")).pool
        (key,) = keys("busy", 1)
        store(client, pool, [key], range(8))
    busy = Lookup(
        request_id=1,
        pool=pool,
        hashes=[key] * MAX_HASHES_PER_REQUEST,
        world_size=8,
        lock=False,
    )
    start = anon_rss(kvshelf_server.pid)
    peak = start
    sampling = True

    def sample() -> None:
        nonlocal peak
        while sampling:
            peak = max(peak, anon_rss(kvshelf_server.pid))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    worker, flood, large = (Peer(context, kvshelf_server) for _ in range(3))
    try:
        # The loop works through legal lookups while one client floods 16 MiB frames (under
        # ZeroMQ's limit before issue 33) and another frames at the transport limit.
        for _ in range(16):
            worker.send(busy)
        time.sleep(0.05)
        for _ in range(24):
            flood.send(b"\x00" * (16 * 1024 * 1024))
        for _ in range(24):
            large.send(b"\x00" * TRANSPORT_MAX_MESSAGE_BYTES)
        for _ in range(16):
            assert worker.reply(60.0) is not None
        for _ in range(24):
            assert large.reply(60.0) is not None
    finally:
        sampling = False
        sampler.join()
    grown = peak - start
    print(
        f"server anon RSS peak +{grown / 2**20:.1f} MiB; "
        f"bound {CLIENT_BUFFER_BYTES / 2**20:.1f} MiB per client"
    )
    # Only the two clients sending frames within the limit hold buffers; the third is dropped.
    assert grown < 2 * CLIENT_BUFFER_BYTES, grown


# The costliest legal requests: the loop's time per request, and a ping meanwhile.

# The most ranks a lookup of MAX_HASHES_PER_REQUEST keys may have.
BUDGET_WORLD = MAX_OBJECTS_PER_REQUEST // MAX_HASHES_PER_REQUEST
DISTINCT = 4096


def test_the_costliest_legal_requests_are_answered_promptly_and_pings_meanwhile(
    context: zmq.Context,
) -> None:
    world, most = BUDGET_WORLD, MAX_HASHES_PER_REQUEST
    held = keys("held", DISTINCT)
    (partial,) = keys("partial", 1)  # held by every rank but the last
    units = ["--max-lease-units-per-pool", str(2 * MAX_OBJECTS_PER_REQUEST), "--no-prefault"]
    arena_gb = 2 * DISTINCT * world * PAGE / 2**30
    with (
        ServerProcess(l1_size_gb=arena_gb, lease_timeout_s=60.0, extra_args=units) as server,
        server.client(timeout_s=30.0) as client,
    ):
        pool = client.register(layout(world, "costly")).pool
        store(client, pool, held, range(world))
        store(client, pool, [partial], range(world - 1))
        # Every key held by every rank, then one of them again, to the budget.
        full = [*held, *[held[0]] * (most - DISTINCT)]
        half = most // 2
        requests: dict[str, Request] = {
            "lookup, locked": Lookup(
                request_id=1, pool=pool, hashes=full, world_size=world, lock=True
            ),
            "lookup": Lookup(request_id=2, pool=pool, hashes=full, world_size=world, lock=False),
            # Each boundary's state is held by all ranks but the last: every one is tried.
            "ends flood": Lookup(
                request_id=3,
                pool=pool,
                hashes=full[:half],
                world_size=world,
                lock=False,
                block_keys=1,
                ends=[[partial]] * half,
            ),
            "empty ends": Lookup(
                request_id=4,
                pool=pool,
                hashes=[],
                world_size=world,
                lock=False,
                block_keys=0,
                ends=[[] for _ in range(most)],
            ),
            "events probe": Events(request_id=5, pool=pool, probe=full),
        }
        heavy, pinger = Peer(context, server), Peer(context, server)
        pinger.ask(Ping(request_id=0))
        slowest = 0.0
        for name, request in requests.items():
            frame = encode(request)
            started = time.perf_counter()
            heavy.send(frame)
            # Pings one after another until the request is answered: the longest waited for
            # the loop.
            ping_s = 0.0
            while not heavy.socket.poll(0):
                ping_s = max(ping_s, pinger.ask(Ping(request_id=9))[1])
            reply = heavy.reply(0.0)
            answer_s = time.perf_counter() - started
            assert reply is not None and not isinstance(reply, Error), (name, reply)
            if isinstance(reply, LookupReply) and reply.lock_id:
                assert sum(map(len, reply.pages)) == MAX_OBJECTS_PER_REQUEST
                for rank in range(world):
                    client.release(reply.lock_id, rank)
            print(
                f"{name}: {len(frame)} bytes answered in {answer_s * 1000:.0f} ms, "
                f"the slowest ping meanwhile in {ping_s * 1000:.0f} ms"
            )
            slowest = max(slowest, answer_s, ping_s)
        # Tens to hundreds of ms on a quiet machine; the bound leaves room for a loaded one.
        assert slowest < 3.0, slowest


# D9: a lookup without fetch ends where L1 holds its keys.


def test_a_lookup_without_fetch_ends_where_l1_holds_the_prefix_and_state(tmp_path: Path) -> None:
    prefix, states = keys("p", 6), keys("s", 6)
    ends_at = [[], [states[1]], [], [], [states[4]], []]
    disk = ["--l2-disk-path", str(tmp_path / "l2"), "--l2-disk-size-gb", "0.01"]
    server = ServerProcess(l1_size_gb=256 * PAGE / 2**30, extra_args=disk)
    with server, server.client() as client:
        pool = client.register(layout(1)).pool
        store(client, pool, [*prefix, states[1], states[4]], range(1))
        deadline = time.monotonic() + 20
        while client.stats()["l2_stored_objects_total"] < 8:
            assert time.monotonic() < deadline, "not on disk"
            time.sleep(0.02)
        server.restart()
        # After a restart everything is on disk only; blocks 0-1 and the state after block 1
        # come back into L1 with a fetching lookup.
        while True:
            result = client.lookup(pool, [*prefix[:2], states[1]], world_size=1, lock=False)
            if not result.pending:
                break
        assert result.num_hit_blocks == 3
        # Without fetch the server answers from L1 only: the hit ends after block 1, whole.
        result = client.lookup(
            pool, prefix, world_size=1, lock=False, fetch=False, block_keys=1, ends=ends_at
        )
        assert (result.end_block, result.num_hit_blocks) == (2, 3)
        # With fetch, the longest end the disk holds.
        result = client.lookup(
            pool, prefix, world_size=1, lock=False, fetch=True, block_keys=1, ends=ends_at
        )
        assert result.end_block == 5


# D11: lease ids cannot be guessed from one's own.


def test_lock_and_reservation_ids_are_random_63_bit(kvshelf_server: ServerProcess) -> None:
    with kvshelf_server.client() as victim, kvshelf_server.client() as attacker:
        pool = victim.register(layout(1)).pool
        hashes = keys("ids", 4)
        ids: list[int] = []
        for i, key in enumerate(hashes):
            reservation = (victim if i % 2 else attacker).reserve(pool, 0, [key])
            ids.append(reservation.reservation_id)
        # The victim's reservations are live; the attacker's neighbours of its own ids are not.
        for own in ids[0::2]:
            for guess in (own - 1, own + 1):
                if guess not in ids and guess > 0:
                    with pytest.raises(ServerError) as info:
                        attacker.commit(guess)
                    assert info.value.code is ErrorCode.UNKNOWN_RESERVATION
        for reservation_id in ids:
            victim.commit(reservation_id)
        locks = [victim.lookup(pool, hashes, world_size=1, lock=True).lock_id for _ in range(28)]
        ids += locks
        assert len(set(ids)) == len(ids)
        assert all(0 < lease_id < 2**63 for lease_id in ids)
        # Consecutive (or nearly) ids would span a tiny range; random 63-bit ones span most of it.
        assert max(ids) - min(ids) > 2**60
        for lock_id in locks:
            victim.release(lock_id, 0)
