"""The EVICTION_AWARE policy and the bounded-delay flush, against vLLM's real BlockPool."""

from __future__ import annotations

import logging
import time

import pytest
from test_lazy_offloader import MiniScheduler, chunk_hashes

from kvshelf.connector_config import LazyOffloadConfig
from kvshelf.lazy.block_pool_view import VllmBlockPoolView
from kvshelf.lazy.offloader import LazyOffloader
from kvshelf.lazy.policies.eviction_aware import EvictionAwarePolicy
from kvshelf.lazy.policies.registry import create_policy
from kvshelf.plan import StoreJob

pytest.importorskip("vllm.v1.core.block_pool")


def make(
    sched: MiniScheduler,
    *,
    window: int,
    threshold: int = 100,
    select_count: int = 10,
    max_delay_ms: int | None = 600_000,
) -> LazyOffloader:
    config = LazyOffloadConfig(
        enabled=True,
        policy="EVICTION_AWARE",
        threshold=threshold,
        select_count=select_count,
        max_delay_ms=max_delay_ms,
        eviction_window=window,
    )
    return LazyOffloader(config, VllmBlockPoolView(sched.pool))


def finish(sched: MiniScheduler, offloader: LazyOffloader, request_id: str, n: int) -> StoreJob:
    """A request of ``n`` blocks, captured when it finishes (before vLLM frees its blocks)."""
    sched.start(request_id)
    store = sched.compute(request_id, chunk_hashes(request_id, 0, n))
    offloader.add(store)
    offloader.request_finished(request_id)
    sched.finish(request_id)
    return store


def test_registry_and_log_line(caplog: pytest.LogCaptureFixture) -> None:
    sched = MiniScheduler(8)
    with caplog.at_level(logging.INFO, logger="kvshelf.lazy"):
        policy = create_policy(
            "EVICTION_AWARE", 5, block_pool=VllmBlockPoolView(sched.pool), eviction_window=3
        )
    assert isinstance(policy, EvictionAwarePolicy) and policy.eviction_window == 3
    assert "EVICTION_AWARE policy, eviction window: 3 blocks" in caplog.text
    with pytest.raises(ValueError, match="block pool"):
        create_policy("EVICTION_AWARE", 5)


def test_only_blocks_near_the_head_of_the_free_queue_are_selected() -> None:
    sched = MiniScheduler(32)
    offloader = make(sched, window=4)
    finish(sched, offloader, "far", 3)
    # 28 never-used blocks stand before `far`'s blocks in the free queue.
    assert offloader.drain(1) == []
    assert offloader.snapshot()["buffered_requests"] == 1
    # Allocating 25 of them brings `far` within the window of 4.
    sched.start("filler")
    sched.compute("filler", chunk_hashes("filler", 0, 25))
    (store,) = offloader.drain(1)
    assert store.request_id == "far" and store.num_blocks == 3
    for block_id in store.block_ids:
        assert sched.pool.blocks[block_id].ref_cnt == 1
    offloader.store_completed("far")
    assert all(sched.pool.blocks[b].ref_cnt == 0 for b in store.block_ids)


def test_blocks_that_would_be_evicted_before_the_next_step_are_protected_at_finish() -> None:
    sched = MiniScheduler(12)
    offloader = make(sched, window=16)
    sched.start("busy")
    sched.compute("busy", chunk_hashes("busy", 0, 6))
    store = finish(sched, offloader, "urgent", 4)
    # The free queue (5 blocks) is shorter than the window: protected right away, so the
    # next allocation cannot take them.
    assert [sched.pool.blocks[b].ref_cnt for b in store.block_ids] == [1, 1, 1, 1]
    assert offloader.snapshot()["blocks_protected"] == 4 and offloader.has_pending_work()
    sched.start("next")
    sched.compute("next", chunk_hashes("next", 0, 1))
    (selected,) = offloader.drain(1)
    assert selected.block_ids == store.block_ids
    # One reference per block, not two: the protection taken at finish is the store's.
    assert [sched.pool.blocks[b].ref_cnt for b in store.block_ids] == [1, 1, 1, 1]
    offloader.store_completed("urgent")
    assert offloader.snapshot()["blocks_protected"] == 0
    assert all(sched.pool.blocks[b].ref_cnt == 0 for b in store.block_ids)


