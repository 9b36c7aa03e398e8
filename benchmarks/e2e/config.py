"""What ``make bench-e2e`` runs: its models, the cache modes it compares, `E2EConfig`.

Plain data and arithmetic on it: this module starts nothing and imports neither torch nor vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.e2e.multiround import MultiRoundQA
from testbed.models import PERF, PERF_GQA, TINY, ModelSpec

REPO = Path(__file__).resolve().parents[2]
"""The repository root: default output folder, performance page, and the engines' ``PYTHONPATH``."""
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
