"""kvshelf on a Gemma-3-like model (three sliding-window groups and a full one), on vLLM's real
scheduler and block pool, without a model: the window blocks lazy offload captures go back to
vLLM as soon as vLLM frees them, so vLLM schedules exactly as it does without kvshelf; and in
eager mode, a step waits for a queued store only when it reuses a block the store reads."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvshelf.client import KVShelfClient
from kvshelf.plan import LoadJob
from testbed.hybrid_models import build_sliding_variant
from testbed.prompts import shared_prefix_prompts

pytestmark = pytest.mark.vllm

BLOCK = 32
WINDOW = 64
NUM_BLOCKS = 64
LAYERS = ["sliding_attention"] * 3 + ["full_attention"]


def hybrid_scheduler(model: Path, kv_transfer_config: dict[str, Any] | None) -> Any:
    """vLLM's Scheduler with the KV cache groups its hybrid manager makes for ``model``."""
    import torch
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from testbed.vllm_scheduler import make_vllm_config, scheduler_for

    vllm_config = make_vllm_config(
        model,
        block_size=BLOCK,
        num_gpu_blocks=NUM_BLOCKS,
        max_num_batched_tokens=128,
        max_num_seqs=8,
        kv_transfer_config=kv_transfer_config,
    )
    assert not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    model_config = vllm_config.model_config
    shape = {
        "block_size": BLOCK,
        "num_kv_heads": model_config.get_num_kv_heads(vllm_config.parallel_config),
        "head_size": model_config.get_head_size(),
        "dtype": torch.float32,
    }
    specs = {
        f"model.layers.{i}.self_attn.attn": (
            SlidingWindowSpec(sliding_window=WINDOW, **shape)
            if kind == "sliding_attention"
            else FullAttentionSpec(**shape)
        )
        for i, kind in enumerate(LAYERS)
    }
    groups = get_kv_cache_groups(vllm_config, specs)
    page = specs[groups[0].layer_names[0]].page_size_bytes
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, page * NUM_BLOCKS)
    return scheduler_for(vllm_config, kv_cache_config, log_stats=False)


def trace(scheduler: Any) -> list[tuple[int, tuple[str, ...], int]]:
    """Run every request to its end; per step: vLLM's free blocks once it scheduled the step
    (the connector's plan built), the requests it scheduled, and how many it preempted."""
    from testbed.vllm_scheduler import make_request, step

    prompts = shared_prefix_prompts(8, prefix_len=2 * BLOCK, suffix_len=4 * BLOCK + 7, seed=5)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=40, block_size=BLOCK))
    pool = scheduler.kv_cache_manager.block_pool
    steps: list[tuple[int, tuple[str, ...], int]] = []

    def scheduled(output: Any) -> None:
        steps.append(
            (
                pool.get_num_free_blocks(),
                tuple(sorted(output.num_scheduled_tokens)),
                len(output.preempted_req_ids or ()),
            )
        )

    while scheduler.has_requests():
        step(scheduler, kv_connector_output=scheduled)
        assert len(steps) < 2000
    return steps


def test_lazy_offload_leaves_vllm_the_blocks_its_windows_free(tmp_path: Path) -> None:
    model = build_sliding_variant(tmp_path / "gemma3-like", LAYERS, WINDOW)
    plain = trace(hybrid_scheduler(model, None))
    # A producer stores and never looks up (no server is needed); the threshold is never met,
    # so every window block computed is captured and none is stored.
    lazy_config = {
        "kv_connector": "KVShelfConnector",
        "kv_connector_module_path": "kvshelf.vllm",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "lmcache.mp.port": 1,
            "lmcache.mp.lazy_offload": True,
            "lmcache.mp.lazy_offload_policy": "FIFO",
            "lmcache.mp.lazy_offload_threshold": 10_000,
        },
    }
    scheduler = hybrid_scheduler(model, lazy_config)
    lazy = trace(scheduler)

    # The cache is too small for all 8 requests at once: vLLM runs at most 3 while the
    # windows free blocks, and with lazy offload capturing those blocks it runs the same ones,
    # step by step. (Its free blocks may differ by a few: the captured blocks wait at the tail
    # of the free queue, so vLLM evicts its own cached blocks first, and its prefix-cache hits
    # can be shorter.)
    assert max(len(scheduled) for _, scheduled, _ in plain) == 3
    assert [s[1:] for s in lazy] == [s[1:] for s in plain]
    offloader = scheduler.connector.lazy_offloader
    assert offloader is not None
    assert offloader.snapshot()["buffered_requests"] == 8
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks[1:])


class _SlowReserveClient(KVShelfClient):
    """A real client whose reserves take a while, so that stores queue up behind the steps
    (as they do behind a GPU's forward passes)."""

    def reserve(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.02)
        return super().reserve(*args, **kwargs)

    def take_reserve(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.02)
        return super().take_reserve(*args, **kwargs)


