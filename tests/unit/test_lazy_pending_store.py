"""LazyOffloadPendingStore: hashes read at buffering time, select count."""

from __future__ import annotations

import pytest

from kvshelf.lazy.block_pool_view import VllmBlockPoolView
from kvshelf.lazy.pending_store import LazyOffloadPendingStore
from kvshelf.lazy.policies.fifo import FIFOOffloadPolicy
from kvshelf.plan import StoreJob


class HashOnlyPool:
    """A block pool view that only answers hashes; the pending store must not touch or free."""

    def __init__(self) -> None:
        self.hashes: dict[int, object] = {}

    def block_hash(self, block_id: int) -> object | None:
        return self.hashes.get(block_id)

    def touch(self, block_ids) -> None:
        raise AssertionError("the pending store never protects blocks")

    def free(self, block_ids) -> None:
        raise AssertionError("the pending store never frees blocks")


def store(request_id: str, block_ids: tuple[int, ...], first_block: int = 0) -> StoreJob:
    hashes = tuple(f"{request_id}:{first_block + i}".encode() for i in range(len(block_ids)))
    return StoreJob(request_id, block_ids, hashes, first_block)


def make_store(threshold: int, select_count: int) -> tuple[LazyOffloadPendingStore, HashOnlyPool]:
    pool = HashOnlyPool()
    return LazyOffloadPendingStore(FIFOOffloadPolicy(threshold), select_count, pool), pool


def test_add_keeps_the_hashes_the_pool_held_at_buffering_time() -> None:
    pending, pool = make_store(1, 10)
    pool.hashes.update({3: b"h3", 4: b"h4"})
    pending.add(store("a", (3, 4, 5)))
    # Later changes in the pool do not alter what was buffered.
    pool.hashes.update({3: b"other", 5: b"h5"})
    pending.add(store("a", (5,), first_block=3))
    pending.mark_req_finished("a")
    (item,) = pending.pop_items_for_offload()
    assert [hashes for _, hashes in item.entries] == [(b"h3", b"h4", None), (b"h5",)]


def test_pop_selects_at_most_select_count() -> None:
    pending, _ = make_store(1, 2)
    for i in range(5):
        pending.add(store(f"r{i}", (i,)))
        pending.mark_req_finished(f"r{i}")
    sizes = [len(pending.pop_items_for_offload()) for _ in range(4)]
    assert sizes == [2, 2, 1, 0]


def test_threshold_20_select_10_article_example() -> None:
    pending, _ = make_store(20, 10)
    for i in range(20):
        pending.add(store(f"r{i}", (i,)))
        pending.mark_req_finished(f"r{i}")
    first = pending.pop_items_for_offload()
    assert [item.request_id for item in first] == [f"r{i}" for i in range(10)]
    assert pending.policy.num_ready == 10
    assert pending.pop_items_for_offload() == []
    for i in range(20, 30):
        pending.add(store(f"r{i}", (i,)))
        pending.mark_req_finished(f"r{i}")
    second = pending.pop_items_for_offload()
    assert [item.request_id for item in second] == [f"r{i}" for i in range(10, 20)]


def test_mark_finished_of_unknown_request_does_not_raise() -> None:
    pending, _ = make_store(1, 10)
    assert pending.mark_req_finished("short-or-aborted") is False
    assert pending.pop_items_for_offload() == []


@pytest.mark.parametrize("bad", [0, -1, True, 3.0, "10"])
def test_select_count_must_be_positive_int_naming_the_key(bad) -> None:
    with pytest.raises(ValueError, match=r"lmcache\.mp\.lazy_offload_select_count"):
        LazyOffloadPendingStore(FIFOOffloadPolicy(1), bad, HashOnlyPool())


def test_vllm_view_reads_and_protects_real_block_pool() -> None:
    block_pool = pytest.importorskip("vllm.v1.core.block_pool")
    pool = block_pool.BlockPool(8, enable_caching=True, hash_block_size=16)
    view = VllmBlockPoolView(pool)
    free_before = pool.get_num_free_blocks()
    assert view.block_hash(3) is None
    pool.blocks[3]._block_hash = b"abc"
    assert view.block_hash(3) == b"abc"
    view.touch([3, 4])
    assert (pool.blocks[3].ref_cnt, pool.blocks[4].ref_cnt) == (1, 1)
    assert pool.get_num_free_blocks() == free_before - 2
    view.free([4, 3])
    assert (pool.blocks[3].ref_cnt, pool.blocks[4].ref_cnt) == (0, 0)
    assert pool.get_num_free_blocks() == free_before
