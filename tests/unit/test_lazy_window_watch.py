"""Lazy offload on a model with a window group, against vLLM's real BlockPool: the window's
blocks are captured as they are computed, handed back to the tail of vLLM's free queue once
vLLM frees them, and stored only if vLLM did not hand them out again."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from test_lazy_offloader import MISMATCH, block_hash, mismatch_messages

from kvshelf.connector_config import LazyOffloadConfig
from kvshelf.lazy.block_pool_view import VllmBlockPoolView
from kvshelf.lazy.offloader import LazyOffloader
from kvshelf.plan import StoreJob

block_pool_module = pytest.importorskip("vllm.v1.core.block_pool")

BLOCK_SIZE = 16
WINDOW_GROUP, FULL_GROUP = 0, 1


class HybridRequests:
    """Drives the real BlockPool as vLLM's hybrid manager does for one window group (group 0:
    blocks that leave the window are freed while the request runs; vLLM 0.32 hashes none of
    them by default) and one full group (group 1: every block hashed, freed at the end)."""

    def __init__(self, num_blocks: int) -> None:
        self.pool = block_pool_module.BlockPool(
            num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE
        )
        self.window: dict[str, list] = {}
        self.full: dict[str, list] = {}
        self.hashes: dict[str, list[bytes]] = {}

    def compute(self, request_id: str, count: int) -> tuple[StoreJob, tuple[int, ...]]:
        """Compute ``count`` more blocks; return the store work and its window blocks."""
        window = self.window.setdefault(request_id, [])
        full = self.full.setdefault(request_id, [])
        hashes = self.hashes.setdefault(request_id, [])
        first = len(full)
        new_window = self.pool.get_new_blocks(count)
        new_full = self.pool.get_new_blocks(count)
        window.extend(new_window)
        full.extend(new_full)
        hashes.extend(block_hash(f"{request_id}:{i}") for i in range(first, first + count))
        self.pool.cache_full_blocks(
            SimpleNamespace(block_hashes=hashes), full, first, len(full), BLOCK_SIZE, FULL_GROUP
        )
        ids, keys = [], []
        for i in range(count):
            for group, block in ((WINDOW_GROUP, new_window[i]), (FULL_GROUP, new_full[i])):
                ids.append(block.block_id)
                keys.append(hashes[first + i] + bytes([group]))
        job = StoreJob(request_id, tuple(ids), tuple(keys), first)
        return job, tuple(b.block_id for b in new_window)

    def slide(self, request_id: str, keep: int) -> list[int]:
        """The window moves on: vLLM frees all but the last ``keep`` window blocks it holds."""
        window = self.window[request_id]
        freed = [b for b in window[: len(window) - keep] if not b.is_null]
        self.pool.free_blocks(freed)
        self.window[request_id] = [self.pool.null_block] * len(freed) + window[len(freed) :]
        return [b.block_id for b in freed]

    def finish(self, request_id: str) -> None:
        blocks = [b for b in self.window.pop(request_id) if not b.is_null]
        blocks += self.full.pop(request_id)
        self.pool.free_blocks(reversed(blocks))
        del self.hashes[request_id]

    def free_ids(self) -> list[int]:
        return [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]

    def at_baseline(self) -> bool:
        """Every block but the null block is free and unreferenced."""
        counts = [b.ref_cnt for b in self.pool.blocks[1:]]
        return counts == [0] * len(counts) and self.pool.get_num_free_blocks() == len(counts)


def make(requests: HybridRequests, policy: str = "FIFO", **options: object) -> LazyOffloader:
    config = LazyOffloadConfig(enabled=True, policy=policy, threshold=1, **options)
    return LazyOffloader(config, VllmBlockPoolView(requests.pool), frees_early=True)


def test_window_blocks_vllm_frees_early_join_the_free_queue_tail_and_are_stored() -> None:
    requests = HybridRequests(32)
    offloader = make(requests)
    assert not offloader.capture_on_finish
    first = requests.compute("a", 3)
    offloader.add(*first)
    assert offloader.snapshot()["blocks_captured"] == 3
    # The window leaves blocks 0 and 1: vLLM drops its reference, the capture keeps one.
    freed = requests.slide("a", keep=1)
    assert [requests.pool.blocks[b].ref_cnt for b in freed] == [1, 1]
    assert not set(freed) & set(requests.free_ids())
    second = requests.compute("a", 1)
    offloader.add(*second)
    assert offloader.drain(16) == []
    # Handed back: counted free, at the tail of the queue (evicted last), unreferenced.
    assert offloader.snapshot()["blocks_captured"] == 2
    assert requests.free_ids()[-2:] == freed
    assert [requests.pool.blocks[b].ref_cnt for b in freed] == [0, 0]
    requests.finish("a")
    offloader.request_finished("a")
    assert offloader.has_pending_work()
    stores = offloader.drain(16)
    assert stores == [first[0], second[0]]
    assert offloader.snapshot()["blocks_captured"] == 0
    # Every block of both groups is protected until the store completes.
    assert all(requests.pool.blocks[b].ref_cnt == 1 for s in stores for b in s.block_ids)
    assert offloader.store_completed("a") == 8
    assert requests.at_baseline()
    assert not offloader.has_pending_work()


def test_a_window_block_vllm_hands_out_again_is_never_stored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    requests = HybridRequests(32)
    offloader = make(requests)
    job = requests.compute("a", 3)
    offloader.add(*job)
    requests.slide("a", keep=1)
    offloader.drain(16)
    # vLLM needs every free block: it hands out the handed-back window blocks too.
    reused = requests.pool.get_new_blocks(requests.pool.get_num_free_blocks())
    requests.pool.free_blocks(reused)
    requests.finish("a")
    offloader.request_finished("a")
    with caplog.at_level(logging.WARNING, logger="kvshelf.lazy"):
        assert offloader.drain(16) == []
    assert mismatch_messages(caplog) == [MISMATCH % "a"]
    assert offloader.snapshot()["requests_skipped_hash_mismatch"] == 1
    assert requests.at_baseline()


def test_the_full_group_is_still_verified_by_its_hash() -> None:
    requests = HybridRequests(32)
    offloader = make(requests, policy="EVICTION_AWARE", max_delay_ms=600_000, eviction_window=4)
    job, window_ids = requests.compute("a", 2)
    offloader.add(job, window_ids)
    requests.finish("a")
    offloader.request_finished("a")
    # vLLM needs all free blocks but one: it evicts the full group's second block from its
    # prefix cache (freed first, tail first) and keeps the first; the window's blocks are
    # still captured.
    reused = requests.pool.get_new_blocks(requests.pool.get_num_free_blocks() - 1)
    assert requests.free_ids() == [job.block_ids[1]]
    requests.pool.free_blocks(reused)
    stores = offloader.drain(0)
    # EVICTION_AWARE stores the verified prefix: block 0 of both groups, and block 1's window
    # part, which comes before the stale full-group block.
    assert [s.block_ids for s in stores] == [job.block_ids[:3]]
    offloader.store_completed("a")
    assert requests.at_baseline()


def test_eviction_aware_stages_each_step_until_the_request_finishes() -> None:
    requests = HybridRequests(32)
    offloader = make(requests, policy="EVICTION_AWARE", max_delay_ms=600_000)
    # Made every step (a window frees blocks early), handed to the policy at the finish.
    assert not offloader.capture_on_finish
    first = requests.compute("a", 2)
    offloader.add(*first)
    requests.slide("a", keep=1)
    second = requests.compute("a", 2)
    offloader.add(*second)
    assert offloader.drain(0) == []
    assert offloader.snapshot()["buffered_requests"] == 0
    requests.finish("a")
    offloader.request_finished("a")
    assert offloader.snapshot()["buffered_requests"] == 1
    # Traffic stopped: the idle step flushes it, every block intact.
    assert offloader.drain(0) == [first[0], second[0]]
    assert offloader.store_completed("a") == 8
    assert requests.at_baseline()


def test_work_taken_unsubmitted_releases_its_captures() -> None:
    requests = HybridRequests(16)
    offloader = make(requests)
    offloader.add(*requests.compute("a", 3))
    requests.finish("a")
    offloader.request_finished("a")
    offloader.drain(0)
    assert [item.request_id for item in offloader.take_pending(["a"])] == ["a"]
    assert requests.at_baseline()
    assert not offloader.has_pending_work()


def test_a_block_handed_out_again_is_captured_for_the_request_that_reuses_it() -> None:
    requests = HybridRequests(6)
    offloader = make(requests)
    a = requests.compute("a", 2)
    offloader.add(*a)
    requests.finish("a")
    offloader.request_finished("a")
    offloader.settle()
    # vLLM hands every free block out again (a's last, as they were handed back last): a's
    # first window block to b's window group, whose capture it now is.
    others = requests.pool.get_new_blocks(3)
    b = requests.compute("b", 1)
    assert b[1] == (a[1][0],)
    offloader.add(*b)
    requests.finish("b")
    offloader.request_finished("b")
    assert offloader.drain(16) == [b[0]]
    assert offloader.snapshot()["requests_skipped_hash_mismatch"] == 1
    offloader.store_completed("b")
    requests.pool.free_blocks(others)
    assert requests.at_baseline()
