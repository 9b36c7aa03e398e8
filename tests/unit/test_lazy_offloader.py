"""LazyOffloader against vLLM's real BlockPool (the lazy package itself never imports vLLM)."""

from __future__ import annotations

import hashlib
import logging
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from kvshelf.connector_config import LazyOffloadConfig
from kvshelf.lazy.block_pool_view import VllmBlockPoolView
from kvshelf.lazy.offloader import LazyOffloader
from kvshelf.plan import StoreJob

block_pool_module = pytest.importorskip("vllm.v1.core.block_pool")

BLOCK_SIZE = 16
MISMATCH = "Part block hashes mismatch for request %s, skip it"


def block_hash(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def pool_key(request_hash: bytes) -> bytes:
    """The pool's hash of a block cached for KV cache group 0."""
    return request_hash + (0).to_bytes(4, "big")


class MiniScheduler:
    """Drives the real BlockPool the way vLLM's scheduler does, for a handful of requests."""

    def __init__(self, num_blocks: int) -> None:
        self.pool = block_pool_module.BlockPool(
            num_blocks, enable_caching=True, hash_block_size=BLOCK_SIZE
        )
        self.blocks: dict[str, list] = {}
        self.hashes: dict[str, list[bytes]] = {}

    def start(self, request_id: str, prefix: list[bytes] = ()) -> int:
        """Admit a request, touching the longest cached prefix of ``prefix``; return its hits."""
        self.blocks[request_id] = []
        self.hashes[request_id] = []
        for request_hash in prefix:
            hit = self.pool.get_cached_block(request_hash, [0])
            if hit is None:
                break
            self.pool.touch(hit)
            self.blocks[request_id].append(hit[0])
            self.hashes[request_id].append(request_hash)
        return len(self.blocks[request_id])

    def compute(self, request_id: str, hashes: list[bytes]) -> StoreJob:
        """Allocate, fill and cache new full blocks; return the store work for them."""
        blocks, known = self.blocks[request_id], self.hashes[request_id]
        first = len(blocks)
        new = self.pool.get_new_blocks(len(hashes))
        blocks.extend(new)
        known.extend(hashes)
        self.pool.cache_full_blocks(
            SimpleNamespace(block_hashes=known), blocks, first, len(blocks), BLOCK_SIZE, 0
        )
        return StoreJob(request_id, tuple(b.block_id for b in new), tuple(hashes), first)

    def finish(self, request_id: str) -> None:
        del self.hashes[request_id]
        # vLLM frees a request's blocks tail first, so the prefix stays cached longest.
        self.pool.free_blocks(reversed(self.blocks.pop(request_id)))

    def ref_counts(self) -> list[int]:
        return [block.ref_cnt for block in self.pool.blocks]

    def free_ids(self) -> set[int]:
        return {block.block_id for block in self.pool.free_block_queue.get_all_free_blocks()}


def make_offloader(
    sched: MiniScheduler, threshold: int = 1, select_count: int = 10
) -> LazyOffloader:
    config = LazyOffloadConfig(
        enabled=True, policy="FIFO", threshold=threshold, select_count=select_count
    )
    return LazyOffloader(config, VllmBlockPoolView(sched.pool))


def chunk_hashes(request_id: str, first: int, count: int) -> list[bytes]:
    return [block_hash(f"{request_id}:{i}") for i in range(first, first + count)]


def run_finished_request(
    sched: MiniScheduler, offloader: LazyOffloader, request_id: str, chunks: list[int]
) -> list[StoreJob]:
    """A request computed in ``chunks`` (blocks per step), buffered, then finished."""
    sched.start(request_id)
    stores, first = [], 0
    for count in chunks:
        stores.append(sched.compute(request_id, chunk_hashes(request_id, first, count)))
        offloader.add(stores[-1])
        first += count
    sched.finish(request_id)
    assert offloader.request_finished(request_id)
    return stores


def mismatch_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.msg == MISMATCH
    ]


def test_drain_on_step_without_scheduled_tokens_does_nothing() -> None:
    sched = MiniScheduler(16)
    offloader = make_offloader(sched)
    stores = run_finished_request(sched, offloader, "a", [3])
    baseline, free = sched.ref_counts(), sched.free_ids()
    assert offloader.drain(0) == []
    assert offloader.drain(-1) == []
    assert sched.ref_counts() == baseline
    assert sched.free_ids() == free
    assert offloader.snapshot()["ready_requests"] == 1
    assert offloader.snapshot()["drains"] == 0
    # The buffered work waits for the next real step.
    assert offloader.drain(1) == stores


