"""The L1 eviction policies (kvshelf.server.policy): the seam's invariants, reuse's behaviour,
and O(1) operations."""

from __future__ import annotations

import random
import time
import tracemalloc

import pytest

from kvshelf.server.policy import POLICIES, EvictionPolicy
from kvshelf.server.policy.reuse import K_START, ReusePolicy


class Page:
    __slots__ = ("block_hash", "location", "stamp")

    def __init__(self, location: int) -> None:
        self.location = location
        self.block_hash = location.to_bytes(8, "little")
        self.stamp = 0


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_random_operations_keep_the_evictable_set(name: str) -> None:
    rng = random.Random(7)
    policy: EvictionPolicy = POLICIES[name]()
    evictable: dict[int, Page] = {}
    pinned: dict[int, Page] = {}
    next_location = 0
    for _ in range(20_000):
        op = rng.random()
        if op < 0.35 or not evictable:
            page = Page(next_location)
            next_location += 1
            policy.add(page)
            evictable[page.location] = page
        elif op < 0.55:
            policy.touch(rng.choice(list(evictable.values())))
        elif op < 0.65:
            page = evictable.pop(rng.choice(list(evictable)))
            policy.pin(page)
            pinned[page.location] = page
        elif op < 0.75 and pinned:
            page = pinned.pop(rng.choice(list(pinned)))
            policy.unpin(page)
            evictable[page.location] = page
        elif op < 0.8:
            page = evictable.pop(rng.choice(list(evictable)))
            policy.remove(page)
        elif op < 0.85:
            policy.missed(rng.randrange(next_location + 10).to_bytes(8, "little"))
        else:
            victim = policy.pop_victim()
            assert evictable.pop(victim.location) is victim
        assert len(policy) == len(evictable)
        assert all(page in policy for page in list(evictable.values())[:3])
    assert {p.location for p in policy.pages()} == set(evictable)
    assert not any(page in policy for page in pinned.values())
    policy.clear()
    assert not policy and list(policy.pages()) == []


def test_lru_evicts_the_least_recently_used() -> None:
    policy = POLICIES["lru"]()
    pages = [Page(i) for i in range(4)]
    for page in pages:
        policy.add(page)
    policy.touch(pages[0])
    policy.add_oldest(Page(9))
    assert [policy.pop_victim().location for _ in range(5)] == [9, 1, 2, 3, 0]


def test_reuse_keeps_a_reused_page_over_newer_first_use_pages() -> None:
    policy = ReusePolicy()
    chain = [Page(i) for i in range(4)]
    for page in reversed(chain):
        policy.add(page)
    for page in reversed(chain):
        policy.touch(page)  # a lookup hit the chain: now reused
    one_offs = [Page(100 + i) for i in range(8)]
    for page in one_offs:
        policy.add(page)
    victims = [policy.pop_victim().location for _ in range(6)]
    assert victims == [p.location for p in one_offs[:6]], "one-off pages go first, oldest first"


def test_a_chain_tail_goes_before_its_head() -> None:
    for name in sorted(POLICIES):
        policy = POLICIES[name]()
        chain = [Page(i) for i in range(4)]
        for page in reversed(chain):  # the arena hands a chain over deepest block first
            policy.add(page)
        assert [policy.pop_victim().location for _ in range(4)] == [3, 2, 1, 0], name


def test_reuse_lets_a_stale_reused_page_go_and_learns_k_from_the_missed_block() -> None:
    policy = ReusePolicy()
    old = Page(0)
    policy.add(old)
    policy.touch(old)
    # Far more first-use traffic than k times the reused page's age: the reused page is older
    # than k x the oldest first-use page, so it goes.
    for i in range(1, 40):
        policy.add(Page(i))
        if len(policy) > 2:
            victim = policy.pop_victim()
            if victim is old:
                break
    else:
        pytest.fail("a reused page never used again must not stay forever")
    policy.missed(old.block_hash)  # its eviction ended a lookup's prefix: keep reused longer
    assert policy.k > K_START
    policy.missed(b"never seen")
    assert policy.k > K_START


def test_reuse_a_reused_page_evicted_long_after_its_last_hit_comes_back_reused() -> None:
    # Hits of a reused page do not refresh its key in the history (a hit is a list move);
    # its eviction does, so a returning conversation's block is still known as reused.
    policy = ReusePolicy()
    kept = Page(0)
    policy.add(kept)
    policy.touch(kept)
    for location in range(1, 4):
        policy.add(Page(location))
    policy.k = 1e9  # keep the reused page until it is the last one left
    # Far more first-use keys than the history holds (HISTORY_FACTOR x peak, two generations).
    for location in range(4, 400):
        policy.add(Page(location))
        assert policy.pop_victim() is not kept
    while policy.pop_victim() is not kept:
        pass
    policy.add(Page(0))
    for location in range(1000, 1003):
        policy.add(Page(location))
    # Back as reused: the older first-use pages go before it (forgotten, it would go second).
    assert [policy.pop_victim().location for _ in range(3)] == [399, 1000, 1001]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_operations_cost_does_not_grow_with_the_pages_held(name: str) -> None:
    def cost(size: int) -> float:
        policy = POLICIES[name]()
        pages = [Page(i) for i in range(size)]
        for page in pages:
            policy.add(page)
        rng = random.Random(1)
        sample = [pages[rng.randrange(size)] for _ in range(5000)]
        started = time.perf_counter()
        for page in sample:
            policy.touch(page)
            victim = policy.pop_victim()
            policy.add(victim)
            policy.missed(page.block_hash)
        return time.perf_counter() - started

    small = min(cost(1_000) for _ in range(3))
    large = min(cost(200_000) for _ in range(3))
    # 200 x the pages: an O(n) operation would cost about 200 x; allow 10 x for noise.
    assert large < 10 * small, (small, large)


def test_reuse_a_pin_alone_does_not_make_a_page_reused() -> None:
    # A tier below writing a page behind its commit pins and unpins it: that is no reuse.
    policy = ReusePolicy()
    written, hit = Page(1), Page(2)
    policy.add(hit)
    policy.touch(hit)
    policy.add(written)
    policy.pin(written)
    policy.unpin(written)
    for location in range(3, 6):
        policy.add(Page(location))
    assert policy.pop_victim() is written


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_policy_keeps_no_more_per_page_than_it_declares(name: str) -> None:
    # The server's stated worst case adds extra_bytes_per_page to the index's own per-page
    # figure (one LRU entry, part of limits.BYTES_PER_PAGE): measure it under one-off churn,
    # the workload that fills reuse's key history.
    def held_after_churn(cls: type[EvictionPolicy], num_pages: int) -> int:
        pages = [Page(i) for i in range(num_pages)]
        tracemalloc.start()
        policy = cls()
        for p in pages:
            policy.add(p)
        for i in range(10 * num_pages):
            victim = policy.pop_victim()
            victim.block_hash = (num_pages + i).to_bytes(32, "big")
            policy.add(victim)
        held = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return held

    num_pages = 20_000
    extra = held_after_churn(POLICIES[name], num_pages) - held_after_churn(
        POLICIES["lru"], num_pages
    )
    # 16 B per page of slack: two runs of the same policy differ by allocator noise.
    assert extra <= (POLICIES[name].extra_bytes_per_page + 16) * num_pages, extra / num_pages
