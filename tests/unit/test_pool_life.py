"""The pool life cycle on the index alone (kvshelf.server.pool_life), with a clock the test
moves: holders, idle and empty pools, retiring pools and their invariants. The same rules
against a real server: tests/integration/test_server_pool_life.py."""

from __future__ import annotations

import random

import pytest

from kvshelf.protocol import ErrorCode, PageLayout
from kvshelf.server import pool_life
from kvshelf.server.index import CacheIndex, RequestRejected
from kvshelf.server.limits import IndexLimits
from kvshelf.server.lower_tiers import DeferredLookup
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.reclaim import IDLE_S
from kvshelf.server.tiers.shared_memory import ExtentAllocator

PAGE = 1024
LEASE = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_index(clock: Clock, max_pools: int = 4) -> CacheIndex:
    arena = ArenaTier(ExtentAllocator(64 * PAGE), eviction_watermark=1.0, extent_bytes=4 * PAGE)
    limits = IndexLimits(min_page_bytes=1, max_pools=max_pools)
    return CacheIndex([arena], lease_timeout_s=LEASE, clock=clock, limits=limits)


def layout(model: str) -> PageLayout:
    return PageLayout(
        model_fingerprint=model, layout_fingerprint="l", page_bytes=PAGE, world_size=1, rank=0
    )


def store(index: CacheIndex, pool: str, tag: bytes, now: float) -> None:
    reservation_id, _ = index.reserve(pool, 0, [tag * 8], now=now)
    index.commit(reservation_id)


def test_a_pool_is_retired_when_its_last_holder_moves_on() -> None:
    clock = Clock()
    index = make_index(clock)
    shared = index.register(layout("w"), holder=1).name
    index.register(layout("w"), holder=2)  # a second rank (or engine) holds it too
    index.register(layout("w"), holder=2)  # registered again: still two holders
    store(index, shared, b"a", clock.now)
    index.register(layout("w@1"), retires=shared, holder=1)
    # Sent again (its reply was lost), and by a client that does not hold it: nothing more.
    index.register(layout("w@1"), retires=shared, holder=1)
    index.register(layout("x"), retires=shared, holder=3)
    assert index.lookup(shared, [b"a" * 8], 1, lock=False, now=clock.now)[0] == 1
    index.register(layout("w@2"), retires=shared, holder=2)
    assert index.lookup(shared, [b"a" * 8], 1, lock=False, now=clock.now)[0] == 0
    stats = index.stats()
    assert stats["pools"] == 3 and stats["pools_retired_total"] == 1
    assert stats["resident_objects"] == 0 and stats["allocated_bytes"] == 0
    index.check_invariants()


def test_a_pool_with_more_holders_than_counted_is_left_to_the_idle_rules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_life, "MAX_HOLDERS_PER_POOL", 2)
    clock = Clock()
    index = make_index(clock)
    shared = index.register(layout("w"), holder=1).name
    index.register(layout("w"), holder=2)
    index.register(layout("w"), holder=3)  # not counted: the pool is held for good
    store(index, shared, b"a", clock.now)
    index.register(layout("w@1"), retires=shared, holder=1)
    index.register(layout("w@2"), retires=shared, holder=2)
    assert index.lookup(shared, [b"a" * 8], 1, lock=False, now=clock.now)[0] == 1
    assert index.stats()["pools_retired_total"] == 0


def test_at_the_limit_a_pool_in_use_is_never_taken_an_empty_or_idle_one_is() -> None:
    clock = Clock()
    index = make_index(clock, max_pools=2)
    used = index.register(layout("used"), holder=1).name
    store(index, used, b"u", clock.now)
    empty = index.register(layout("empty"), holder=2).name
    clock.now += 1
    # "empty" holds no key: it goes, although "used" is the least recently used.
    index.register(layout("junk1"), holder=3)
    assert index.lookup(used, [b"u" * 8], 1, lock=False, now=clock.now)[0] == 1
    with pytest.raises(RequestRejected):
        index.reserve(empty, 0, [b"e" * 8], now=clock.now)
    junk = index.register(layout("junk1"), holder=3).name
    store(index, junk, b"j", clock.now)
    # Both pools were used within IDLE_S and hold keys: refused, nothing retired.
    with pytest.raises(RequestRejected) as info:
        index.register(layout("junk2"), holder=3)
    assert info.value.code is ErrorCode.LIMIT_EXCEEDED
    assert index.lookup(used, [b"u" * 8], 1, lock=False, now=clock.now)[0] == 1
    # Unused for IDLE_S: the least recently used goes.
    clock.now += IDLE_S + 1
    store(index, junk, b"k", clock.now)
    index.register(layout("junk2"), holder=3)
    assert index.lookup(used, [b"u" * 8], 1, lock=False, now=clock.now)[0] == 0
    index.check_invariants()


def test_retires_of_a_pool_nobody_registered_this_boot_changes_nothing() -> None:
    clock = Clock()
    index = make_index(clock)
    restored = index.register(layout("w"), restoring=True).name
    index.register(layout("w@1"), retires=restored)
    assert index.stats()["pools"] == 2 and index.stats()["pools_retired_total"] == 0


