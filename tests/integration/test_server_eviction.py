"""Eviction under memory pressure against a real server never touches locked or reserved pages."""

from __future__ import annotations

import os

from kvshelf.protocol import PageLayout
from testbed.server import ServerProcess, map_arena_file

PAGE = 16 * 1024
NUM_PAGES = 64
LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="evict", page_bytes=PAGE, world_size=1, rank=0
)


def keys(tag: bytes, n: int, start: int = 0) -> list[bytes]:
    return [tag + i.to_bytes(4, "big") * 4 for i in range(start, start + n)]


def test_pressure_never_evicts_locked_or_reserved_pages() -> None:
    with (
        ServerProcess(l1_size_gb=NUM_PAGES * PAGE / 2**30, eviction_watermark=0.9) as server,
        server.client() as client,
    ):
        registration = client.register(LAYOUT)
        assert registration.arena_bytes == NUM_PAGES * PAGE
        pool = registration.pool
        arena = map_arena_file(registration.shm_name)

        def fill(page: int) -> bytes:
            data = os.urandom(PAGE)
            arena[page * PAGE : (page + 1) * PAGE] = data
            return data

        locked_keys = keys(b"L", 20)
        stored = client.reserve(pool, 0, locked_keys)
        expected = {page: fill(page) for page in stored.pages}
        client.commit(stored.reservation_id)
        lock = client.lookup(pool, locked_keys, world_size=1, lock=True)
        assert lock.num_hit_blocks == 20 and sorted(lock.pages[0]) == sorted(expected)

        held = client.reserve(pool, 0, keys(b"R", 20))
        assert None not in held.pages
        expected.update({page: fill(page) for page in held.pages})
        protected = set(expected)
        assert len(protected) == 40

        for round_ in range(40):
            batch = client.reserve(pool, 0, keys(b"P", 8, start=8 * round_))
            pages = [p for p in batch.pages if p is not None]
            assert len(pages) == 8, "24 pages are free or evictable, enough for a batch"
            assert not protected & set(pages)
            for page in pages:
                fill(page)
            client.commit(batch.reservation_id)

        # More than is evictable in one go: the rest is skipped, nothing protected is taken.
        overflow = client.reserve(pool, 0, keys(b"O", 30))
        granted = [p for p in overflow.pages if p is not None]
        assert len(granted) == NUM_PAGES - 40 and not protected & set(granted)
        assert overflow.pages[len(granted) :] == [None] * (30 - len(granted))
        client.abort(overflow.reservation_id)

        for page, data in expected.items():
            assert arena[page * PAGE : (page + 1) * PAGE] == data, f"page {page} was overwritten"
        assert client.lookup(pool, locked_keys, world_size=1, lock=False).num_hit_blocks == 20
        stats = client.stats()
        assert stats["evicted_objects_total"] >= 40 * 8 - 24
        assert stats["locked_objects"] == 20 and stats["reserved_objects"] == 20

        # Once released and committed, the protected pages are ordinary LRU pages again.
        client.release(lock.lock_id, 0)
        client.commit(held.reservation_id)
        everything = client.reserve(pool, 0, keys(b"A", NUM_PAGES))
        assert None not in everything.pages
        arena.close()