def test_drain_below_threshold_protects_nothing() -> None:
    sched = MiniScheduler(16)
    offloader = make_offloader(sched, threshold=2)
    run_finished_request(sched, offloader, "a", [2])
    baseline = sched.ref_counts()
    assert offloader.drain(64) == []
    assert sched.ref_counts() == baseline
    run_finished_request(sched, offloader, "b", [2])
    assert [s.request_id for s in offloader.drain(64)] == ["a", "b"]


def test_matching_hashes_are_protected_and_returned() -> None:
    sched = MiniScheduler(16)
    offloader = make_offloader(sched)
    stores = run_finished_request(sched, offloader, "a", [2, 2])
    block_ids = [b for s in stores for b in s.block_ids]
    baseline, num_free = sched.ref_counts(), sched.pool.get_num_free_blocks()
    assert set(block_ids) <= sched.free_ids()

    assert offloader.drain(8) == stores

    after = sched.ref_counts()
    for block_id in block_ids:
        assert after[block_id] == baseline[block_id] + 1
    assert sum(after) - sum(baseline) == len(block_ids)
    assert not set(block_ids) & sched.free_ids()
    assert sched.pool.get_num_free_blocks() == num_free - len(block_ids)
    stats = offloader.snapshot()
    assert (stats["drains"], stats["requests_submitted"], stats["blocks_submitted"]) == (1, 1, 4)
    assert (stats["blocks_protected"], stats["ready_requests"], stats["buffered_requests"]) == (
        4,
        0,
        0,
    )


def test_blocks_still_used_by_a_running_request_get_one_more_reference() -> None:
    sched = MiniScheduler(16)
    offloader = make_offloader(sched)
    stores = run_finished_request(sched, offloader, "a", [3])
    # "b" shares a's prefix and is still running: those blocks stay at ref count 1.
    assert sched.start("b", chunk_hashes("a", 0, 3)) == 3
    baseline = sched.ref_counts()
    assert offloader.drain(1) == stores
    for block_id in stores[0].block_ids:
        assert sched.ref_counts()[block_id] == baseline[block_id] + 1 == 2
    assert offloader.store_completed("a") == 3
    assert sched.ref_counts() == baseline


def reuse_held(sched: MiniScheduler) -> None:
    sched.start("new")
    sched.blocks["new"] = sched.pool.get_new_blocks(3)


def reuse_freed(sched: MiniScheduler) -> None:
    sched.pool.free_blocks(sched.pool.get_new_blocks(3))


def reuse_rehashed(sched: MiniScheduler) -> None:
    sched.start("new")
    sched.compute("new", chunk_hashes("new", 0, 3))


def reuse_evicted_from_prefix_cache(sched: MiniScheduler) -> None:
    sched.pool.evict_blocks({sched.pool.free_block_queue.get_all_free_blocks()[2].block_id})


@pytest.mark.parametrize(
    "reuse", [reuse_held, reuse_freed, reuse_rehashed, reuse_evicted_from_prefix_cache]
)
def test_block_reused_before_drain_skips_rest_of_request(
    reuse, caplog: pytest.LogCaptureFixture
) -> None:
    # Exactly the 6 blocks of "a" are usable, so the free queue is a's blocks tail first:
    # reusing the three at its head breaks chunk 2 (blocks 2, 3) from block 3 on, and chunk 3.
    sched = MiniScheduler(7)
    offloader = make_offloader(sched)
    stores = run_finished_request(sched, offloader, "a", [2, 2, 2])
    reuse(sched)
    baseline = sched.ref_counts()
    broken = stores[1].block_ids[1]
    assert sched.pool.blocks[broken].block_hash != pool_key(stores[1].block_hashes[1])

    with caplog.at_level(logging.WARNING, logger="kvshelf.lazy"):
        submitted = offloader.drain(1)

    assert submitted == stores[:1]
    assert mismatch_messages(caplog) == ["Part block hashes mismatch for request a, skip it"]
    after = sched.ref_counts()
    for block_id in stores[0].block_ids:
        assert after[block_id] == baseline[block_id] + 1
    for store in stores[1:]:
        for block_id in store.block_ids:
            assert after[block_id] == baseline[block_id]
    stats = offloader.snapshot()
    assert (stats["requests_submitted"], stats["requests_skipped_hash_mismatch"]) == (1, 1)
    assert (stats["blocks_submitted"], stats["blocks_protected"]) == (2, 2)
    assert offloader.store_completed("a") == 2
    assert sched.ref_counts() == baseline


