"""The storage-tier seam in one process: the commit hook and fetches from a tier below L1."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Iterator

import pytest

from kvshelf.protocol import ErrorCode, PageLayout
from kvshelf.server.completions import Completions
from kvshelf.server.index import CacheIndex, RequestRejected
from kvshelf.server.lower_tiers import DeferredLookup, IndexHit
from kvshelf.server.pool import Entry, Pool
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.base import Tier, TierLoad, TierStore
from kvshelf.server.tiers.shared_memory import ExtentAllocator, SharedMemoryArena

PAGE = 4096
NUM_PAGES = 16
LEASE = 10.0


class RecordingTier(Tier):
    """A tier below L1 that records every job and finishes only when the test says so."""

    name = "recording"

    def __init__(self, objects: dict[int, bytes] | None = None) -> None:
        self.objects = objects or {}
        self.stores: list[TierStore] = []
        self.completed_stores: list[TierStore] = []
        self.loads: list[TierLoad] = []
        self.completed_loads: list[TierLoad] = []

    def lookup(self, entry: Entry) -> bool:
        return entry.location in self.objects

    def prepare_load(self, load: TierLoad) -> None:
        self.loads.append(load)

    def complete_load(self, load: TierLoad) -> None:
        self.completed_loads.append(load)

    def prepare_store(self, store: TierStore) -> None:
        # The bytes as they are at commit: the page is pinned until finish().
        self.stores.append(store)

    def complete_store(self, store: TierStore) -> None:
        self.completed_stores.append(store)


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(4, "big") * 8 for i in ids]


@pytest.fixture
def memory() -> Iterator[SharedMemoryArena]:
    arena = SharedMemoryArena(f"kvshelf-test-tiers-{os.getpid()}", NUM_PAGES * PAGE)
    yield arena
    arena.close()


@pytest.fixture
def completions() -> Iterator[Completions]:
    completions = Completions()
    yield completions
    completions.close()


def make_index(
    memory: SharedMemoryArena,
    completions: Completions,
    tier: Tier,
    clock: Callable[[], float] = lambda: 0.0,
) -> tuple[CacheIndex, ArenaTier]:
    arena = ArenaTier(
        ExtentAllocator(memory.size_bytes),
        eviction_watermark=1.0,
        extent_bytes=4 * PAGE,
        memory=memory,
    )
    index = CacheIndex([arena, tier], lease_timeout_s=LEASE, completions=completions, clock=clock)
    return index, arena


def register(index: CacheIndex, world_size: int = 1) -> str:
    layout = PageLayout(
        model_fingerprint="m",
        layout_fingerprint="l",
        page_bytes=PAGE,
        world_size=world_size,
        rank=0,
    )
    return index.register(layout).name


def finish_stores(tier: RecordingTier, completions: Completions) -> None:
    for store in tier.stores[len(tier.completed_stores) :]:
        store.finish()
    completions.run()
    assert tier.completed_stores == tier.stores


def write(memory: SharedMemoryArena, page: int, fill: int) -> bytes:
    data = bytes([fill]) * PAGE
    memory.view(page * PAGE, PAGE)[:] = data
    return data


def test_the_commit_hook_sees_each_committed_page_once(
    memory: SharedMemoryArena, completions: Completions
) -> None:
    tier = RecordingTier()
    index, _ = make_index(memory, completions, tier)
    pool = register(index, world_size=2)
    written: dict[tuple[int, bytes], tuple[int, bytes]] = {}

    def store(rank: int, hashes: list[bytes], fill: int, now: float = 0.0) -> int:
        reservation_id, pages = index.reserve(pool, rank, hashes, now)
        for block_hash, page in zip(hashes, pages, strict=True):
            if page is not None:
                written[rank, block_hash] = page, write(memory, page, fill)
        return reservation_id

    index.commit(store(0, keys(1, 2, 3), fill=1))
    index.abort(store(1, keys(1, 2), fill=2))
    store(1, keys(4), fill=3, now=1.0)  # never committed: its lease ends
    index.expire(now=1.0 + LEASE)
    index.commit(store(0, keys(1, 5), fill=4))  # 1 is skipped: already committed
    index.check_invariants()

    committed = [(0, k) for k in keys(1, 2, 3, 5)]
    seen = [
        (store.rank, block_hash, page.location, bytes(view))
        for store in tier.stores
        for block_hash, page, view in zip(store.block_hashes, store.pages, store.views, strict=True)
    ]
    assert [(rank, block_hash) for rank, block_hash, _, _ in seen] == committed
    for rank, block_hash, location, data in seen:
        assert (location, data) == written[rank, block_hash]
    assert all(
        store.pool.name == pool and view.readonly for store in tier.stores for view in store.views
    )
    # Pinned in L1 while the tier copies them: eviction cannot reuse them meanwhile.
    assert index.stats()["locked_objects"] == 4
    assert completions.run() == 0 and tier.completed_stores == []

    finishers = [threading.Thread(target=store.finish) for store in tier.stores]
    for thread in finishers:
        thread.start()
    for thread in finishers:
        thread.join()
    assert completions.run() == 2
    assert tier.completed_stores == tier.stores
    assert index.stats()["locked_objects"] == 0
    index.check_invariants()


def test_a_fetch_loads_stored_blocks_into_l1_before_answering(
    memory: SharedMemoryArena, completions: Completions
) -> None:
    objects = {10: b"\x0a" * PAGE, 11: b"\x0b" * PAGE, 20: b"\x14" * PAGE, 21: b"\x15" * PAGE}
    tier = RecordingTier(objects)
    index, _ = make_index(memory, completions, tier)
    pool = register(index, world_size=2)
    hashes = keys(1, 2, 3, 4)
    for rank in range(2):
        index.commit(index.reserve(pool, rank, hashes[:1], now=0.0)[0])
        # Blocks 2 and 3 are held below L1 only; block 4 nowhere.
        assert index.add_stored(pool, rank, hashes[1], tier, 10 + rank)
        assert index.add_stored(pool, rank, hashes[2], tier, 20 + rank)
    finish_stores(tier, completions)
    assert not index.add_stored(pool, 0, hashes[0], tier, 99)

    pending = index.lookup(pool, hashes, 2, lock=True, now=0.0)
    assert isinstance(pending, DeferredLookup)
    answers: list[IndexHit] = []
    pending.answer = answers.append
    (load,) = tier.loads
    assert len(load.pages) == len(load.views) == 4
    index.check_invariants()
    # While the fetch runs, the L1 prefix is pinned and the other requests go on.
    assert index.stats()["locked_objects"] == 2
    assert index.lookup(pool, hashes[:1], 2, lock=False, now=0.0) == (1, 0, [])

    for entry, view in zip(load.entries, load.views, strict=True):
        view[:] = objects[entry.location]
    # Rank 1's copy of block 3 failed: the hit stops before block 3, it is never wrong.
    landed = [not (entry.rank == 1 and entry.block_hash == hashes[2]) for entry in load.entries]
    thread = threading.Thread(target=load.finish, args=(landed,))
    thread.start()
    thread.join()
    assert answers == []
    assert completions.run() == 1
    (answer,) = answers
    num_hits, lock_id, pages = answer
    assert num_hits == 2 and lock_id > 0 and len(pages) == 2
    for rank, share in enumerate(pages):
        assert bytes(memory.view(share[1] * PAGE, PAGE)) == objects[10 + rank]
    assert tier.completed_loads == [load]
    stats = index.stats()
    assert stats["locked_objects"] == 4 and stats["resident_objects"] == 5
    index.check_invariants()
    for rank in range(2):
        index.release(lock_id, rank)
    # Block 3 of rank 1 is still below L1; rank 0's landed copy stays in L1.
    assert index.lookup(pool, hashes[:2], 2, lock=False, now=0.0) == (2, 0, [])
    index.check_invariants()


def test_only_l1_answers_at_once_and_a_full_l1_fetches_nothing(
    memory: SharedMemoryArena, completions: Completions
) -> None:
    tier = RecordingTier({1: b"\x01" * PAGE})
    index, _ = make_index(memory, completions, tier)
    pool = register(index)
    hashes = keys(*range(NUM_PAGES + 1))
    # Every page of L1 holds a block of the prefix: nowhere to load the last block into.
    index.commit(index.reserve(pool, 0, hashes[:NUM_PAGES], now=0.0)[0])
    finish_stores(tier, completions)
    assert index.add_stored(pool, 0, hashes[NUM_PAGES], tier, 1)
    result = index.lookup(pool, hashes, 1, lock=False, now=0.0)
    assert result == (NUM_PAGES, 0, [])
    assert tier.loads == [] and index.stats()["locked_objects"] == 0
    # An entry the tier can no longer load is no hit either.
    assert index.remove_stored(pool, 0, hashes[NUM_PAGES], tier)
    assert not index.remove_stored(pool, 0, hashes[NUM_PAGES], tier)
    index.check_invariants()


def test_random_operations_with_a_tier_below_keep_invariants(
    memory: SharedMemoryArena, completions: Completions
) -> None:
    rng = random.Random(4321)
    tier = RecordingTier({k: b"" for k in range(20)})
    now = 0.0
    index, _ = make_index(memory, completions, tier, clock=lambda: now)
    pool = register(index, world_size=2)
    reservations: list[int] = []
    locks: list[tuple[int, int]] = []
    answers: list[IndexHit | None] = []
    finished: set[int] = set()
    for _ in range(2000):
        now += rng.random()
        op = rng.randrange(7)
        hashes = keys(*(rng.randrange(24) for _ in range(rng.randrange(1, 5))))
        # The tier below keeps (again) some keys that L1 evicted or never had.
        k = rng.randrange(20)
        for rank in range(2):
            index.add_stored(pool, rank, keys(k)[0], tier, k)
        try:
            if op == 0:
                reservations.append(index.reserve(pool, rng.randrange(2), hashes, now)[0])
            elif op == 1 and reservations:
                index.commit(reservations.pop(rng.randrange(len(reservations))))
            elif op == 2:
                result = index.lookup(pool, hashes, 2, lock=rng.random() < 0.8, now=now)
                if isinstance(result, DeferredLookup):
                    result.answer = answers.append
                elif result[1]:
                    locks.append((result[1], rng.randrange(2)))
            elif op == 3 and locks:
                index.release(*locks.pop(rng.randrange(len(locks))))
            elif op == 4:
                # Tiers below finish some of their jobs, in any order, landed or not.
                for load in tier.loads:
                    if not load.landed and rng.random() < 0.5:
                        load.finish([rng.random() < 0.8 for _ in load.pages])
                for store in tier.stores:
                    if id(store) not in finished and rng.random() < 0.5:
                        finished.add(id(store))
                        store.finish()
                completions.run()
                # None: answered "pending" at its deadline (the loads went on).
                locks.extend((a[1], rng.randrange(2)) for a in answers if a is not None and a[1])
                answers.clear()
            else:
                index.expire(now)
        except RequestRejected as exc:
            assert exc.code in (ErrorCode.UNKNOWN_RESERVATION, ErrorCode.UNKNOWN_LOCK)
        index.check_invariants()
    for load in tier.loads:
        if not load.landed:
            load.finish([True] * len(load.pages))
    for store in tier.stores:
        if id(store) not in finished:
            store.finish()
    completions.run()
    index.check_invariants()
    assert len(tier.completed_loads) == len(tier.loads)
    assert len(tier.completed_stores) == len(tier.stores)
    assert len(tier.loads) > 100 and len(tier.stores) > 30
    stats = index.stats()
    assert stats["evicted_objects_total"] > 0 and stats["lookup_hit_objects_total"] > 0


class HoldingTier(RecordingTier):
    """A recording tier that also says it keeps a copy of every key in ``held``."""

    def __init__(self, objects: dict[int, bytes], held: dict[bytes, int]) -> None:
        super().__init__(objects)
        self.held = held

    def holds(self, pool: Pool, rank: int, block_hash: bytes) -> int | None:
        return self.held.get(block_hash)


def test_a_late_fetch_is_answered_pending_and_the_next_lookup_joins_its_loads(
    memory: SharedMemoryArena, completions: Completions
) -> None:
    tier = RecordingTier({1: b"\x01" * PAGE, 2: b"\x02" * PAGE})
    now = 0.0
    index, _ = make_index(memory, completions, tier, clock=lambda: now)
    pool = register(index)
    hashes = keys(1, 2)
    assert index.add_stored(pool, 0, hashes[0], tier, 1)
    assert index.add_stored(pool, 0, hashes[1], tier, 2)
    first = index.lookup(pool, hashes, 1, lock=True, now=now)
    assert isinstance(first, DeferredLookup) and index.fetching
    answers: list[IndexHit | None] = []
    first.answer = answers.append
    index.expire(now + 0.1)
    assert answers == []
    now = 1.0
    index.expire(now)
    assert answers == [None] and not index.fetching
    index.check_invariants()
    # The load goes on; a new lookup waits for it rather than loading the blocks again.
    second = index.lookup(pool, hashes, 1, lock=True, now=now)
    assert isinstance(second, DeferredLookup) and len(tier.loads) == 1
    second.answer = answers.append
    (load,) = tier.loads
    for entry, view in zip(load.entries, load.views, strict=True):
        view[:] = tier.objects[entry.location]
    load.finish([True, True])
    completions.run()
    num_hits, lock_id, pages = answers[-1]
    assert num_hits == 2 and lock_id > 0
    assert [bytes(memory.view(p * PAGE, PAGE)) for p in pages[0]] == [
        b"\x01" * PAGE,
        b"\x02" * PAGE,
    ]
    # Without fetch, a lookup answers from L1 at once.
    assert index.lookup(pool, keys(1, 2, 3), 1, lock=False, now=now, fetch=False) == (2, 0, [])
    index.check_invariants()


def test_l1_eviction_keeps_a_key_whose_object_a_tier_below_holds(
    memory: SharedMemoryArena, completions: Completions
) -> None:
    first = keys(*range(NUM_PAGES))
    tier = HoldingTier({7: b"\x07" * PAGE}, {first[-1]: 7})
    index, _ = make_index(memory, completions, tier)
    pool = register(index)
    index.commit(index.reserve(pool, 0, first, now=0.0)[0])
    finish_stores(tier, completions)
    # A full L1: the next stores evict the chain's tail first (first[-1], first[-2]).
    index.commit(index.reserve(pool, 0, keys(100, 101), now=0.0)[0])
    finish_stores(tier, completions)
    assert index.stats()["evicted_objects_total"] == 2
    index.check_invariants()
    # first[-2] is gone; first[-1] stayed, as the tier's entry: a lookup fetches it.
    assert index.lookup(pool, first[-2:-1], 1, lock=False, now=0.0) == (0, 0, [])
    pending = index.lookup(pool, first[-1:], 1, lock=False, now=0.0)
    assert isinstance(pending, DeferredLookup)
    (load,) = tier.loads
    assert [entry.location for entry in load.entries] == [7]
    load.finish([False])
    pending.answer = lambda result: None
    completions.run()
    index.check_invariants()
