"""Lazy offload on a Gemma-3-like model (three sliding-window groups and a full one), on vLLM's
real scheduler and block pool, without a model: the window blocks lazy offload captures go back
to vLLM as soon as vLLM frees them, so vLLM schedules exactly as it does without kvshelf."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvshelf.testbed.hybrid_models import build_sliding_variant
from kvshelf.testbed.prompts import shared_prefix_prompts

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

    from kvshelf.testbed.scheduler import make_vllm_config, scheduler_for

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
    from kvshelf.testbed.scheduler import make_request, step

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
