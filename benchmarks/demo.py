"""``make demo``: two vLLM engines, one kvshelf server, and what the second engine gains.

Builds a local random-weight model (cached), starts a kvshelf server, runs engine A over a few
prompts with a long shared prefix without kvshelf (every prompt a full prefill: A's TTFTs are
all recomputes), a warm-up engine with kvshelf that computes and stores them, then a fresh
engine B with kvshelf over the same prompts (it loads them), and prints a table per prompt:
prompt tokens, tokens B loaded from kvshelf, time to first token in A and in B, and whether
the outputs match. (Had engine A itself used kvshelf, its prompts after the first would have
loaded the shared prefix stored by the first, and A would not be a recompute baseline.)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace

from testbed.models import TINY, build_model
from testbed.prompts import shared_prefix_prompts
from testbed.run_engine import EngineSpec, run_engine
from testbed.server import ServerProcess

# Big enough that a 2k-token prefill takes visibly longer than a load, small enough to build
# in seconds.
DEMO_MODEL = replace(TINY, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2)
BLOCK_SIZE = 32


def run_demo(num_prompts: int, prefix_len: int, suffix_len: int) -> bool:
    """Run the demo and print its table.

    Args:
        num_prompts: prompts sharing one prefix.
        prefix_len: tokens in the shared prefix.
        suffix_len: distinct tokens after it, per prompt.

    Returns:
        Whether engine B hit on every prompt and its outputs equal engine A's, token for token.
    """
    print(f"building the demo model (cached after the first run): {DEMO_MODEL}")
    model = build_model(DEMO_MODEL)
    prompts = shared_prefix_prompts(num_prompts, prefix_len, suffix_len, seed=7)
    with ServerProcess(l1_size_gb=1.0) as server:
        print(f"kvshelf server on {server.host}:{server.port}")
        kv_transfer_config = {
            "kv_connector": "KVShelfConnector",
            "kv_connector_module_path": "kvshelf.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": server.host,
                "lmcache.mp.port": server.port,
            },
        }
        # One prompt per round, the engine's own prefix cache emptied before each: every
        # cached token of engine B then comes from kvshelf, and each TTFT is one prefill.
        spec = EngineSpec(
            model=str(model),
            rounds=[[prompt] for prompt in prompts],
            max_tokens=16,
            block_size=BLOCK_SIZE,
            max_model_len=prefix_len + suffix_len + 64,
            kv_transfer_config=kv_transfer_config,
            reset_prefix_cache_between_rounds=True,
        )
        print("engine A: no kvshelf, computes every prompt (the recompute baseline) ...")
        engine_a = run_engine(replace(spec, kv_transfer_config=None))
        assert all(r["requests"][0]["num_cached_tokens"] == 0 for r in engine_a["rounds"])
        print("warm-up engine: computes the prompts and stores their KV blocks in kvshelf ...")
        run_engine(spec)
        print("engine B: a fresh process with kvshelf, same prompts ...")
        engine_b = run_engine(spec)
        stats = server.client().stats()

    print()
    header = ("prompt", "tokens", "loaded", "TTFT A (ms)", "TTFT B (ms)", "same output")
    print(" ".join(f"{name:>12}" for name in header))
    identical = hit = True
    for index, (round_a, round_b) in enumerate(
        zip(engine_a["rounds"], engine_b["rounds"], strict=True)
    ):
        (a,) = round_a["requests"]
        (b,) = round_b["requests"]
        same = a["token_ids"] == b["token_ids"]
        identical &= same
        hit &= b["num_cached_tokens"] > 0
        row = (
            f"{index:>12} {a['prompt_len']:>12} {b['num_cached_tokens']:>12} "
            f"{a['ttft_s'] * 1e3:>12.1f} {b['ttft_s'] * 1e3:>12.1f} {'yes' if same else 'NO':>12}"
        )
        print(row)
    print()
    print(
        f"kvshelf: {stats['resident_objects']} blocks resident "
        f"({stats['resident_bytes'] / 2**20:.1f} MiB); {stats['loaded_objects_total']} pages "
        f"copied into vLLM by workers (loaded_objects_total), {stats['locked_objects_total']} "
        "locked by lookups (locked_objects_total, which includes hits vLLM did not load)"
    )
    print("outputs identical:", "yes" if identical else "NO")
    print("the fresh engine loaded every prompt's prefix from kvshelf:", "yes" if hit else "NO")
    return identical and hit


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.demo`` (``make demo``): exit status 0 when the outputs are
    identical and the fresh engine hit on every prompt."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo", description=__doc__)
    parser.add_argument("--prompts", type=int, default=4, help="prompts sharing the prefix")
    parser.add_argument("--prefix-len", type=int, default=2000, help="shared prefix tokens")
    parser.add_argument("--suffix-len", type=int, default=48, help="distinct tokens per prompt")
    args = parser.parse_args(argv)
    return 0 if run_demo(args.prompts, args.prefix_len, args.suffix_len) else 1


if __name__ == "__main__":
    sys.exit(main())
