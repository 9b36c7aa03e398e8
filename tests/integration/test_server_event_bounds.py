"""The event log's bounds against a real server, under a client that stores or probes to hurt
other readers: replies under the frame limit whatever the hashes' size, a probe's cost bounded
whatever the pool's world size, and the log's memory within the bound the server states."""

from __future__ import annotations

import time

import pytest

from kvshelf.client import KVShelfClient, ServerError
from kvshelf.protocol import (
    MAX_FRAME_BYTES,
    MAX_HASH_BYTES,
    MAX_HASHES_PER_REQUEST,
    ErrorCode,
    PageLayout,
    encode,
    max_request_keys,
)
from kvshelf.roles.events import EventReader
from kvshelf.server.event_log import ABSENT, IN_L1, entry_bytes
from kvshelf.server.limits import EVENT_LOG_BYTES_PER_POOL, MIN_PAGE_BYTES
from testbed.server import ServerProcess

ARENA_PAGES = 2048
# Far beyond any read's end: the server answers overflowed, with the log's next_seq.
PAST_THE_END = 1 << 62


def layout(rank: int = 0, world_size: int = 1) -> PageLayout:
    return PageLayout(
        model_fingerprint="m",
        layout_fingerprint="event-bounds",
        page_bytes=MIN_PAGE_BYTES,
        world_size=world_size,
        rank=rank,
    )


def keys(tag: int, n: int) -> list[bytes]:
    """``n`` hashes of vLLM's size (32 bytes)."""
    return [tag.to_bytes(4, "big") + i.to_bytes(4, "big") * 7 for i in range(n)]


def big_keys(tag: int, n: int) -> list[bytes]:
    """``n`` hashes of the largest size the protocol takes."""
    return [
        tag.to_bytes(4, "big") + i.to_bytes(4, "big") * (MAX_HASH_BYTES // 4 - 1) for i in range(n)
    ]


def flood(client: KVShelfClient, pool: str, rounds: int, per_round: int = ARENA_PAGES) -> None:
    """Store ``rounds`` arenas' worth of blocks with the largest hashes: each round after the
    first evicts the one before (a STORED and a REMOVED entry per block)."""
    for round_ in range(rounds):
        batch = big_keys(round_, per_round)
        client.commit(client.reserve(pool, 0, batch).reservation_id)


def log_end(client: KVShelfClient, pool: str) -> int:
    return client.events(pool, PAST_THE_END).next_seq


def anon_rss(pid: int) -> int:
    """The server's private resident memory (the shared arena excluded)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_reads_after_a_siblings_largest_hashes_stay_under_the_frame_limit() -> None:
    with (
        ServerProcess(
            l1_size_gb=ARENA_PAGES * MIN_PAGE_BYTES / 2**30, eviction_watermark=1.0
        ) as server,
        server.client() as sibling,
        server.client() as victim,
    ):
        pool = sibling.register(layout()).pool
        start = victim.events(pool).next_seq
        # 18,432 entries of 256-byte hashes: 4.7 MB of reply from the victim's last read on.
        flood(sibling, pool, rounds=5)
        end = log_end(sibling, pool)
        assert end - start == ARENA_PAGES * 9

        # The victim is answered: told to start over, or given what still fits a frame.
        reply = victim.events(pool, start)
        assert len(encode(reply)) <= MAX_FRAME_BYTES

        # A reader 12,000 entries behind (3.1 MB of entries) reads on from next_seq, in frames
        # of at most MAX_FRAME_BYTES, and sees every entry.
        seq, reads, entries = end - 12_000, 0, 0
        while seq < end:
            reply = victim.events(pool, seq)
            assert not reply.overflowed
            assert len(encode(reply)) <= MAX_FRAME_BYTES // 2 + 1024
            assert reply.next_seq == seq + len(reply.kinds) and reply.kinds
            seq, reads, entries = reply.next_seq, reads + 1, entries + len(reply.kinds)
        assert entries == 12_000 and reads >= 2


def test_a_probe_checks_each_distinct_hash_once_within_its_budget() -> None:
    world_size = 256
    with (
        ServerProcess(l1_size_gb=4 * world_size * MIN_PAGE_BYTES / 2**30) as server,
        server.client(timeout_s=30.0) as client,
    ):
        pool = client.register(layout(0, world_size)).pool
        # A block held by every rank: probing it reads every rank's key table.
        held = keys(0, 1)
        for rank in range(world_size):
            client.commit(client.reserve(pool, rank, held).reservation_id)
        assert client.events(pool).kinds == [1]

        # The same hash 65,536 times is checked once (16.7 M table reads before: 3.9 s).
        started = time.perf_counter()
        reply = client.events(pool, probe=held * MAX_HASHES_PER_REQUEST)
        elapsed = time.perf_counter() - started
        assert reply.present == [IN_L1] * MAX_HASHES_PER_REQUEST
        assert elapsed < 1.0, elapsed

        # Distinct hashes: at most 2,048 per request for 256 ranks.
        most = max_request_keys(world_size)
        assert len(client.events(pool, probe=keys(1, most)).present) == most
        with pytest.raises(ServerError) as info:
            client.events(pool, probe=keys(1, most + 1))
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
        assert f"probe holds {most + 1} keys of {world_size} ranks" in str(info.value)
        # Refused, nothing changed: the log reads as before.
        assert client.events(pool).kinds == [1]

        # The connector's reader sends a larger probe in parts the server takes.
        reader = EventReader(KVShelfClient(server.host, server.port), pool, world_size=world_size)
        try:
            probe = keys(1, most) + held
            reader.probe(probe)
            answered: list[tuple[bytes, int]] = []
            deadline = time.monotonic() + 10.0
            while len(answered) < len(probe):
                assert time.monotonic() < deadline and not reader.failing, len(answered)
                for _, kind, payload in reader.take_items():
                    if kind == "present":
                        answered += zip(*payload, strict=True)
                time.sleep(0.02)
            assert answered == [(h, ABSENT) for h in keys(1, most)] + [(held[0], IN_L1)]
        finally:
            reader.close()


def test_the_log_holds_at_most_its_stated_bytes() -> None:
    with (
        ServerProcess(
            l1_size_gb=ARENA_PAGES * MIN_PAGE_BYTES / 2**30, eviction_watermark=1.0
        ) as server,
        server.client() as client,
    ):
        pool = client.register(layout()).pool
        # Every page made and keyed once, before measuring.
        flood(client, pool, rounds=2)
        before = anon_rss(server.pid)
        # 65,536 more entries of 256-byte hashes (what the log held before: about 23 MiB).
        flood(client, pool, rounds=16)
        grown = anon_rss(server.pid) - before
        print(f"server anon RSS grew {grown / 2**20:.1f} MiB")

        # The log keeps the newest entries that fit its bytes, and tells a reader further
        # behind to start over.
        end = log_end(client, pool)
        held = EVENT_LOG_BYTES_PER_POOL // entry_bytes(big_keys(0, 1)[0])
        assert not client.events(pool, end - held).overflowed
        assert client.events(pool, end - held - 1).overflowed
        # Within the bound, plus the other things that grow (evicted keys' fingerprints, about
        # 2 MiB here, and the allocator's slack).
        assert grown <= EVENT_LOG_BYTES_PER_POOL + 8 * 2**20, grown / 2**20