def test_a_step_waits_for_queued_stores_only_when_it_reuses_their_blocks(tmp_path: Path) -> None:
    """vLLM's windows free blocks whose stores may still be queued, and hands them out again.
    The worker makes a step wait (``before_reuse``) only when one of its new blocks is read by
    a queued store, which is a minority of steps (before, every step of a hybrid model waited
    for every queued store and its commit), and every page still holds its block's bytes: the
    forward pass (played here: it writes each block's tokens) never overwrote a block before
    its store copied it."""
    import torch

    from kvshelf.roles.fingerprint import layout_fingerprint
    from kvshelf.roles.groups import KVGroups
    from kvshelf.roles.worker import WorkerConnector
    from kvshelf.vllm.metadata import KVShelfConnectorMetadata, KVShelfWorkerMetadata
    from testbed.server import ServerProcess
    from testbed.vllm_scheduler import make_request, step

    model = build_sliding_variant(tmp_path / "gemma3-like", LAYERS, WINDOW)
    with ServerProcess(l1_size_gb=1 / 16, extra_args=["--no-prefault"]) as server:
        config = {
            "kv_connector": "KVShelfConnector",
            "kv_connector_module_path": "kvshelf.vllm",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "lmcache.mp.host": server.host,
                "lmcache.mp.port": server.port,
            },
        }
        scheduler = hybrid_scheduler(model, config)
        kv_cache_config = scheduler.kv_cache_config
        groups = KVGroups.from_kv_cache_config(kv_cache_config)
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        shape = (NUM_BLOCKS, spec.num_kv_heads, BLOCK, 2 * spec.head_size)
        kv_caches = {
            name: torch.zeros(shape)
            for group in kv_cache_config.kv_cache_groups
            for name in group.layer_names
        }
        worker = WorkerConnector(
            client_factory=lambda: _SlowReserveClient(server.host, server.port, timeout_s=5.0),
            model_fingerprint=scheduler.connector.model_fingerprint,
            layout_fingerprint=layout_fingerprint(scheduler.vllm_config, kv_cache_config),
            rank=0,
            world_size=1,
            retry_interval_s=0.1,
        )
        worker.register_kv_caches(kv_caches, NUM_BLOCKS)
        expected: dict[bytes, float] = {}
        waits: list[bool] = []

        def value(key: bytes) -> float:
            return float(int.from_bytes(key[:3], "little") + 1)

        def run_worker(output: Any) -> Any:
            from vllm.v1.outputs import KVConnectorOutput

            metadata = output.kv_connector_metadata
            assert isinstance(metadata, KVShelfConnectorMetadata)
            plan = metadata.plan
            waits.append(worker.before_reuse(plan.new_blocks, plan.loads))
            worker.await_delayed_free(plan.delayed_free)
            # The forward pass: each scheduled token's block is written; a block it fills
            # gets its final bytes, one a function of its server key.
            for req_id, num_tokens in output.num_scheduled_tokens.items():
                request = scheduler.requests[req_id]
                end = request.num_computed_tokens
                start = end - num_tokens
                block_ids = scheduler.kv_cache_manager.get_block_ids(req_id)
                for group, ids in enumerate(block_ids):
                    for i in range(start // BLOCK, min(-(-end // BLOCK), len(ids))):
                        if ids[i] == 0:  # vLLM's null block: outside the window
                            continue
                        full = (i + 1) * BLOCK <= end and i < len(request.block_hashes)
                        key = groups.key(group, request.block_hashes[i]) if full else b""
                        for layer in kv_caches.values():
                            layer[ids[i]] = value(key) if full else -1.0
            worker.finish_loads()
            worker.submit_stores(plan.stores, plan.identity_epoch)
            for job in plan.stores:
                for key in job.block_hashes:
                    expected[key] = value(key)
            completed = worker.take_completed()
            return KVConnectorOutput(
                finished_sending=worker.finished_sending() or None,
                invalid_block_ids=worker.take_load_errors(),
                kv_connector_worker_meta=KVShelfWorkerMetadata(completed) if completed else None,
            )

        try:
            prompts = shared_prefix_prompts(
                8, prefix_len=2 * BLOCK, suffix_len=4 * BLOCK + 7, seed=5
            )
            for i, prompt in enumerate(prompts):
                scheduler.add_request(
                    make_request(f"r{i}", prompt, max_tokens=40, block_size=BLOCK)
                )
            # Steps without a forward pass take microseconds: thousands of them pass while
            # the slow reserves run, so the bound on a hang is time, not a step count.
            deadline = time.monotonic() + 60.0
            while scheduler.has_requests():
                step(scheduler, kv_connector_output=run_worker)
                assert time.monotonic() < deadline, f"requests left after {len(waits)} steps"
            worker.flush_stores()
            assert worker.counters["stores_dropped"] == 0
            # Every page holds its block's final bytes: one at a time into scratch block 1
            # (the pool is empty now).
            with server.client() as client:
                for key, want in expected.items():
                    hit = client.lookup(worker.pool, [key], world_size=1, lock=True)
                    assert hit.num_hit_blocks == 1, key
                    load = LoadJob("check", (1,), (tuple(hit.pages[0]),), hit.lock_id, hit.boot_id)
                    worker.start_loads([load])
                    worker.finish_loads()
                    assert worker.take_load_errors() == set()
                    for name, layer in kv_caches.items():
                        assert torch.all(layer[1] == want), (name, key)
            # Some steps reused a block a queued store read, and waited; most did not.
            assert 0 < sum(waits) < len(waits) / 2, (sum(waits), len(waits))
            assert worker.counters["store_reuse_waits"] == sum(waits)
        finally:
            worker.shutdown()
            scheduler.shutdown()
