"""The cache index alone: states, prefix lookups, locks, leases, eviction and allocation."""

from __future__ import annotations

import gc
import itertools
import random

import pytest

from kvshelf.protocol import (
    MAX_OBJECTS_PER_REQUEST,
    ErrorCode,
    PageLayout,
    max_request_keys,
    pool_name,
)
from kvshelf.server.index import CacheIndex, RequestRejected
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.extents import MAX_PAGES_PER_EXTENT
from kvshelf.server.tiers.shared_memory import ExtentAllocator

PAGE = 1024
LEASE = 10.0


def make_index(num_pages: int = 16, *, watermark: float = 1.0, extent_pages: int = 4) -> CacheIndex:
    arena = ArenaTier(
        ExtentAllocator(num_pages * PAGE),
        eviction_watermark=watermark,
        extent_bytes=extent_pages * PAGE,
    )
    return CacheIndex([arena], lease_timeout_s=LEASE)


def register(index: CacheIndex, world_size: int = 1, page_bytes: int = PAGE) -> str:
    layout = PageLayout(
        model_fingerprint="m",
        layout_fingerprint=f"l{page_bytes}",
        page_bytes=page_bytes,
        world_size=world_size,
        rank=0,
    )
    return index.register(layout).name


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(4, "big") * 8 for i in ids]


def store(index: CacheIndex, pool: str, hashes: list[bytes], ranks: int = 1) -> None:
    for rank in range(ranks):
        reservation_id, _ = index.reserve(pool, rank, hashes, now=0.0)
        index.commit(reservation_id)


def test_register_is_idempotent_and_checks_page_bytes() -> None:
    index = make_index()
    pool = register(index)
    assert pool == pool_name("m", f"l{PAGE}", 1)
    assert register(index) == pool
    bad = PageLayout(
        model_fingerprint="m",
        layout_fingerprint=f"l{PAGE}",
        page_bytes=2 * PAGE,
        world_size=1,
        rank=0,
    )
    with pytest.raises(RequestRejected) as info:
        index.register(bad)
    assert info.value.code is ErrorCode.LAYOUT_MISMATCH


def test_reserved_pages_are_invisible_until_commit() -> None:
    index = make_index()
    pool = register(index)
    reservation_id, pages = index.reserve(pool, 0, keys(1, 2), now=0.0)
    assert None not in pages and len(set(pages)) == 2
    assert index.lookup(pool, keys(1, 2), 1, lock=False, now=0.0)[0] == 0
    index.commit(reservation_id)
    assert index.lookup(pool, keys(1, 2), 1, lock=False, now=0.0)[0] == 2
    index.check_invariants()


def test_reserve_skips_present_and_in_flight_keys() -> None:
    index = make_index()
    pool = register(index)
    store(index, pool, keys(1))
    first, pages = index.reserve(pool, 0, keys(1, 2, 2), now=0.0)
    assert pages[0] is None and pages[1] is not None and pages[2] is None
    _, pages = index.reserve(pool, 0, keys(2, 3), now=0.0)
    assert pages[0] is None and pages[1] is not None
    index.abort(first)
    _, pages = index.reserve(pool, 0, keys(2), now=0.0)
    assert pages[0] is not None
    index.check_invariants()


def test_lookup_is_the_prefix_present_for_all_ranks() -> None:
    index = make_index(32)
    pool = register(index, world_size=2)
    index.commit(index.reserve(pool, 0, keys(1, 2, 3, 5), now=0.0)[0])
    index.commit(index.reserve(pool, 1, keys(1, 2, 4, 5), now=0.0)[0])
    assert index.lookup(pool, keys(1, 2, 3, 4, 5), 2, lock=False, now=0.0)[0] == 2
    assert index.lookup(pool, keys(3, 4, 5), 2, lock=False, now=0.0)[0] == 0
    assert index.lookup("pool-unknown", keys(1), 2, lock=False, now=0.0) == (0, 0, [])
    with pytest.raises(RequestRejected):
        index.lookup(pool, keys(1), 1, lock=False, now=0.0)


def test_lock_pages_and_release_per_rank() -> None:
    index = make_index(32)
    pool = register(index, world_size=2)
    store(index, pool, keys(1, 2), ranks=2)
    num_hits, lock_id, pages = index.lookup(pool, keys(1, 2, 3), 2, lock=True, now=0.0)
    assert num_hits == 2 and lock_id > 0
    assert len(pages) == 2 and all(len(share) == 2 for share in pages)
    assert index.stats()["locked_objects"] == 4
    with pytest.raises(RequestRejected) as info:
        index.release(lock_id, 1, copied=3)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    index.release(lock_id, 1, copied=2)
    with pytest.raises(RequestRejected) as info:
        index.release(lock_id, 1)
    assert info.value.code is ErrorCode.UNKNOWN_LOCK
    index.release(lock_id, 0, copied=1)
    stats = index.stats()
    assert stats["locked_objects"] == 0 and stats["loaded_objects_total"] == 3
    assert stats["locked_objects_total"] == 4
    assert stats["lookup_hit_objects_total"] == 4
    with pytest.raises(RequestRejected):
        index.release(lock_id, 0)
    index.check_invariants()