def test_mismatch_in_first_chunk_submits_nothing_of_that_request_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sched = MiniScheduler(32)
    offloader = make_offloader(sched, threshold=2)
    stale = run_finished_request(sched, offloader, "stale", [2, 2])
    good = run_finished_request(sched, offloader, "good", [2])
    sched.pool.evict_blocks({stale[0].block_ids[0]})
    baseline = sched.ref_counts()
    with caplog.at_level(logging.WARNING, logger="kvshelf.lazy"):
        assert offloader.drain(1) == good
    assert mismatch_messages(caplog) == ["Part block hashes mismatch for request stale, skip it"]
    for store in stale:
        for block_id in store.block_ids:
            assert sched.ref_counts()[block_id] == baseline[block_id]
    assert offloader.store_completed("stale") == 0


def test_block_without_hash_at_buffering_time_is_never_stored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sched = MiniScheduler(16)
    offloader = make_offloader(sched)
    # Allocated but never cached: the pool has no hash to verify the store against.
    blocks = sched.pool.get_new_blocks(2)
    ids = tuple(b.block_id for b in blocks)
    offloader.add(StoreJob("u", ids, tuple(chunk_hashes("u", 0, 2)), 0))
    sched.pool.free_blocks(blocks)
    offloader.request_finished("u")
    baseline = sched.ref_counts()
    with caplog.at_level(logging.WARNING, logger="kvshelf.lazy"):
        assert offloader.drain(1) == []
    assert mismatch_messages(caplog) == ["Part block hashes mismatch for request u, skip it"]
    assert sched.ref_counts() == baseline
    assert offloader.snapshot()["blocks_protected"] == 0


def test_store_completed_restores_baseline_and_counts_stored_blocks() -> None:
    sched = MiniScheduler(16)
    offloader = make_offloader(sched)
    stores = run_finished_request(sched, offloader, "a", [1, 3])
    baseline, free = sched.ref_counts(), sched.free_ids()
    offloader.drain(1)
    assert offloader.store_completed("a") == 4
    assert sched.ref_counts() == baseline
    assert sched.free_ids() == free
    # Protection is gone but the blocks keep their hashes: still a prefix cache hit.
    for store in stores:
        for block_id, request_hash in zip(store.block_ids, store.block_hashes, strict=True):
            assert sched.pool.blocks[block_id].block_hash == pool_key(request_hash)
    assert offloader.store_completed("a") == 0
    assert offloader.store_completed("never-seen") == 0
    stats = offloader.snapshot()
    assert (stats["lazy_blocks_stored"], stats["blocks_protected"]) == (4, 0)


def test_release_frees_protection_of_stores_that_never_complete() -> None:
    sched = MiniScheduler(32)
    offloader = make_offloader(sched, threshold=3)
    for name in ("a", "b", "c"):
        run_finished_request(sched, offloader, name, [2])
    baseline = sched.ref_counts()
    assert len(offloader.drain(1)) == 3
    assert offloader.release(["a", "unknown"]) == 2
    assert offloader.snapshot()["blocks_protected"] == 4
    assert offloader.release_all() == 4
    assert sched.ref_counts() == baseline
    assert offloader.release_all() == 0
    stats = offloader.snapshot()
    assert (stats["lazy_blocks_stored"], stats["blocks_protected"]) == (0, 0)


def test_select_count_bounds_requests_per_drain() -> None:
    sched = MiniScheduler(32)
    offloader = make_offloader(sched, threshold=1, select_count=2)
    for i in range(5):
        run_finished_request(sched, offloader, f"r{i}", [1])
    drained = [[s.request_id for s in offloader.drain(1)] for _ in range(4)]
    assert drained == [["r0", "r1"], ["r2", "r3"], ["r4"], []]
    assert offloader.snapshot()["drains"] == 3


def test_invalid_config_is_rejected_naming_the_key() -> None:
    sched = MiniScheduler(4)
    with pytest.raises(ValueError, match=r"lmcache\.mp\.lazy_offload_select_count"):
        LazyOffloader(
            LazyOffloadConfig(enabled=True, policy="FIFO", select_count=0),
            VllmBlockPoolView(sched.pool),
        )


