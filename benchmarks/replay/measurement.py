"""What ``make bench-lazy`` measures: connector hook time per step, hit rates, block refs.

`HookTimer` times the scheduler-side connector hooks through the connector's public methods;
`Finished` records each request's prefill breakdown, from which `hit_rates` are computed;
`RunResult` is one run's row and hit timeline. vLLM is named in annotations only.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler

HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "update_connector_output",
)
"""The scheduler-side connector methods vLLM calls on its per-step path, all timed."""


class HookTimer:
    """Times the connector's scheduler-side hooks, summed per scheduler step.

    Wraps the methods named in ``HOOKS`` on the connector instance (vLLM looks them up on the
    instance, so it calls the wrappers). Wall time (``perf_counter_ns``) is what delays vLLM's
    step, server round trips and waits for the GIL included; the scheduler thread's CPU time
    (``thread_time_ns``) is the connector's own work, and is far less sensitive to other
    processes on a shared machine.

    Args:
        connector: the scheduler-role connector instance.
    """

    def __init__(self, connector: Any) -> None:
        # This step's time per hook; on a busy step it is added to the totals below.
        self._step_ns = dict.fromkeys(HOOKS, 0)
        self._step_cpu_ns = 0
        self.per_step_ns: list[int] = []
        self.per_step_cpu_ns: list[int] = []
        self.hook_ns = dict.fromkeys(HOOKS, 0)
        for name in HOOKS:
            setattr(connector, name, self._timed(name, getattr(connector, name)))

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            start_cpu = time.thread_time_ns()
            try:
                return method(*args, **kwargs)
            finally:
                self._step_cpu_ns += time.thread_time_ns() - start_cpu
                self._step_ns[name] += time.perf_counter_ns() - start

        return timed

    def end_step(self, scheduler_output: SchedulerOutput) -> None:
        """Close the current step's sums if it scheduled any token; else carry them over.

        Per-step figures are over steps that run a forward pass: a step with nothing
        scheduled (the engine waiting for lookup replies, stores or blocks) counts as no step,
        which would make a mode that keeps vLLM waiting look cheaper per step. Its connector
        time is not lost either: it is added to the next step that schedules tokens, so the
        totals hold all connector time.

        Args:
            scheduler_output: the step's scheduler output.
        """
        if scheduler_output.total_num_scheduled_tokens == 0:
            return
        self.per_step_ns.append(sum(self._step_ns.values()))
        self.per_step_cpu_ns.append(self._step_cpu_ns)
        for name, ns in self._step_ns.items():
            self.hook_ns[name] += ns
        self._step_ns = dict.fromkeys(HOOKS, 0)
        self._step_cpu_ns = 0

    def hook_us_per_step(self) -> dict[str, float]:
        """Each hook's mean time per busy step, in microseconds."""
        steps = max(1, len(self.per_step_ns))
        return {name: round(ns / steps / 1000, 1) for name, ns in self.hook_ns.items()}


@dataclass
class Finished:
    """One finished request, in finish order.

    Attributes:
        request_id: its id.
        session: its session.
        turn: its index among the session's turns.
        prompt_tokens: prompt length.
        local_tokens: prompt tokens found in vLLM's prefix cache.
        external_tokens: prompt tokens loaded from kvshelf.
    """

    request_id: str
    session: int
    turn: int
    prompt_tokens: int
    local_tokens: int
    external_tokens: int


@dataclass
class RunResult:
    """The row of one (workload, concurrency, mode) run and its hit timeline."""

    row: dict[str, Any]
    timeline: list[Finished] = field(default_factory=list)


def hit_rates(finished: Sequence[Finished], warmup_turns: int) -> dict[str, Any]:
    """Hit rates over the requests past each session's warm-up turns.

    Args:
        finished: every finished request.
        warmup_turns: turns of each session left out.

    Returns:
        Total, local and kvshelf hit rates (cached prompt tokens over prompt tokens), and the
        number of requests and prompt tokens they cover.
    """
    measured = [f for f in finished if f.turn >= warmup_turns]
    prompt = sum(f.prompt_tokens for f in measured)
    local = sum(f.local_tokens for f in measured)
    external = sum(f.external_tokens for f in measured)

    def rate(tokens: int) -> float:
        return round(tokens / prompt, 4) if prompt else 0.0

    return {
        "hit_rate": rate(local + external),
        "local_hit_rate": rate(local),
        "kvshelf_hit_rate": rate(external),
        "measured_requests": len(measured),
        "measured_prompt_tokens": prompt,
    }


def step_times(per_step_ns: Sequence[int]) -> dict[str, float]:
    """Mean and p99 (nearest rank) of per-step times, in microseconds; 0 with no steps."""
    if not per_step_ns:
        return {"step_us_mean": 0.0, "step_us_p99": 0.0}
    ordered = sorted(per_step_ns)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        "step_us_mean": round(sum(ordered) / len(ordered) / 1000, 1),
        "step_us_p99": round(p99 / 1000, 1),
    }


def block_refs(scheduler: Scheduler) -> int:
    """References still held on vLLM's blocks (0 once every request and store is done)."""
    pool = scheduler.kv_cache_manager.block_pool
    return sum(block.ref_cnt for block in pool.blocks[1:])