def test_eviction_is_lru_and_spares_locked_and_reserved_pages() -> None:
    index = make_index(4)
    pool = register(index)
    store(index, pool, keys(1))
    store(index, pool, keys(2))
    store(index, pool, keys(3))
    _, lock_id, _ = index.lookup(pool, keys(1), 1, lock=True, now=0.0)
    in_flight, _ = index.reserve(pool, 0, keys(4), now=0.0)
    # Full: 1 locked, 4 reserved, 2 and 3 evictable with 2 the least recently used.
    _, pages = index.reserve(pool, 0, keys(5), now=0.0)
    assert pages[0] is not None
    found = [index.lookup(pool, keys(k), 1, lock=False, now=0.0)[0] for k in (1, 2, 3)]
    assert found == [1, 0, 1]
    # Only 3 is evictable now; after it goes, nothing is.
    _, pages = index.reserve(pool, 0, keys(6, 7), now=0.0)
    assert pages[0] is not None and pages[1] is None
    assert index.stats()["evicted_objects_total"] == 2
    index.release(lock_id, 0)
    index.commit(in_flight)
    index.check_invariants()


def test_eviction_takes_chain_tails_first() -> None:
    index = make_index(4)
    pool = register(index)
    store(index, pool, keys(1, 2, 3, 4))
    _, pages = index.reserve(pool, 0, keys(9), now=0.0)
    assert pages[0] is not None
    assert index.lookup(pool, keys(1, 2, 3, 4), 1, lock=False, now=0.0)[0] == 3


def test_a_store_evicts_its_new_keys_pages_in_one_go_and_spares_its_own_hits() -> None:
    index = make_index(4)
    pool = register(index)
    store(index, pool, keys(1))
    store(index, pool, keys(2, 3, 4))
    # Full, with 1 least recently used. The batch hits 1 and brings two new keys, one of them
    # twice: 1 is touched before the two evictions, so 4 and 3 go (2 is the chain's head).
    _, pages = index.reserve(pool, 0, keys(5, 1, 6, 5), now=0.0)
    assert [page is not None for page in pages] == [True, False, True, False]
    found = [index.lookup(pool, keys(k), 1, lock=False, now=0.0)[0] for k in (1, 2, 3, 4)]
    assert found == [1, 1, 0, 0]
    stats = index.stats()
    assert stats["evicted_objects_total"] == 2 and stats["reserve_skipped_objects_total"] == 2
    assert stats["reserve_no_space_objects_total"] == 0
    index.check_invariants()


def test_a_store_larger_than_the_arena_gets_what_eviction_can_give() -> None:
    index = make_index(4)
    pool = register(index)
    store(index, pool, keys(1, 2))
    _, lock_id, _ = index.lookup(pool, keys(1), 1, lock=True, now=0.0)
    # Two free pages, then one eviction (2; 1 is locked), then nothing.
    reservation_id, pages = index.reserve(pool, 0, keys(5, 6, 7, 8), now=0.0)
    assert [page is not None for page in pages] == [True, True, True, False]
    stats = index.stats()
    assert stats["evicted_objects_total"] == 1 and stats["reserve_no_space_objects_total"] == 1
    index.check_invariants()
    index.commit(reservation_id)
    index.release(lock_id, 0)
    index.check_invariants()


def test_watermark_evicts_before_using_free_space() -> None:
    index = make_index(8, watermark=0.5, extent_pages=8)
    pool = register(index)
    store(index, pool, keys(1, 2, 3, 4))
    store(index, pool, keys(5))
    stats = index.stats()
    assert stats["evicted_objects_total"] == 1 and stats["resident_objects"] == 4


def test_leases_expire_reservations_and_locks() -> None:
    index = make_index()
    pool = register(index)
    store(index, pool, keys(1))
    _, lock_id, _ = index.lookup(pool, keys(1), 1, lock=True, now=1.0)
    reservation_id, _ = index.reserve(pool, 0, keys(2), now=2.0)
    assert index.expire(now=1.0 + LEASE - 0.1) == 0
    assert index.expire(now=1.0 + LEASE) == 1
    with pytest.raises(RequestRejected):
        index.release(lock_id, 0)
    assert index.expire(now=2.0 + LEASE) == 1
    with pytest.raises(RequestRejected) as info:
        index.commit(reservation_id)
    assert info.value.code is ErrorCode.UNKNOWN_RESERVATION
    stats = index.stats()
    assert stats["locked_objects"] == 0 and stats["reserved_objects"] == 0
    assert stats["expired_locks_total"] == 1 and stats["expired_reservations_total"] == 1
    index.check_invariants()


