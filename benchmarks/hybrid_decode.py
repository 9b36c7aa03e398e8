"""``make bench-hybrid-decode``: what kvshelf costs a hybrid model's decode, under a stream of
concurrent requests: inter-token latency and throughput with kvshelf against without, paired
in one run.

A Gemma-3-like model (``benchmarks.hybrid``'s: 6 sliding-window layers of window 512, 2
full; 4 KV cache groups) serves ``--requests`` prompts of ``--length`` tokens that share
nothing, at most ``--concurrency`` at a time (vLLM's ``max_num_seqs``; the others wait and join
as requests finish, so prefills of new requests run beside the decodes of the others), each
generating ``--max-tokens`` tokens, after one unmeasured warm-up prompt. Every prompt is new,
so kvshelf loads nothing and stores every block each request fills: the cost measured is the
store path's (and, for a window model, the ordering of steps that reuse blocks a queued store
still reads).

Each repeat runs the same prompts on a fresh engine without a connector and on a fresh engine
with kvshelf (eager stores, its own server), in alternating order, and compares them: per
request, decode inter-token latency (last token minus first, over the tokens between); per
engine, generated tokens per second of the measured round. The result is the median over
repeats of each pair's ratio (kvshelf over none), with the target: ITL within 5% (ratio <=
1.05) and throughput within 5% (ratio >= 0.95). Outputs must be the same token for token.

Results: ``bench/results/hybrid_decode.json`` (``--out`` elsewhere for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.e2e.backends import engine_env
from benchmarks.e2e.config import REPO
from benchmarks.hybrid import CACHE_GIB, ENGINE_CONFIG, MODELS, WINDOW, run_bounded
from benchmarks.run_meta import run_meta
from testbed.models import default_model_cache_dir
from testbed.prompts import random_tokens, shared_prefix_prompts
from testbed.run_engine import EngineSpec, kvshelf_transfer_config
from testbed.server import ServerProcess

MODEL = "gemma3-like-h1024-6sw2full"
TARGET_RATIO = 1.05
"""kvshelf's decode ITL at most this times vLLM's alone, and its throughput at least the
inverse (within 5%)."""
MODES = ("vllm", "kvshelf")


def decode_itl_s(request: dict[str, Any], max_tokens: int) -> float:
    """A request's mean inter-token latency after its first token."""
    return (request["e2e_s"] - request["ttft_s"]) / (max_tokens - 1)


def summarize(result: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """One engine's measured round (the last; the first is the warm-up): decode ITL median
    and p90 over requests, generated tokens per second, and the outputs."""
    measured = result["rounds"][-1]
    requests = measured["requests"]
    itls = sorted(decode_itl_s(r, max_tokens) for r in requests)
    return {
        "itl_ms_median": 1000 * statistics.median(itls),
        "itl_ms_p90": 1000 * itls[min(len(itls) - 1, int(0.9 * len(itls)))],
        "tokens_per_s": len(requests) * max_tokens / measured["wall_s"],
        "outputs": [r["token_ids"] for r in requests],
    }


def compare(pairs: Sequence[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The median over repeats of each pair's kvshelf-over-vLLM ratios, and the targets."""
    itl = statistics.median(
        p["kvshelf"]["itl_ms_median"] / p["vllm"]["itl_ms_median"] for p in pairs
    )
    throughput = statistics.median(
        p["kvshelf"]["tokens_per_s"] / p["vllm"]["tokens_per_s"] for p in pairs
    )
    return {
        "itl_ratio": itl,
        "throughput_ratio": throughput,
        "itl_within_target": itl <= TARGET_RATIO,
        "throughput_within_target": throughput >= 1 / TARGET_RATIO,
        "same_outputs": all(p["kvshelf"]["outputs"] == p["vllm"]["outputs"] for p in pairs),
    }


def _run(mode: str, base: EngineSpec, max_tokens: int) -> dict[str, Any]:
    if mode == "vllm":
        return summarize(run_bounded(base, sys.executable), max_tokens)
    with ServerProcess(l1_size_gb=CACHE_GIB) as server:
        server.wait_zeroed()
        spec = replace(base, kv_transfer_config=kvshelf_transfer_config(server.port))
        return summarize(run_bounded(spec, sys.executable), max_tokens)


def measure(args: argparse.Namespace) -> list[dict[str, dict[str, Any]]]:
    """Every repeat's pair of engines, on the same prompts."""
    model = MODELS[MODEL]
    folder = model.build(default_model_cache_dir() / f"{MODEL}-w{WINDOW}")
    prompts = shared_prefix_prompts(args.requests, prefix_len=0, suffix_len=args.length, seed=13)
    warmup = random_tokens(args.length, seed="hybrid-decode-warmup")
    pairs = []
    with tempfile.TemporaryDirectory(prefix="kvshelf-hybrid-decode-") as scratch:
        base = EngineSpec(
            model=str(folder),
            rounds=[[warmup], prompts],
            max_tokens=args.max_tokens,
            block_size=model.attention_block,
            max_model_len=args.length + args.max_tokens + model.attention_block,
            max_num_seqs=args.concurrency,
            dtype=model.dtype,
            env=engine_env(ENGINE_CONFIG, Path(scratch)),
        )
        for repeat in range(args.repeats):
            # Alternate which engine goes first, so that drift on the machine cancels out.
            order = MODES if repeat % 2 == 0 else MODES[::-1]
            pair = {}
            for mode in order:
                print(f"repeat {repeat + 1}/{args.repeats}: {mode}", flush=True)
                pair[mode] = _run(mode, base, args.max_tokens)
            pairs.append(pair)
    return pairs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hybrid_decode", description=__doc__)
    parser.add_argument("--length", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated each")
    parser.add_argument("--requests", type=int, default=32, help="prompts in the stream")
    parser.add_argument("--concurrency", type=int, default=8, help="requests at once")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of engines")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    if args.max_tokens < 2:
        parser.error("--max-tokens must be at least 2 (a decode needs a second token)")
    for name in ("length", "requests", "concurrency", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    started = time.time()
    pairs = measure(args)
    summary = compare(pairs)
    document = {
        "meta": {
            **run_meta("benchmarks.hybrid_decode", started),
            "model": MODEL,
            "length": args.length,
            "max_tokens": args.max_tokens,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "repeats": args.repeats,
            "engine_env": engine_env(ENGINE_CONFIG, Path("$TMP")),
        },
        "pairs": [
            {mode: {k: v for k, v in run.items() if k != "outputs"} for mode, run in p.items()}
            for p in pairs
        ],
        "summary": summary,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "hybrid_decode.json"
    path.write_text(json.dumps(document, indent=1) + "\n")
    for index, pair in enumerate(pairs):
        for mode in MODES:
            run = pair[mode]
            print(
                f"repeat {index + 1} {mode:8} ITL median {run['itl_ms_median']:7.2f} ms "
                f"p90 {run['itl_ms_p90']:7.2f} ms  {run['tokens_per_s']:8.1f} tokens/s"
            )
    print(
        f"kvshelf / vLLM: ITL {summary['itl_ratio']:.3f} (target <= {TARGET_RATIO}), "
        f"throughput {summary['throughput_ratio']:.3f} (target >= {1 / TARGET_RATIO:.3f}), "
        f"same outputs {summary['same_outputs']}; wrote {path}"
    )
    return 0 if summary["same_outputs"] else 1


if __name__ == "__main__":
    sys.exit(main())
