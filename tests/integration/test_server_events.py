"""The server's per-pool event log against a real server: what is stored for every rank, what
is evicted or dropped, and readers told to start over (clear, a log that dropped entries)."""

from __future__ import annotations

from kvshelf.protocol import PageLayout
from kvshelf.server.event_log import ABSENT, IN_L1, EventKind, EventLogs
from kvshelf.server.pool import Pool
from kvshelf.testbed.server import ServerProcess

PAGE = 16 * 1024
NUM_PAGES = 32


def layout(rank: int, world_size: int = 1) -> PageLayout:
    return PageLayout(
        model_fingerprint="m",
        layout_fingerprint="events",
        page_bytes=PAGE,
        world_size=world_size,
        rank=rank,
    )


def keys(tag: bytes, n: int) -> list[bytes]:
    return [tag + i.to_bytes(4, "big") * 4 for i in range(n)]


def test_stored_only_when_every_rank_committed_and_removed_exactly_when_evicted() -> None:
    with (
        ServerProcess(l1_size_gb=NUM_PAGES * PAGE / 2**30, eviction_watermark=1.0) as server,
        server.client() as client,
    ):
        pool = client.register(layout(0, world_size=2)).pool
        client.register(layout(1, world_size=2))
        first = keys(b"a", 4)
        rank0 = client.reserve(pool, 0, first)
        client.commit(rank0.reservation_id)
        reply = client.events(pool)
        # Rank 1 has not stored them: a lookup would not hit, so nothing is logged.
        assert (reply.kinds, reply.hashes, reply.next_seq) == ([], [], 0)
        rank1 = client.reserve(pool, 1, first[:3])
        client.commit(rank1.reservation_id)
        reply = client.events(pool, 0, probe=first)
        assert reply.kinds == [EventKind.STORED] * 3 and reply.hashes == first[:3]
        assert reply.present == [IN_L1] * 3 + [ABSENT]
        seq = reply.next_seq

        # Fill the arena: each rank has 16 pages, so later stores evict the oldest.
        for round_ in range(6):
            batch = keys(bytes([round_]) + b"p", 4)
            for rank in (0, 1):
                client.commit(client.reserve(pool, rank, batch).reservation_id)
        evicted = client.stats()["evicted_objects_total"]
        assert evicted > 0
        reply = client.events(pool, seq)
        removed = [h for k, h in zip(reply.kinds, reply.hashes, strict=True) if k != 1]
        stored = [h for k, h in zip(reply.kinds, reply.hashes, strict=True) if k == 1]
        everything = first[:3] + stored
        gone = {
            h
            for h, where in zip(everything, client.events(pool, 0, everything).present, strict=True)
            if where == ABSENT
        }
        assert set(removed) == gone and len(removed) == len(set(removed))
        assert all(k == EventKind.REMOVED for k in reply.kinds if k != EventKind.STORED)
        # first[3] was only ever on rank 0: its eviction is not a removal of a whole block.
        assert first[3] not in removed
        seq = reply.next_seq

        # kvshelf clear: readers are told to start over, from contents that are now empty.
        client.clear()
        reply = client.events(pool, seq, probe=everything)
        assert reply.overflowed and reply.kinds == []
        assert set(reply.present) == {ABSENT}
        assert not client.events(pool, reply.next_seq).overflowed


def test_a_full_log_drops_its_oldest_entries_and_a_reader_behind_is_told() -> None:
    logs = EventLogs(capacity=4)
    pool = Pool("p", PAGE, 1)
    # One rank: every eviction of a page is the removal of a whole block.
    for block_hash in keys(b"k", 6):
        logs.forgotten(pool, 0, block_hash, demoted=False)
    entries, next_seq, overflowed = logs.read(pool, 0)
    assert (entries, next_seq, overflowed) == ([], 6, True)
    entries, next_seq, overflowed = logs.read(pool, 2)
    assert [h for _, h in entries] == keys(b"k", 6)[2:] and next_seq == 6 and not overflowed
    assert logs.read(pool, 6) == ([], 6, False)