def test_rejected_requests_change_nothing() -> None:
    index = make_index()
    pool = register(index, world_size=2)
    store(index, pool, keys(1), ranks=2)
    before = index.stats()
    bad_calls = [
        lambda: index.commit(12345),
        lambda: index.abort(12345),
        lambda: index.release(12345, 0),
        lambda: index.reserve("pool-unknown", 0, keys(2), now=0.0),
        lambda: index.reserve(pool, 2, keys(2), now=0.0),
        lambda: index.lookup(pool, keys(1), 3, lock=True, now=0.0),
    ]
    for call in bad_calls:
        with pytest.raises(RequestRejected):
            call()
    assert index.stats() == before
    index.check_invariants()


def test_extents_start_at_multiples_of_their_page_size() -> None:
    index = make_index(64, extent_pages=3)
    small = register(index, page_bytes=PAGE)
    big = register(index, page_bytes=3 * PAGE)
    seen: dict[str, set[int]] = {small: set(), big: set()}
    for i in range(6):
        for pool in (small, big):
            _, pages = index.reserve(pool, 0, keys(i), now=0.0)
            (page,) = pages
            assert page is not None
            seen[pool].add(page)
    byte_ranges = sorted(
        (page * size, (page + 1) * size)
        for pool, size in ((small, PAGE), (big, 3 * PAGE))
        for page in seen[pool]
    )
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(byte_ranges))
    assert byte_ranges[-1][1] <= 64 * PAGE


def test_random_operations_keep_invariants() -> None:
    rng = random.Random(1234)
    index = make_index(12, watermark=0.8, extent_pages=3)
    pool = register(index, world_size=2)
    reservations: list[int] = []
    locks: list[tuple[int, int]] = []
    now = 0.0
    for _ in range(3000):
        now += rng.random()
        op = rng.randrange(6)
        hashes = keys(*(rng.randrange(20) for _ in range(rng.randrange(1, 6))))
        try:
            if op == 0:
                reservations.append(index.reserve(pool, rng.randrange(2), hashes, now)[0])
            elif op == 1 and reservations:
                index.commit(reservations.pop(rng.randrange(len(reservations))))
            elif op == 2 and reservations:
                index.abort(reservations.pop(rng.randrange(len(reservations))))
            elif op == 3:
                _, lock_id, _ = index.lookup(pool, hashes, 2, lock=True, now=now)
                if lock_id:
                    locks.append((lock_id, rng.randrange(2)))
            elif op == 4 and locks:
                index.release(*locks.pop(rng.randrange(len(locks))))
            else:
                index.expire(now)
        except RequestRejected as exc:
            # Only leases that ran out may make a well-formed operation fail.
            assert exc.code in (ErrorCode.UNKNOWN_RESERVATION, ErrorCode.UNKNOWN_LOCK)
        index.check_invariants()


def test_tiny_pages_grow_in_bounded_extents() -> None:
    index = CacheIndex(
        [ArenaTier(ExtentAllocator(2**30), eviction_watermark=1.0)], lease_timeout_s=LEASE
    )
    pool = register(index, page_bytes=1)
    _, pages = index.reserve(pool, 0, keys(1), now=0.0)
    assert pages == [0]
    assert index.stats()["allocated_bytes"] == MAX_PAGES_PER_EXTENT


def test_boots_never_reuse_each_others_ids() -> None:
    """A client's commit or release that reaches a restarted server (which may have adopted the
    old arena) must not name a reservation or lock of the new boot."""
    first_ids = set()
    for _ in range(8):
        index = make_index()
        reservation_id, _ = index.reserve(register(index), 0, keys(1), now=0.0)
        first_ids.add(reservation_id)
    assert len(first_ids) == 8


def test_ids_are_random_63_bit_and_never_zero_nor_a_live_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    index = make_index()
    pool = register(index)
    draws = iter([0, 7, 7, 2**63 - 1, 7])
    monkeypatch.setattr("kvshelf.server.index.secrets.randbits", lambda bits: next(draws))
    # 0 (no id) and the live 7 are drawn again; 7 is free once its reservation is committed.
    first, _ = index.reserve(pool, 0, keys(1), now=0.0)
    second, _ = index.reserve(pool, 0, keys(2), now=0.0)
    index.commit(first)
    lock_id = index.lookup(pool, keys(1), 1, True, now=0.0)[1]
    assert (first, second, lock_id) == (7, 2**63 - 1, 7)


class CountingDict(dict):
    """A key table that counts its look-ups."""

    gets = 0

    def get(self, key, default=None):  # type: ignore[override]
        CountingDict.gets += 1
        return super().get(key, default)