def test_an_empty_pool_unused_for_the_idle_time_is_retired_one_with_keys_is_not() -> None:
    clock = Clock()
    index = make_index(clock)
    empty = index.register(layout("empty")).name
    full = index.register(layout("full")).name
    store(index, full, b"f", clock.now)
    index.expire(clock.now + IDLE_S - 1)
    assert index.stats()["pools"] == 2
    index.expire(clock.now + IDLE_S + 1)
    assert index.stats()["pools"] == 1 and index.stats()["pools_retired_total"] == 1
    with pytest.raises(RequestRejected) as info:
        index.reserve(empty, 0, [b"e" * 8], now=clock.now)
    assert info.value.code is ErrorCode.UNKNOWN_POOL
    assert index.lookup(full, [b"f" * 8], 1, lock=False, now=clock.now)[0] == 1
    index.check_invariants()


def test_a_retiring_pool_keeps_its_locked_pages_and_is_revived_by_a_registration() -> None:
    clock = Clock()
    index = make_index(clock)
    old = index.register(layout("w"), holder=1).name
    store(index, old, b"o", clock.now)
    num_hits, lock_id, _ = index.lookup(old, [b"o" * 8], 1, lock=True, now=clock.now)
    assert num_hits == 1
    index.register(layout("w@1"), retires=old, holder=1)
    # Retiring: unknown by name, counted, its locked page still there.
    assert index.lookup(old, [b"o" * 8], 1, lock=False, now=clock.now)[0] == 0
    assert index.stats()["pools"] == 2 and index.stats()["resident_objects"] == 1
    index.check_invariants()
    # A registration of its name before it is dropped takes it back, pages and all.
    index.register(layout("w"))
    index.release(lock_id, 0)
    index.expire(clock.now + 2)
    assert index.lookup(old, [b"o" * 8], 1, lock=False, now=clock.now)[0] == 1
    assert index.stats()["pools_retired_total"] == 0
    index.check_invariants()


def test_at_the_limit_a_busy_pool_is_never_the_one_retired() -> None:
    clock = Clock()
    index = make_index(clock, max_pools=2)
    busy = index.register(layout("busy")).name
    idle = index.register(layout("idle")).name
    index.reserve(busy, 0, [b"r" * 8], now=clock.now)  # the least recently used, but reserving
    clock.now += 1
    store(index, idle, b"i", clock.now)
    clock.now += IDLE_S + 1  # in use until then
    index.register(layout("new"))
    assert index.lookup(idle, [b"i" * 8], 1, lock=False, now=clock.now)[0] == 0
    with pytest.raises(RequestRejected) as info:
        index.reserve(idle, 0, [b"i" * 8], now=clock.now)
    assert info.value.code is ErrorCode.UNKNOWN_POOL
    index.reserve(busy, 0, [b"s" * 8], now=clock.now)
    index.check_invariants()


def test_random_epochs_with_leases_keep_the_invariants() -> None:
    """Two engines reset their caches at random while reserving, committing, locking and
    releasing in their current and earlier epochs; the index stays consistent and bounded."""
    rng = random.Random(33)
    clock = Clock()
    index = make_index(clock, max_pools=3)
    holders = {"a": 1, "b": 2}
    current = {engine: index.register(layout("w"), holder=holders[engine]).name for engine in "ab"}
    epochs = dict.fromkeys("ab", 0)
    known: list[str] = list(current.values())
    reservations: list[int] = []
    locks: list[int] = []
    for _ in range(3000):
        clock.now += rng.random()
        op = rng.randrange(7)
        engine = rng.choice("ab")
        pool = current[engine] if rng.random() < 0.8 else rng.choice(known)
        hashes = [bytes([rng.randrange(12)]) * 8 for _ in range(rng.randrange(1, 4))]
        try:
            if op == 0:
                epochs[engine] += 1
                fresh = index.register(
                    layout(f"w@{engine}{epochs[engine]}"), current[engine], holders[engine]
                )
                current[engine] = fresh.name
                known.append(fresh.name)
            elif op == 1:
                reservations.append(index.reserve(pool, 0, hashes, clock.now)[0])
            elif op == 2 and reservations:
                index.commit(reservations.pop(rng.randrange(len(reservations))))
            elif op == 3:
                result = index.lookup(pool, hashes, 1, lock=True, now=clock.now)
                assert not isinstance(result, DeferredLookup)
                if result[1]:
                    locks.append(result[1])
            elif op == 4 and locks:
                index.release(locks.pop(rng.randrange(len(locks))), 0)
            else:
                index.expire(clock.now)
        except RequestRejected as exc:
            assert exc.code in (
                ErrorCode.UNKNOWN_RESERVATION,
                ErrorCode.UNKNOWN_LOCK,
                ErrorCode.UNKNOWN_POOL,
                ErrorCode.LIMIT_EXCEEDED,
            ), exc
        index.check_invariants()
        assert index.stats()["pools"] <= 3
    assert index.stats()["pools_retired_total"] > 100
