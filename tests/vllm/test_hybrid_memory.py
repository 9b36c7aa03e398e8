"""The memory vLLM's hybrid KV cache manager saves on a sliding-window model, with kvshelf.

A Gemma-3-like model (three sliding-window layers, one full) runs the same batch of long
requests in the same KV cache memory twice, both with kvshelf: with the hybrid manager, which
kvshelf now keeps on (a sliding layer holds only its window's blocks), and with it off, as
vLLM ran every kvshelf deployment before (every layer keeps every token's KV). With the
manager on, vLLM preempts fewer requests, and the outputs are the same.

Same memory: with the manager off a block holds all four layers; on, the groups overlay one
another and a block holds one layer, so the same bytes are four times as many blocks
(``num_gpu_blocks_override``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testbed.hybrid_models import build_sliding_variant
from testbed.prompts import shared_prefix_prompts
from testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine
from testbed.server import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

BLOCK = 32
WINDOW = 64
LAYERS = ["sliding_attention"] * 3 + ["full_attention"]
# Eight requests of 24 prompt blocks and 128 generated tokens, all at once.
PROMPTS = shared_prefix_prompts(8, prefix_len=0, suffix_len=24 * BLOCK, seed=5)
MAX_TOKENS = 128
# Two requests' prompts fit with every layer holding every token, not their outputs too.
BLOCKS_HMA_OFF = 52


def run(model: Path, env: dict[str, str], port: int, hma: bool) -> dict[str, Any]:
    return run_engine(
        EngineSpec(
            model=str(model),
            rounds=[PROMPTS],
            max_tokens=MAX_TOKENS,
            block_size=BLOCK,
            max_model_len=1024,
            env=env,
            kv_transfer_config=kvshelf_transfer_config(port),
            num_gpu_blocks_override=BLOCKS_HMA_OFF * (len(LAYERS) if hma else 1),
            disable_hybrid_kv_cache_manager=not hma,
        )
    )


def test_sliding_window_model_preempts_less_with_the_hybrid_manager(
    tmp_path: Path, vllm_env: dict[str, str], engine_server: ServerProcess
) -> None:
    folder = build_sliding_variant(tmp_path / "gemma3-like", LAYERS, WINDOW)

    hma_on = run(folder, vllm_env, engine_server.port, hma=True)
    hma_off = run(folder, vllm_env, engine_server.port, hma=False)
    figures = {
        name: {
            "preemptions": result["rounds"][0]["counters"]["vllm:num_preemptions"],
            "prompt_tokens_computed": result["rounds"][0]["counters"]["vllm:prompt_tokens"],
            "wall_s": round(result["rounds"][0]["wall_s"], 2),
        }
        for name, result in (("hybrid manager on", hma_on), ("hybrid manager off", hma_off))
    }
    print(f"same KV cache memory, {len(PROMPTS)} requests: {figures}")
    assert "Turning off hybrid kv cache manager" not in hma_on["output"]
    on, off = figures["hybrid manager on"], figures["hybrid manager off"]
    assert off["preemptions"] > 0
    assert on["preemptions"] < off["preemptions"]
    outputs = [[r["token_ids"] for r in res["rounds"][0]["requests"]] for res in (hma_on, hma_off)]
    assert outputs[0] == outputs[1]