def test_a_repeated_key_is_looked_up_once_and_the_request_cost_is_bounded() -> None:
    world = 16
    index = make_index(64)
    pool = register(index, world_size=world)
    store(index, pool, keys(1, 2), ranks=world)
    tables = index._pools[pool].tables
    index._pools[pool].tables = [CountingDict(table) for table in tables]
    most = max_request_keys(world)
    assert most * world == MAX_OBJECTS_PER_REQUEST
    CountingDict.gets = 0
    assert index.lookup(pool, keys(1) * most, world, False, now=0.0)[0] == most
    assert CountingDict.gets == world
    CountingDict.gets = 0
    assert index.lookup(pool, [*keys(1, 2) * (most // 2)], world, False, now=0.0)[0] == most
    assert CountingDict.gets == 2 * world
    before = index.stats()
    with pytest.raises(RequestRejected) as info:
        index.lookup(pool, keys(1) * (most + 1), world, True, now=0.0)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and "hashes holds" in info.value.message
    assert index.stats() == before


def test_a_rank_giving_up_a_block_frees_the_other_ranks_pages_and_keeps_the_invariants() -> None:
    """Aborts and lease ends of one rank free the other ranks' pages of the blocks it does not
    hold, committed (now) or reserved (at their commit); the page states, byte sums and policy
    stay consistent throughout, and the freed pages are reused."""
    index = make_index(num_pages=16)
    pool = register(index, world_size=3)
    stats = index.stats
    # Rank 0 committed 0-3, rank 1 reserved them, rank 2 holds 0 and 1 and gives up the rest.
    store(index, pool, keys(0, 1), ranks=3)
    first, _ = index.reserve(pool, 0, keys(0, 1, 2, 3), now=0.0)
    index.commit(first)
    second, _ = index.reserve(pool, 1, keys(0, 1, 2, 3), now=0.0)
    third, pages = index.reserve(pool, 2, keys(0, 1, 2, 3), now=0.0)
    assert pages[:2] == [None, None]
    index.abort(third)
    index.check_invariants()
    assert stats()["unwhole_dropped_objects_total"] == 2  # rank 0's pages of blocks 2 and 3
    index.commit(second)
    index.check_invariants()
    assert stats()["unwhole_dropped_objects_total"] == 4  # and rank 1's, at its commit
    assert stats()["resident_objects"] == 6
    assert index.lookup(pool, keys(0, 1, 2, 3), 3, False, 0.0)[0] == 2
    # A lease end is an abort: rank 2's lapsed reservation takes rank 0's new pages along.
    store(index, pool, keys(4), ranks=2)
    index.reserve(pool, 2, keys(4), now=0.0)
    assert index.expire(LEASE + 1) == 1
    index.check_invariants()
    assert stats()["unwhole_dropped_objects_total"] == 6
    assert stats()["resident_objects"] == 6
    # The freed pages take new blocks, whole this time.
    store(index, pool, keys(5, 6), ranks=3)
    index.check_invariants()
    assert index.lookup(pool, keys(5, 6), 3, False, 0.0)[0] == 2


def tracked_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_the_index_keeps_no_object_per_key_for_the_cyclic_collector() -> None:
    """A full collection walks every object the collector tracks while the server's loop
    waits: pages and entries (one per key) are never tracked, so 4,096 keys add none."""
    index = make_index(num_pages=4096, extent_pages=MAX_PAGES_PER_EXTENT)
    pool = register(index)
    before = tracked_objects()
    for start in range(0, 4096, 512):
        store(index, pool, keys(*range(start, start + 512)))
    assert index.stats()["resident_objects"] == 4096
    assert tracked_objects() - before < 256
    index.check_invariants()


def test_a_clear_drops_a_bounded_number_of_pages_per_request_and_spares_locked_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One Clear may hold the loop for CLEAR_PAGES_PER_REQUEST pages only (issue 49): scaled
    # down to 5 pages a request, 12 committed pages take three, the locked one stays.
    monkeypatch.setattr("kvshelf.server.index.CLEAR_PAGES_PER_REQUEST", 5)
    index = make_index(32)
    pool = register(index)
    store(index, pool, keys(*range(12)))
    _, lock_id, _ = index.lookup(pool, keys(0), 1, lock=True, now=0.0)
    assert index.clear() == (5, 6, 1, 0, False)
    assert index.lookup(pool, keys(0), 1, lock=False, now=0.0)[0] == 1
    assert index.clear() == (5, 1, 1, 0, False)
    assert index.clear() == (1, 0, 1, 0, False)
    assert index.stats()["resident_objects"] == 1  # the locked page, until it is released
    index.check_invariants()
    index.release(lock_id, 0)
    assert index.clear() == (1, 0, 0, 0, False)
    assert index.stats()["resident_objects"] == 0
    index.check_invariants()
