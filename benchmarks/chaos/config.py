"""What ``make bench-chaos`` runs: `ChaosConfig` and the modes it hurts.

Plain data: this module starts nothing and imports neither torch nor vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from benchmarks.e2e.config import MODES, Mode
from benchmarks.e2e.multiround import MultiRoundQA

CHAOS_MODES: tuple[Mode, ...] = (MODES["kvshelf-eager"], MODES["kvshelf-lazy-ea"])
"""Eager stores, then lazy offload with the ``EVICTION_AWARE`` policy."""


def split_cpus(count: int) -> tuple[str, str]:
    """Two ``VLLM_CPU_OMP_THREADS_BIND`` lists: the first and the second half of ``count``
    CPUs (the same single CPU twice on a 1-CPU machine)."""
    if count < 2:
        return "0", "0"
    half = count // 2
    first = "0" if half == 1 else f"0-{half - 1}"
    second = str(half) if count - half == 1 else f"{half}-{count - 1}"
    return first, second


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run.

    Attributes:
        minutes: Length of the chaos phase of each mode.
        seed: Seed of the event times and kinds (the prompts have their own, ``workload.seed``).
        modes: Modes to run, each for ``minutes``.
        workload: Shape of each conversation (`MultiRoundQA`); engine A runs ``workload.users``
            of them at a time.
        pool_users: Distinct users the conversations cycle through: a user comes back every
            ``pool_users / users`` conversations, after vLLM's own cache evicted it, so its
            prefix can only come back from kvshelf.
        victim_users: Concurrent conversations on engine B (the victim).
        block_size: vLLM's KV block size.
        gpu_blocks: ``--num-gpu-blocks-override`` of each engine (small: evictions).
        cache_gib: Size of the kvshelf arena.
        lease_timeout_s: The server's ``--lease-timeout-s``.
        engine_cpus: ``VLLM_CPU_OMP_THREADS_BIND`` of engine A (and of the reference engine
            without a connector) and of engine B: two halves of the machine (`split_cpus`).
            Two engines bound to the same cores starve each other: on a 2-core machine, with
            both computing on CPU 0, the kernel ran B alone for 12 s while A's worker waited,
            runnable, in the middle of a step (seen with ``/proc`` and py-spy while the kvshelf
            server was stalled and neither engine was waiting for it).
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE`` of every engine.
        stall_seconds: The stall lengths (SIGSTOP to SIGCONT): each happens once per
            ``EVENTS_PER_KIND_EVERY_S`` of the chaos phase (`benchmarks.chaos.schedule`).
        attack_s: Length of each hostile client's attack (`benchmarks.chaos.attacks`) and
            of the quiet window before them, after the chaos phase, under the same load.
        request_timeout_s: The connector's ``kvshelf.request_timeout_s``: the longest one call
            waits for the server, which the stall target names.
        min_gap_s: Least time between two chaos events (and before the first, after the last).
        event_settle_s: Least time between the end of one chaos event and the start of the
            next, for an event that came due while the one before still ran (a long stall,
            a slow victim restart): each event's window then holds its own effect only (a
            server killed 2 ms after a 60 s stall ended made requests sent during the stall
            wait for its restart).
        window_before: Requests before each server restart the hit rate is taken over.
        window_after: Requests after each server restart the hit rate is taken over.
        reconnect_settle_s: Requests starting this soon after a restart are not in the "after"
            window: the connector retries a lost server this often (its
            ``reconnect_interval_s``), so it has not reconnected yet.
        baseline_requests: Requests of each concurrent run without a connector.
        verify_prompts: Prompts of the sequential verification pass.
        sample_interval_s: Period of the RSS, ``/dev/shm`` and stats sampler.
        timeline_bin_s: Width of the time bins of ``timeline`` (hit rate and latency over
            time; ``chaos.json`` keeps bins, not every request).
        lazy_threshold: ``lmcache.mp.lazy_offload_threshold`` (FIFO only; kept for
            `benchmarks.e2e.backends`).
        lazy_select_count: ``lmcache.mp.lazy_offload_select_count`` (idem).
        multiprocessing: vLLM's multi-process mode (the OpenAI server always uses it).
    """

    minutes: float = 10.0
    seed: int = 0
    modes: tuple[Mode, ...] = CHAOS_MODES
    workload: MultiRoundQA = field(
        default_factory=lambda: MultiRoundQA(
            users=3, rounds=3, system_len=256, context_len=384, question_len=32, answer_len=8
        )
    )
    pool_users: int = 12
    victim_users: int = 1
    block_size: int = 64
    gpu_blocks: int = 24
    cache_gib: float = 0.5
    lease_timeout_s: float = 30.0
    engine_cpus: tuple[str, str] = field(default_factory=lambda: split_cpus(os.cpu_count() or 1))
    kv_cache_gib: int = 1
    stall_seconds: tuple[float, ...] = (10.0, 60.0)
    request_timeout_s: float = 1.0
    attack_s: float = 20.0
    min_gap_s: float = 30.0
    event_settle_s: float = 15.0
    window_before: int = 50
    window_after: int = 20
    reconnect_settle_s: float = 2.0
    baseline_requests: int = 60
    verify_prompts: int = 30
    sample_interval_s: float = 2.0
    timeline_bin_s: float = 5.0
    lazy_threshold: int = 1
    lazy_select_count: int = 10
    multiprocessing: bool = True

    @property
    def duration_s(self) -> float:
        """Length of the chaos phase of each mode in seconds."""
        return self.minutes * 60.0

    @property
    def max_model_len(self) -> int:
        """``--max-model-len`` of the engines: the longest prompt, its answer and a block."""
        return self.workload.max_prompt_len + self.workload.answer_len + self.block_size