def test_known_stored_prefix_is_not_stored_again() -> None:
    sched = MiniScheduler(32)
    offloader = make(sched, window=64)
    first = finish(sched, offloader, "a", 3)
    offloader.drain(1)
    offloader.store_completed("a")
    # `b` repeats a's three blocks (a prefix hit) and adds two.
    sched.start("b", list(first.block_hashes))
    extra = [f"b:{i}".encode() for i in range(2)]
    tail = sched.compute("b", extra)
    whole = StoreJob(
        "b",
        first.block_ids + tail.block_ids,
        first.block_hashes + tuple(extra),
        0,
    )
    offloader.add(whole)
    offloader.request_finished("b")
    sched.finish("b")
    (store,) = offloader.drain(1)
    assert store.block_hashes == tuple(extra) and store.first_block == 3


def test_a_partly_reused_request_stores_its_valid_prefix() -> None:
    sched = MiniScheduler(16)
    offloader = make(sched, window=1, max_delay_ms=None)
    store = finish(sched, offloader, "r", 4)
    # vLLM frees tail first: the last two blocks are reused by an allocation of 2 + 9 free.
    sched.start("x")
    sched.compute("x", chunk_hashes("x", 0, 13))
    submitted = offloader.drain(1)
    assert [s.block_ids for s in submitted] == [store.block_ids[:2]]
    assert offloader.snapshot()["blocks_trimmed"] == 2
    offloader.store_completed("r")
    assert offloader.snapshot()["blocks_protected"] == 0


def test_backlog_beyond_the_threshold_is_drained_oldest_first() -> None:
    sched = MiniScheduler(64)
    offloader = make(sched, window=1, threshold=2, select_count=1)
    for name in ("a", "b", "c"):
        finish(sched, offloader, name, 1)
    assert [s.request_id for s in offloader.drain(1)] == ["a"]
    assert offloader.drain(1) == []


def test_idle_steps_flush_everything_with_the_bounded_delay_on() -> None:
    sched = MiniScheduler(64)
    offloader = make(sched, window=1, max_delay_ms=60_000)
    for name in ("a", "b"):
        finish(sched, offloader, name, 2)
    assert offloader.drain(5) == []
    assert offloader.has_pending_work()
    assert sorted(s.request_id for s in offloader.drain(0)) == ["a", "b"]
    assert offloader.snapshot()["requests_flushed"] == 2


def test_fifo_without_a_delay_never_drains_on_idle_steps() -> None:
    sched = MiniScheduler(64)
    config = LazyOffloadConfig(enabled=True, policy="FIFO", threshold=1)
    offloader = LazyOffloader(config, VllmBlockPoolView(sched.pool))
    sched.start("a")
    offloader.add(sched.compute("a", chunk_hashes("a", 0, 2)))
    sched.finish("a")
    offloader.request_finished("a")
    assert offloader.drain(0) == []
    assert not offloader.has_pending_work()
    assert [s.request_id for s in offloader.drain(3)] == ["a"]


def test_fifo_with_a_delay_flushes_due_requests_below_the_threshold() -> None:
    sched = MiniScheduler(64)
    config = LazyOffloadConfig(enabled=True, policy="FIFO", threshold=100, max_delay_ms=1)
    offloader = LazyOffloader(config, VllmBlockPoolView(sched.pool))
    sched.start("a")
    offloader.add(sched.compute("a", chunk_hashes("a", 0, 2)))
    sched.finish("a")
    offloader.request_finished("a")
    time.sleep(0.01)
    assert [s.request_id for s in offloader.drain(3)] == ["a"]
