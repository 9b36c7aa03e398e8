"""``make bench-hybrid``: time to first token of a kvshelf hit against a recompute, on models
vLLM runs with its hybrid KV cache manager.

For each model: a kvshelf server, engine A with kvshelf over prompts of ``--length`` tokens
that share nothing (each is a full prefill, stored as it is computed: A's TTFTs are
recomputes), then a fresh engine B with kvshelf over the same prompts (each loads all its full
blocks; its prefix cache is reset between prompts, so every hit is kvshelf's). Prompts run one
at a time. It prints per model the median TTFT of each engine, their ratio, and whether B's
outputs equal A's, all measured in this one run.

Models (random weights, built locally once): a Gemma-3-like model (the ``PERF`` Llama's width,
6 sliding-window layers of window 512 and 2 full layers; vLLM's hybrid manager on makes 4 KV
cache groups of 2 layers) and an all-sliding Mistral-like one (8 sliding layers). State-space
hybrids are not cached by kvshelf (docs/hybrid-models.md), so they have no row. LMCache's MP
connector is not run here: its rows belong to ``make bench-e2e``, whose model set has no hybrid
model yet.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from kvshelf.testbed.hybrid_models import build_sliding_variant
from kvshelf.testbed.models import PERF, default_model_cache_dir
from kvshelf.testbed.prompts import shared_prefix_prompts
from kvshelf.testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine
from kvshelf.testbed.server import ServerProcess

BLOCK_SIZE = 32
WINDOW = 512
MODELS = {
    "gemma3-like-h1024-6sw2full": (["sliding_attention"] * 3 + ["full_attention"]) * 2,
    "mistral-like-h1024-8sw": ["sliding_attention"] * 8,
}


def _model(name: str, cache: Path) -> Path:
    return build_sliding_variant(cache / f"{name}-w{WINDOW}", MODELS[name], WINDOW, spec=PERF)


def measure(name: str, length: int, num_prompts: int, cache: Path) -> dict[str, object]:
    """Engine A (recompute, stores) then engine B (hits) on one model; their TTFTs."""
    model = _model(name, cache)
    prompts = shared_prefix_prompts(num_prompts, prefix_len=0, suffix_len=length, seed=11)
    with ServerProcess(l1_size_gb=1.0) as server:
        spec = EngineSpec(
            model=str(model),
            rounds=[[prompt] for prompt in prompts],
            max_tokens=4,
            block_size=BLOCK_SIZE,
            max_model_len=length + 64,
            kv_transfer_config=kvshelf_transfer_config(server.port),
            reset_prefix_cache_between_rounds=True,
        )
        engine_a = run_engine(spec)
        engine_b = run_engine(spec)
    ttft_a = [r["requests"][0]["ttft_s"] for r in engine_a["rounds"]]
    ttft_b = [r["requests"][0]["ttft_s"] for r in engine_b["rounds"]]
    hits = [r["counters"]["vllm:external_prefix_cache_hits"] for r in engine_b["rounds"]]
    same = [r["requests"][0]["token_ids"] for r in engine_a["rounds"]] == [
        r["requests"][0]["token_ids"] for r in engine_b["rounds"]
    ]
    return {
        "model": name,
        "prompt_tokens": length,
        "hit_tokens_median": statistics.median(hits),
        "recompute_ttft_ms": 1000 * statistics.median(ttft_a),
        "hit_ttft_ms": 1000 * statistics.median(ttft_b),
        "hit_vs_recompute": statistics.median(ttft_b) / statistics.median(ttft_a),
        "hybrid_manager_on": "Turning off hybrid kv cache manager" not in engine_b["output"],
        "same_outputs": same,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvshelf.bench.hybrid", description=__doc__)
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per engine")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    args = parser.parse_args(argv)
    cache = default_model_cache_dir()
    print(
        f"{'model':32} {'tokens':>6} {'hit':>6} {'recompute ms':>12} {'hit ms':>8} "
        f"{'ratio':>6} {'HMA':>4} same"
    )
    ok = True
    for name in args.models.split(","):
        row = measure(name, args.length, args.prompts, cache)
        ok = ok and bool(row["same_outputs"]) and bool(row["hybrid_manager_on"])
        print(
            f"{row['model']:32} {row['prompt_tokens']:>6} {row['hit_tokens_median']:>6.0f} "
            f"{row['recompute_ttft_ms']:>12.1f} {row['hit_ttft_ms']:>8.1f} "
            f"{row['hit_vs_recompute']:>6.3f} {'on' if row['hybrid_manager_on'] else 'off':>4} "
            f"{row['same_outputs']}",
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
