"""Reclaim across pools: extents go back to the allocator, and a pool below its fair share of a
full arena takes one from an idle or oversized pool (idle first)."""

from __future__ import annotations

import random

from kvshelf.protocol import PageLayout
from kvshelf.server.index import CacheIndex
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.reclaim import IDLE_S
from kvshelf.server.tiers.shared_memory import ExtentAllocator

PAGE = 4096
LEASE = 30.0


def make_index(num_pages: int = 16, extent_pages: int = 4) -> CacheIndex:
    arena = ArenaTier(
        ExtentAllocator(num_pages * PAGE), eviction_watermark=0.9, extent_bytes=extent_pages * PAGE
    )
    return CacheIndex([arena], lease_timeout_s=LEASE)


def register(index: CacheIndex, model: str, page_bytes: int = PAGE) -> str:
    layout = PageLayout(
        model_fingerprint=model, layout_fingerprint="l", page_bytes=page_bytes, world_size=1, rank=0
    )
    return index.register(layout).name


def keys(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}{i}".encode().ljust(32, b".") for i in range(count)]


def store(index: CacheIndex, pool: str, hashes: list[bytes], now: float) -> list[int | None]:
    reservation_id, pages = index.reserve(pool, 0, hashes, now)
    index.commit(reservation_id)
    return pages


def test_allocator_reuses_returned_extents_and_shrinks_its_tail() -> None:
    allocator = ExtentAllocator(16 * PAGE)
    a = allocator.allocate(PAGE, 4)
    b = allocator.allocate(PAGE, 4)
    c = allocator.allocate(2 * PAGE, 2)
    assert (a, b, c) == (range(0, 4), range(4, 8), range(4, 6))
    assert allocator.used_bytes == 12 * PAGE
    allocator.release(a, PAGE)
    assert allocator.used_bytes == 8 * PAGE
    # Reused before the tail, aligned to the new page size.
    assert allocator.allocate(2 * PAGE, 8) == range(0, 2)
    allocator.release(c, 2 * PAGE)
    allocator.release(b, PAGE)
    assert allocator.used_bytes == 4 * PAGE
    # Everything after the first extent is free again, the tail included.
    assert allocator.allocate(PAGE, 100) == range(4, 16)


def test_a_redeploy_on_a_full_arena_gets_pages_at_once() -> None:
    index = make_index()
    old = register(index, "old-weights")
    assert None not in store(index, old, keys("o", 16), now=0.0)
    assert index.stats()["allocated_bytes"] == 16 * PAGE
    new = register(index, "new-weights")
    pages = store(index, new, keys("n", 3), now=1.0)
    assert None not in pages
    stats = index.stats()
    assert stats["reclaimed_extents_total"] == 1 and stats["evicted_objects_total"] == 4
    # The new pool keeps growing up to its fair share (half the arena: both are in use).
    assert None not in store(index, new, keys("m", 5), now=2.0)
    assert index.stats()["reclaimed_extents_total"] == 2
    index.check_invariants()
    # Once the old pool is idle, the new one may take the whole arena.
    assert None not in store(index, new, keys("k", 8), now=3.0 + IDLE_S)
    assert index.stats()["allocated_bytes"] == 16 * PAGE
    assert index.lookup(old, keys("o", 16), 1, lock=False, now=4.0 + IDLE_S)[0] == 0
    index.check_invariants()


def test_locked_or_reserved_extents_are_never_reclaimed() -> None:
    index = make_index(8)
    old = register(index, "old")
    hashes = keys("o", 8)
    store(index, old, hashes, now=0.0)
    _, lock_id, _ = index.lookup(old, hashes, 1, lock=True, now=0.0)
    new = register(index, "new")
    assert store(index, new, keys("n", 2), now=1.0) == [None, None]
    index.release(lock_id, 0)
    assert None not in store(index, new, keys("n", 2), now=2.0)
    assert index.lookup(old, hashes, 1, lock=False, now=2.0)[0] == 0
    index.check_invariants()


def test_random_operations_over_several_pools_keep_invariants() -> None:
    rng = random.Random(7)
    index = make_index(24, extent_pages=3)
    pools = [register(index, f"m{i}", page_bytes=PAGE * (1 + i % 2)) for i in range(3)]
    reservations: list[int] = []
    locks: list[int] = []
    now = 0.0
    for _ in range(4000):
        now += rng.random() * 5
        pool = rng.choice(pools)
        hashes = keys(f"{pool}-", 30)[rng.randrange(25) :][: rng.randrange(1, 6)]
        op = rng.randrange(5)
        if op == 0:
            reservations.append(index.reserve(pool, 0, hashes, now)[0])
        elif op == 1 and reservations:
            index.commit(reservations.pop(rng.randrange(len(reservations))))
        elif op == 2 and reservations:
            index.abort(reservations.pop(rng.randrange(len(reservations))))
        elif op == 3:
            lock_id = index.lookup(pool, hashes, 1, lock=True, now=now)[1]
            if lock_id:
                locks.append(lock_id)
        elif locks:
            index.release(locks.pop(rng.randrange(len(locks))), 0)
        index.check_invariants()
    assert index.stats()["reclaimed_extents_total"] > 0
