"""The server's per-pool event log against a real server: what is stored for every rank, what
is evicted or dropped, and readers told to start over (clear, a log that dropped entries)."""

from __future__ import annotations

import time
from pathlib import Path

from kvshelf.client import KVShelfClient
from kvshelf.protocol import PageLayout
from kvshelf.server.event_log import ABSENT, BELOW_L1, IN_L1, EventKind, EventLogs, entry_bytes
from kvshelf.server.pool import Pool
from testbed.server import ServerProcess

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
    # Room for 4 entries of these keys (17 bytes each), and not for a fifth.
    logs = EventLogs(capacity_bytes=4 * entry_bytes(keys(b"k", 1)[0]) + 1)
    pool = Pool("p", PAGE, 1)
    # One rank: every eviction of a page is the removal of a whole block.
    for block_hash in keys(b"k", 6):
        logs.forgotten(pool, 0, block_hash, demoted=False)
    entries, next_seq, overflowed = logs.read(pool, 0)
    assert (entries, next_seq, overflowed) == ([], 6, True)
    entries, next_seq, overflowed = logs.read(pool, 2)
    assert [h for _, h in entries] == keys(b"k", 6)[2:] and next_seq == 6 and not overflowed
    assert logs.read(pool, 6) == ([], 6, False)


def test_an_evicted_block_the_disk_keeps_is_demoted_and_probed_below_l1(
    tmp_path: Path,
) -> None:
    pages = 16
    with (
        ServerProcess(
            l1_size_gb=pages * PAGE / 2**30,
            eviction_watermark=1.0,
            extra_args=["--l2-disk-path", str(tmp_path), "--l2-disk-size-gb", "1"],
        ) as server,
        server.client() as client,
    ):
        pool = client.register(layout(0)).pool
        first = keys(b"d", 4)
        client.commit(client.reserve(pool, 0, first).reservation_id)
        wait_for_disk(client, 4)
        seq = client.events(pool).next_seq
        # Fill L1: the first keys are evicted, and the disk keeps them.
        for round_ in range(4):
            batch = keys(bytes([round_]) + b"f", 4)
            client.commit(client.reserve(pool, 0, batch).reservation_id)
            wait_for_disk(client, 4 * (round_ + 2))
        reply = client.events(pool, seq, probe=first)
        demoted = [
            h for k, h in zip(reply.kinds, reply.hashes, strict=True) if k == EventKind.DEMOTED
        ]
        # A chain is evicted from its last block back (the first is evicted last).
        assert demoted == first[::-1]
        assert EventKind.REMOVED not in reply.kinds
        assert reply.present == [BELOW_L1] * 4

        # kvshelf clear drops the disk's objects too: readers start over, nothing is left.
        client.clear()
        reply = client.events(pool, reply.next_seq, probe=first)
        assert reply.overflowed and reply.present == [ABSENT] * 4


def wait_for_disk(client: KVShelfClient, objects: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.stats()["l2_stored_objects_total"] < objects:
        assert time.monotonic() < deadline, "the disk tier did not write the objects"
        time.sleep(0.02)


def test_a_block_demoted_for_one_rank_and_dropped_for_the_other_is_removed(
    tmp_path: Path,
) -> None:
    pages = 16
    with (
        ServerProcess(
            l1_size_gb=pages * PAGE / 2**30,
            eviction_watermark=1.0,
            # LRU's order: the block's rank-0 page is evicted before its rank-1 page.
            extra_args=[
                *("--l2-disk-path", str(tmp_path), "--l2-disk-size-gb", "1"),
                *("--eviction-policy", "lru"),
            ],
        ) as server,
        server.client() as client,
    ):
        pool = client.register(layout(0, world_size=2)).pool
        client.register(layout(1, world_size=2))
        (block,) = keys(b"b", 1)
        # Rank 0's page reaches the disk; then the disk fails (its pool folder is now a file),
        # so rank 1's page of the same block is in L1 only.
        client.commit(client.reserve(pool, 0, [block]).reservation_id)
        wait_for_disk(client, 1)
        folder = tmp_path / pool
        folder.rename(tmp_path / "moved")
        folder.write_bytes(b"")
        client.commit(client.reserve(pool, 1, [block]).reservation_id)
        deadline = time.monotonic() + 10.0
        while client.stats()["l2_errors_total"] < 1:
            assert time.monotonic() < deadline, "the disk write did not fail"
            time.sleep(0.02)
        assert client.events(pool).kinds == [EventKind.STORED]

        # Rank 0's pages fill L1: the block's rank-0 page is evicted first (the disk keeps it),
        # then its rank-1 page (nothing keeps it).
        for round_ in range(pages // 4):
            client.commit(client.reserve(pool, 0, keys(bytes([round_]) + b"f", 4)).reservation_id)
        assert client.stats()["evicted_objects_total"] >= 2
        reply = client.events(pool, 1, probe=[block])
        assert reply.present == [ABSENT]
        assert reply.kinds == [EventKind.DEMOTED, EventKind.REMOVED]
        assert reply.hashes == [block, block]
