"""What ``make bench-lazy`` runs: the offload modes it compares and `ReplayConfig`.

Plain data: starts nothing, imports neither torch nor vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvshelf.connector_config import (
    LAZY_OFFLOAD,
    LAZY_OFFLOAD_POLICY,
    LAZY_OFFLOAD_SELECT_COUNT,
    LAZY_OFFLOAD_THRESHOLD,
)
from kvshelf.lazy.policies import registry as lazy_policies

EVICTION_AWARE = "EVICTION_AWARE"

MODES: dict[str, dict[str, Any] | None] = {
    "none": None,
    "eager": {},
    "fifo-100": {
        LAZY_OFFLOAD: True,
        LAZY_OFFLOAD_POLICY: "FIFO",
        LAZY_OFFLOAD_THRESHOLD: 100,
        LAZY_OFFLOAD_SELECT_COUNT: 10,
    },
    "fifo-20": {
        LAZY_OFFLOAD: True,
        LAZY_OFFLOAD_POLICY: "FIFO",
        LAZY_OFFLOAD_THRESHOLD: 20,
        LAZY_OFFLOAD_SELECT_COUNT: 10,
    },
    # The policy's own defaults for everything but its name.
    "eviction-aware": {LAZY_OFFLOAD: True, LAZY_OFFLOAD_POLICY: EVICTION_AWARE},
}
"""Mode name -> ``kv_connector_extra_config`` (host and port added per run); None: no
connector."""


@dataclass(frozen=True)
class ReplayConfig:
    """What `benchmarks.replay.run.run_replay` runs.

    Attributes:
        workloads: workload names, from ``WORKLOADS``.
        concurrencies: sessions with a request in flight, one run each.
        modes: mode names, from ``MODES``.
        turns: turns per session; each session runs at least ``min_requests / concurrency``
            turns, so that low concurrencies still replay enough requests for a threshold of
            100 finished requests to matter.
        min_requests: see ``turns``.
        warmup_turns: each session's first turns, left out of the hit rates (not the plot).
        gpu_blocks_per_session: vLLM's KV cache size, in blocks per session (plus the null
            block); below the sessions' history sizes, so vLLM must evict its prefix cache.
        block_size: tokens per block.
        max_num_batched_tokens: vLLM's token budget per step.
        max_model_len: longest prompt plus output; a longer conversation starts over.
        seed: seed of every workload and of the sampled tokens.
        l1_size_gb: each server's arena; large enough that the server evicts nothing.
        step_limit: per run; exceeding it is an error (a stuck scheduler).
    """

    workloads: tuple[str, ...] = ("chat", "agent", "unique")
    concurrencies: tuple[int, ...] = (8, 32, 64)
    modes: tuple[str, ...] = tuple(MODES)
    turns: int = 24
    min_requests: int = 1536
    warmup_turns: int = 2
    gpu_blocks_per_session: int = 16
    block_size: int = 16
    max_num_batched_tokens: int = 1024
    max_model_len: int = 1024
    seed: int = 0
    l1_size_gb: float = 1.0
    step_limit: int = 1_000_000

    def turns_per_session(self, concurrency: int) -> int:
        """Turns each session runs at ``concurrency``."""
        return max(self.turns, math.ceil(self.min_requests / concurrency))


QUICK = ReplayConfig(
    concurrencies=(8,),
    turns=5,
    min_requests=0,
    warmup_turns=2,
    gpu_blocks_per_session=8,
    max_model_len=512,
    l1_size_gb=0.25,
)
"""The smoke configuration (``--quick``): one low concurrency, a few turns, short contexts."""


def available_modes(modes: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``modes`` into those that can run and those whose policy does not exist yet.

    Returns:
        (runnable modes, notes on the modes left out).
    """
    runnable: list[str] = []
    notes: list[str] = []
    for mode in modes:
        extra = MODES[mode]
        policy = (extra or {}).get(LAZY_OFFLOAD_POLICY)
        if policy is not None and policy not in lazy_policies.POLICIES:
            notes.append(
                f"mode {mode} not run: lazy offload policy {policy} is not implemented yet "
                f"(kvshelf.lazy.policies.registry.POLICIES has {sorted(lazy_policies.POLICIES)})"
            )
        else:
            runnable.append(mode)
    return runnable, notes