def test_stats_as_dict_and_debug_summary(caplog: pytest.LogCaptureFixture) -> None:
    sched = MiniScheduler(16)
    offloader = make_offloader(sched, threshold=2)
    run_finished_request(sched, offloader, "a", [2])
    sched.start("b")
    offloader.add(sched.compute("b", chunk_hashes("b", 0, 1)))
    assert offloader.snapshot() == {
        "buffered_requests": 2,
        "ready_requests": 1,
        "drains": 0,
        "requests_submitted": 0,
        "requests_skipped_hash_mismatch": 0,
        "blocks_submitted": 0,
        "lazy_blocks_stored": 0,
        "blocks_protected": 0,
        "blocks_captured": 0,
        "requests_flushed": 0,
        "blocks_trimmed": 0,
    }
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kvshelf.lazy"):
        offloader.log_stats()
    (record,) = [r for r in caplog.records if r.name.startswith("kvshelf.lazy")]
    assert record.levelno == logging.DEBUG
    assert "'buffered_requests': 2" in record.getMessage()


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_leaves_every_block_at_baseline(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks, num_requests = 32, 300
    sched = MiniScheduler(num_blocks)
    offloader = make_offloader(
        sched, threshold=rng.choice([2, 5, 10]), select_count=rng.choice([1, 2, 4])
    )
    remaining: dict[str, int] = {}  # running request -> blocks still to compute
    protected: dict[str, list[int]] = {}  # request -> block ids of its stores in flight
    started = 0
    while started < num_requests or remaining:
        if started < num_requests and len(remaining) < 5 and rng.random() < 0.5:
            request_id = f"r{started}"
            started += 1
            # Requests of one "document" share a prefix, hence cached blocks.
            doc = rng.randrange(4)
            sched.start(request_id, [block_hash(f"doc{doc}:{i}") for i in range(rng.randrange(4))])
            # 0 blocks: shorter than one block, it finishes without store work.
            remaining[request_id] = rng.randrange(7)
        for request_id in list(remaining):
            count = min(remaining[request_id], rng.randint(1, 3))
            if count and sched.pool.get_num_free_blocks() >= count and rng.random() < 0.7:
                first = len(sched.blocks[request_id])
                offloader.add(sched.compute(request_id, chunk_hashes(request_id, first, count)))
                remaining[request_id] -= count
            done = remaining[request_id] == 0 and rng.random() < 0.5
            if done or rng.random() < 0.02:  # finished, or aborted mid-prefill
                del remaining[request_id]
                sched.finish(request_id)
                offloader.request_finished(request_id)

        num_scheduled_tokens = rng.choice([0, 0, 1, 64])
        for store in offloader.drain(num_scheduled_tokens):
            assert num_scheduled_tokens > 0
            # Never a block whose content changed since its store work was made.
            for block_id, request_hash in zip(store.block_ids, store.block_hashes, strict=True):
                assert sched.pool.blocks[block_id].block_hash == pool_key(request_hash)
            protected.setdefault(store.request_id, []).extend(store.block_ids)
        for request_id in list(protected):
            if rng.random() < 0.3:
                assert offloader.store_completed(request_id) == len(protected.pop(request_id))
        if rng.random() < 0.01:  # the server died: nothing in flight will complete
            assert offloader.release_all() == sum(map(len, protected.values()))
            protected.clear()

        # Each block is referenced by its running requests plus its stores in flight, no more.
        expected = Counter(b.block_id for blocks in sched.blocks.values() for b in blocks)
        expected.update(b for blocks in protected.values() for b in blocks)
        assert sched.ref_counts()[1:] == [expected[i] for i in range(1, num_blocks)]
        assert offloader.snapshot()["blocks_protected"] == sum(expected.values()) - sum(
            len(blocks) for blocks in sched.blocks.values()
        )

    stats = offloader.snapshot()
    assert stats["requests_submitted"] > 0
    assert stats["requests_skipped_hash_mismatch"] > 0
    if seed % 2:
        offloader.release_all()
    else:
        for request_id in list(protected):
            offloader.store_completed(request_id)
    assert all(block.ref_cnt == 0 for block in sched.pool.blocks[1:])
    assert sched.pool.get_num_free_blocks() == num_blocks - 1
    assert offloader.snapshot()["blocks_protected"] == 0
