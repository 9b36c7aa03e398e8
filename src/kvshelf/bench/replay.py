"""Lazy offload replay benchmark: eager, lazy FIFO and newer policies side by side, under load.

Each run replays one seeded workload at one concurrency in one mode through `ConnectorRig`:
vLLM's real ``Scheduler`` and ``BlockPool``, kvshelf's real scheduler-role connector, a real
kvshelf server (one process per run, so modes never share cache contents) and a worker side
that really copies KV pages in and out, so every hit counted is a real hit. Mode ``none`` runs
the same scheduler with no connector at all. No model runs: sampled tokens are made up,
deterministically per request and position, so every mode sees the same requests.

Workloads (closed loop: each of ``concurrency`` sessions has one request in flight, and its next
turn is submitted when that request finishes):

- ``chat``: each turn's prompt is the previous prompt, the previous output and a new user
  message, so histories grow; a conversation that would outgrow ``max_model_len`` starts over.
- ``agent``: a long system prompt shared by every agent, a per-agent task, then one tool call
  (the output) and one tool result appended per turn; a full context starts a new task.
- ``unique``: a fresh random prompt every turn, never reused: pure connector overhead.

vLLM's KV cache holds ``gpu_blocks_per_session`` blocks per session, fewer than the sessions'
histories need, so vLLM evicts its own prefix cache and later turns can only hit through
kvshelf. Per run it reports:

- hit rates over the turns after a warm-up: prompt tokens not recomputed over prompt tokens,
  split into vLLM's own prefix cache and kvshelf, from the prefill stats the scheduler reports;
- blocks stored (worker counters, cross-checked by the server's committed objects), and lazy
  offload's requests skipped on a block hash mismatch;
- connector time per scheduler step that schedules tokens: the five scheduler-side hooks, timed
  around the connector instance's methods (wall time, mean and p99, and CPU time);
- once vLLM's engine loop would go idle (no request, no store work the connector asks it to
  step for): blocks lazy offload still protects, references still held on vLLM's blocks, and
  the tail: buffered store work never submitted, in blocks and requests.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging_if_needed, suppress_logging
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.request import Request

from kvshelf.bench.models import TINY, build_model
from kvshelf.bench.prompts import FIRST_ORDINARY_ID, ORDINARY_VOCAB, random_tokens
from kvshelf.bench.rig import ConnectorRig
from kvshelf.config import (
    LAZY_OFFLOAD,
    LAZY_OFFLOAD_POLICY,
    LAZY_OFFLOAD_SELECT_COUNT,
    LAZY_OFFLOAD_THRESHOLD,
)
from kvshelf.lazy.offloader import LazyOffloader, LazyOffloadStats
from kvshelf.lazy.policies import registry as lazy_policies
from kvshelf.lazy.policies.base import PendingStoreItem
from kvshelf.testing import ServerProcess
from kvshelf.testing_vllm import make_request, make_scheduler, step

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

HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "update_connector_output",
)
"""The scheduler-side connector methods vLLM calls on its per-step path, all timed."""

MISMATCH_WARNING = "Part block hashes mismatch for request"
"""The start of the spec's per-request warning when a drain finds reused blocks. Under
eviction pressure FIFO logs it for nearly every request; the benchmark counts those in
``hash_mismatch_skips`` and keeps them off the terminal."""

FIELDS = (
    "workload",
    "concurrency",
    "mode",
    "hit_rate",
    "local_hit_rate",
    "kvshelf_hit_rate",
    "blocks_stored",
    "hash_mismatch_skips",
    "step_us_mean",
    "step_us_p99",
    "protected_at_end",
    "tail_unstored",
)
"""The fields every result row has (more follow them)."""


@dataclass(frozen=True)
class ReplayConfig:
    """What `run_replay` runs.

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


# ----------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Turn:
    """One request of a session.

    Attributes:
        prompt: the prompt token ids.
        max_tokens: tokens to generate (eos is ignored, so exactly this many).
    """

    prompt: tuple[int, ...]
    max_tokens: int


@dataclass
class _SessionState:
    conversation: int = 0
    turn: int = 0


class Workload(ABC):
    """A seeded, reproducible source of turns for a number of sessions.

    A session runs conversations one after the other; a conversation is a sequence of turns,
    each one extending the previous turn's prompt and output (``follow_up``), until the next
    turn would not fit in ``max_model_len``.

    Args:
        seed: the workload seed; equal seeds give equal turns in every process.
        max_model_len: longest prompt plus output.
    """

    name: ClassVar[str]

    def __init__(self, seed: int, max_model_len: int) -> None:
        self.seed = seed
        self.max_model_len = max_model_len
        self._sessions: dict[int, _SessionState] = {}

    def first_turn(self, session: int) -> Turn:
        """The opening turn of ``session``."""
        self._sessions[session] = _SessionState()
        return self._open(session)

    def next_turn(self, session: int, previous: Turn, output: Sequence[int]) -> Turn:
        """The turn after ``previous``, whose generated tokens were ``output``.

        Args:
            session: the session index.
            previous: the session's last turn.
            output: the tokens generated for it.

        Returns:
            The continuation of the conversation, or a new conversation when it would not fit.
        """
        state = self._sessions[session]
        state.turn += 1
        rng = self._rng(session, "turn")
        max_tokens = self._output_len(rng)
        follow_up = self._follow_up(rng, self._key(session, "follow-up"))
        if follow_up is not None:
            prompt = (*previous.prompt, *output, *follow_up)
            if len(prompt) + max_tokens <= self.max_model_len:
                return Turn(prompt, max_tokens)
        state.conversation += 1
        state.turn = 0
        return self._open(session)

    def _open(self, session: int) -> Turn:
        rng = self._rng(session, "open")
        max_tokens = self._output_len(rng)
        prompt = self._opening(rng, self._key(session, "opening"))
        assert len(prompt) + max_tokens <= self.max_model_len, "opening turn too long"
        return Turn(tuple(prompt), max_tokens)

    def _key(self, session: int, what: str) -> str:
        state = self._sessions[session]
        return f"{self.seed}:{self.name}:{session}:{state.conversation}:{state.turn}:{what}"

    def _rng(self, session: int, what: str) -> random.Random:
        return random.Random(self._key(session, what))

    @abstractmethod
    def _output_len(self, rng: random.Random) -> int:
        """Draw the number of tokens to generate for a turn.

        Args:
            rng: the turn's random source.

        Returns:
            The ``max_tokens`` of the turn.
        """

    @abstractmethod
    def _opening(self, rng: random.Random, key: str) -> list[int]:
        """Make the prompt that opens a conversation.

        Args:
            rng: the turn's random source (lengths).
            key: the seed of the turn's token ids.

        Returns:
            The prompt.
        """

    @abstractmethod
    def _follow_up(self, rng: random.Random, key: str) -> list[int] | None:
        """Make the tokens appended after the previous prompt and output.

        Args:
            rng: the turn's random source (lengths).
            key: the seed of the appended token ids.

        Returns:
            The tokens, or None for a workload whose conversations never continue.
        """


class ChatWorkload(Workload):
    """Multi-turn chat: prompt = previous prompt + previous answer + a new user message."""

    name = "chat"
    MESSAGE_TOKENS = (32, 128)
    ANSWER_TOKENS = (8, 32)

    def _output_len(self, rng: random.Random) -> int:
        return rng.randint(*self.ANSWER_TOKENS)

    def _opening(self, rng: random.Random, key: str) -> list[int]:
        return random_tokens(rng.randint(*self.MESSAGE_TOKENS), seed=key)

    def _follow_up(self, rng: random.Random, key: str) -> list[int] | None:
        return random_tokens(rng.randint(*self.MESSAGE_TOKENS), seed=key)


class AgentWorkload(Workload):
    """Agent loop: shared system prompt + per-agent task, then tool calls and tool results."""

    name = "agent"
    SYSTEM_TOKENS = 384
    TASK_TOKENS = (48, 96)
    TOOL_CALL_TOKENS = (16, 32)
    TOOL_RESULT_TOKENS = (32, 128)

    def __init__(self, seed: int, max_model_len: int) -> None:
        super().__init__(seed, max_model_len)
        system_tokens = min(self.SYSTEM_TOKENS, max_model_len // 2)
        self.system_prompt = random_tokens(system_tokens, seed=f"{seed}:{self.name}:system")

    def _output_len(self, rng: random.Random) -> int:
        return rng.randint(*self.TOOL_CALL_TOKENS)

    def _opening(self, rng: random.Random, key: str) -> list[int]:
        return self.system_prompt + random_tokens(rng.randint(*self.TASK_TOKENS), seed=key)

    def _follow_up(self, rng: random.Random, key: str) -> list[int] | None:
        return random_tokens(rng.randint(*self.TOOL_RESULT_TOKENS), seed=key)


class UniqueWorkload(Workload):
    """A fresh random prompt every turn: nothing to reuse, only overhead to measure."""

    name = "unique"
    PROMPT_TOKENS = (128, 448)
    OUTPUT_TOKENS = (8, 32)

    def _output_len(self, rng: random.Random) -> int:
        return rng.randint(*self.OUTPUT_TOKENS)

    def _opening(self, rng: random.Random, key: str) -> list[int]:
        high = min(self.PROMPT_TOKENS[1], self.max_model_len - self.OUTPUT_TOKENS[1])
        return random_tokens(rng.randint(self.PROMPT_TOKENS[0], high), seed=key)

    def _follow_up(self, rng: random.Random, key: str) -> list[int] | None:
        return None


WORKLOADS: dict[str, type[Workload]] = {
    cls.name: cls for cls in (ChatWorkload, AgentWorkload, UniqueWorkload)
}


def sampled_token(seed: int) -> Callable[[Request], int]:
    """The made-up sampler: a token that depends only on the request id and the position.

    Args:
        seed: the run seed.

    Returns:
        A function of the request that returns its next token.
    """

    def sample(request: Request) -> int:
        key = f"{seed}:{request.request_id}:{len(request.output_token_ids)}"
        return random.Random(key).randrange(FIRST_ORDINARY_ID, ORDINARY_VOCAB)

    return sample


# ------------------------------------------------------------------------ measurement


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


def _is_not_mismatch_warning(record: logging.LogRecord) -> bool:
    """Logging filter: drop the spec's per-request hash mismatch warning, keep the rest."""
    return not record.getMessage().startswith(MISMATCH_WARNING)


@contextmanager
def _bench_logging() -> Iterator[None]:
    """Quiet vLLM's and kvshelf's per-run INFO lines and lazy offload's mismatch warnings.

    Other kvshelf warnings still print.
    """
    with suppress_logging(logging.WARNING):
        # vLLM applies its logging config on its first engine config, resetting the "vllm"
        # level set below; apply the same (default) config now, once, so that it is not.
        configure_logging_if_needed(LoggingConfig())
    names = ("vllm", "kvshelf")
    saved = {name: logging.getLogger(name).level for name in names}
    offloader_logger = logging.getLogger("kvshelf.lazy.offloader")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    logging.getLogger("kvshelf").setLevel(logging.WARNING)
    offloader_logger.addFilter(_is_not_mismatch_warning)
    try:
        yield
    finally:
        offloader_logger.removeFilter(_is_not_mismatch_warning)
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


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


@dataclass
class _Traffic:
    """What the replay loop observed."""

    finished: list[Finished] = field(default_factory=list)
    steps: int = 0
    busy_steps: int = 0
    preemptions: int = 0


def _replay(
    scheduler: Scheduler,
    engine_step: Callable[[], tuple[SchedulerOutput, EngineCoreOutputs]],
    workload: Workload,
    *,
    concurrency: int,
    turns: int,
    block_size: int,
    step_limit: int,
    after_step: Callable[[SchedulerOutput], None] | None = None,
) -> _Traffic:
    """Run the closed loop until every session has run ``turns`` turns and vLLM is idle.

    Returns:
        Finished requests with their prefill breakdown, and step counts.
    """
    traffic = _Traffic()
    live: dict[str, tuple[int, int, Turn]] = {}
    outputs: dict[str, list[int]] = {}
    stats: dict[str, Any] = {}

    def submit(session: int, turn_index: int, turn: Turn) -> None:
        request_id = f"{workload.name}-s{session}-t{turn_index}"
        live[request_id] = (session, turn_index, turn)
        outputs[request_id] = []
        scheduler.add_request(
            make_request(request_id, turn.prompt, max_tokens=turn.max_tokens, block_size=block_size)
        )

    for session in range(concurrency):
        submit(session, 0, workload.first_turn(session))
    # vLLM's engine loop steps while the scheduler has requests (the connector can extend it).
    while scheduler.has_requests():
        if traffic.steps >= step_limit:
            raise RuntimeError(f"{workload.name}: still busy after {step_limit} steps")
        scheduler_output, engine_outputs = engine_step()
        traffic.steps += 1
        traffic.busy_steps += scheduler_output.total_num_scheduled_tokens > 0
        traffic.preemptions += len(scheduler_output.preempted_req_ids or ())
        if after_step is not None:
            after_step(scheduler_output)
        for output in engine_outputs.outputs:
            outputs[output.request_id].extend(output.new_token_ids)
            if output.prefill_stats is not None:
                stats[output.request_id] = output.prefill_stats
            if not output.finished:
                continue
            session, turn_index, turn = live.pop(output.request_id)
            prefill = stats.pop(output.request_id)
            output_tokens = outputs.pop(output.request_id)
            traffic.finished.append(
                Finished(
                    request_id=output.request_id,
                    session=session,
                    turn=turn_index,
                    prompt_tokens=prefill.num_prompt_tokens,
                    local_tokens=prefill.num_local_cached_tokens,
                    external_tokens=prefill.num_external_cached_tokens,
                )
            )
            if turn_index + 1 < turns:
                next_turn = workload.next_turn(session, turn, output_tokens)
                submit(session, turn_index + 1, next_turn)
    assert not live, "every request finished"
    return traffic


def _hit_rates(finished: Sequence[Finished], warmup_turns: int) -> dict[str, Any]:
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


def _step_times(per_step_ns: Sequence[int]) -> dict[str, float]:
    """Mean and p99 (nearest rank) of per-step times, in microseconds; 0 with no steps."""
    if not per_step_ns:
        return {"step_us_mean": 0.0, "step_us_p99": 0.0}
    ordered = sorted(per_step_ns)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        "step_us_mean": round(sum(ordered) / len(ordered) / 1000, 1),
        "step_us_p99": round(p99 / 1000, 1),
    }


def run_one(
    config: ReplayConfig, model: Path, workload_name: str, concurrency: int, mode: str
) -> RunResult:
    """Replay one workload at one concurrency in one mode, with its own server.

    Args:
        config: sizes and seeds.
        model: the model folder (only its config is read).
        workload_name: a key of ``WORKLOADS``.
        concurrency: sessions with a request in flight.
        mode: a key of ``MODES``.

    Returns:
        The result row (see ``FIELDS``) and the finish-ordered hit timeline.
    """
    workload = WORKLOADS[workload_name](config.seed, config.max_model_len)
    turns = config.turns_per_session(concurrency)
    num_gpu_blocks = config.gpu_blocks_per_session * concurrency + 1
    engine = {
        "block_size": config.block_size,
        "num_gpu_blocks": num_gpu_blocks,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_num_seqs": concurrency,
        "max_model_len": config.max_model_len,
    }
    sample = sampled_token(config.seed)
    replay = functools.partial(
        _replay,
        workload=workload,
        concurrency=concurrency,
        turns=turns,
        block_size=config.block_size,
        step_limit=config.step_limit,
    )
    started = time.perf_counter()
    extra = MODES[mode]
    with _bench_logging():
        if extra is None:
            traffic, measures = _run_plain(model, engine, replay, sample)
        else:
            traffic, measures = _run_connector(
                model, engine, replay, sample, extra, config.l1_size_gb
            )
    row: dict[str, Any] = {
        "workload": workload_name,
        "concurrency": concurrency,
        "mode": mode,
        **_hit_rates(traffic.finished, config.warmup_turns),
        **measures,
        "requests": len(traffic.finished),
        "steps": traffic.steps,
        "busy_steps": traffic.busy_steps,
        "preemptions": traffic.preemptions,
        "num_gpu_blocks": num_gpu_blocks,
        "wall_s": round(time.perf_counter() - started, 2),
    }
    return RunResult(row=row, timeline=traffic.finished)


def _run_plain(
    model: Path,
    engine: dict[str, Any],
    replay: Callable[..., _Traffic],
    sample: Callable[[Request], int],
) -> tuple[_Traffic, dict[str, Any]]:
    """Replay on vLLM's scheduler with no connector.

    Returns:
        The traffic, and the measures (all connector measures 0).
    """
    scheduler = make_scheduler(model, **engine)
    try:
        traffic = replay(scheduler, lambda: step(scheduler, sampled_token=sample))
        refs = _block_refs(scheduler)
    finally:
        scheduler.shutdown()
    return traffic, {
        "blocks_stored": 0,
        "hash_mismatch_skips": 0,
        **_step_times([]),
        "step_cpu_us_mean": 0.0,
        "hook_us_per_step": dict.fromkeys(HOOKS, 0.0),
        "protected_at_end": 0,
        "tail_unstored": 0,
        "tail_requests": 0,
        "requests_offloaded": 0,
        "blocks_loaded": 0,
        "blocks_load_failed": 0,
        "server_committed": 0,
        "server_evicted": 0,
        "block_refs_at_end": refs,
        "lazy_stats": {},
    }


def _run_connector(
    model: Path,
    engine: dict[str, Any],
    replay: Callable[..., _Traffic],
    sample: Callable[[Request], int],
    extra: dict[str, Any],
    l1_size_gb: float,
) -> tuple[_Traffic, dict[str, Any]]:
    """Replay through `ConnectorRig` with its own fresh server.

    Returns:
        The traffic, and the connector, worker and server measures.
    """
    # A fresh server zeroes its arena in a background thread for seconds after it starts,
    # longer than a short run: it would take a core from the run it is meant to serve.
    with ServerProcess(l1_size_gb=l1_size_gb, extra_args=("--no-prefault",)) as server:
        rig = ConnectorRig(
            model,
            host=server.host,
            port=server.port,
            extra_config=extra,
            flush_stores=False,
            **engine,
        )
        try:
            timer = HookTimer(rig.connector)
            # The lazy offloader the connector built when vLLM bound its block pool; None in
            # eager mode.
            offloader = rig.connector.lazy_offloader
            traffic = replay(rig.scheduler, lambda: rig.step(sample), after_step=timer.end_step)
            # vLLM's engine loop goes idle here (no request and, through the connector's
            # has_pending_push_work, no store work it wants stepped): read what it leaves.
            lazy_stats = offloader.stats if offloader is not None else LazyOffloadStats()
            refs = _block_refs(rig.scheduler)
            tail = _take_pending(offloader, [f.request_id for f in traffic.finished])
            with server.client() as client:
                server_stats = client.stats()
            worker = rig.worker.counters
        finally:
            rig.close()
    return traffic, {
        "blocks_stored": worker.blocks_stored,
        "hash_mismatch_skips": lazy_stats.requests_skipped_hash_mismatch,
        **_step_times(timer.per_step_ns),
        "step_cpu_us_mean": _step_times(timer.per_step_cpu_ns)["step_us_mean"],
        "hook_us_per_step": timer.hook_us_per_step(),
        "protected_at_end": lazy_stats.blocks_protected,
        "tail_unstored": sum(item.num_blocks for item in tail),
        "tail_requests": len(tail),
        "requests_offloaded": lazy_stats.requests_submitted,
        "blocks_loaded": worker.blocks_loaded,
        "blocks_load_failed": worker.blocks_load_failed,
        "server_committed": server_stats["committed_objects_total"],
        "server_evicted": server_stats["evicted_objects_total"],
        "block_refs_at_end": refs,
        "lazy_stats": lazy_stats.as_dict() if offloader is not None else {},
    }


def _take_pending(
    offloader: LazyOffloader | None, request_ids: Sequence[str]
) -> list[PendingStoreItem]:
    """Take the store work still buffered for ``request_ids`` out of the offloader's policy.

    Only once the run is over: the items leave the policy, as if submitted.

    Args:
        offloader: the connector's lazy offloader, or None in eager mode.
        request_ids: every request of the run.

    Returns:
        The pending items (all requests have finished, so every pending item is returned).
    """
    if offloader is None:
        return []
    return offloader.take_pending(request_ids)


def _block_refs(scheduler: Scheduler) -> int:
    """References still held on vLLM's blocks (0 once every request and store is done)."""
    pool = scheduler.kv_cache_manager.block_pool
    return sum(block.ref_cnt for block in pool.blocks[1:])


# ---------------------------------------------------------------------------- output


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


COLUMNS = (
    # (header, row key, width, format spec); text columns are left-aligned.
    ("workload", "workload", 8, ""),
    ("conc", "concurrency", 4, "d"),
    ("mode", "mode", 14, ""),
    ("hit", "hit_rate", 6, ".3f"),
    ("local", "local_hit_rate", 6, ".3f"),
    ("kvshelf", "kvshelf_hit_rate", 7, ".3f"),
    ("stored", "blocks_stored", 7, "d"),
    ("mismatch", "hash_mismatch_skips", 8, "d"),
    ("us/step", "step_us_mean", 8, ".1f"),
    ("us p99", "step_us_p99", 8, ".1f"),
    ("cpu us", "step_cpu_us_mean", 7, ".1f"),
    ("prot", "protected_at_end", 4, "d"),
    ("tail", "tail_unstored", 6, "d"),
    ("tailreq", "tail_requests", 7, "d"),
    ("preempt", "preemptions", 7, "d"),
    ("steps", "steps", 6, "d"),
)


def format_header() -> str:
    """The table header, aligned with `format_row`."""
    return "  ".join(
        header.ljust(width) if not spec else header.rjust(width)
        for header, _, width, spec in COLUMNS
    )


def format_row(row: dict[str, Any]) -> str:
    """One table line for a result row."""
    return "  ".join(
        f"{row[key]:<{width}}" if not spec else f"{row[key]:>{width}{spec}}"
        for _, key, width, spec in COLUMNS
    )


PLOT_STYLES: dict[str, dict[str, Any]] = {
    # Modes coincide until lazy offload first triggers: distinct dashes keep each visible.
    "none": {"color": "0.55", "linewidth": 4.0, "alpha": 0.5},
    "eager": {"color": "tab:orange", "linewidth": 1.6},
    "fifo-100": {"color": "tab:green", "linewidth": 1.6, "linestyle": "--"},
    "fifo-20": {"color": "tab:red", "linewidth": 1.6, "linestyle": "-."},
    "eviction-aware": {"color": "tab:purple", "linewidth": 1.6},
}


def plot_timelines(results: Sequence[RunResult], path: Path) -> None:
    """Plot the rolling hit rate over finished requests per mode, one column per workload.

    Only the highest concurrency of each workload is drawn; the window is that concurrency.
    Top row: total hit rate (vLLM's prefix cache plus kvshelf); bottom row: the kvshelf part.

    Args:
        results: all runs.
        path: the PNG to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.row["workload"] for r in results))
    fig, axes = plt.subplots(
        2, len(workloads), figsize=(5.5 * len(workloads), 7), squeeze=False, sharey=True
    )
    parts: tuple[tuple[str, Callable[[Finished], int]], ...] = (
        ("total hit rate", lambda f: f.local_tokens + f.external_tokens),
        ("kvshelf hit rate", lambda f: f.external_tokens),
    )
    for column, workload in enumerate(workloads):
        runs = [r for r in results if r.row["workload"] == workload]
        top = max(r.row["concurrency"] for r in runs)
        for row, (label, hits) in enumerate(parts):
            ax = axes[row][column]
            for run in (r for r in runs if r.row["concurrency"] == top):
                mode = run.row["mode"]
                ax.plot(_rolling(run.timeline, top, hits), label=mode, **PLOT_STYLES[mode])
            ax.set_title(f"{workload}, concurrency {top}: {label}", fontsize=10)
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            if row == len(parts) - 1:
                ax.set_xlabel("finished requests")
            if column == 0:
                ax.set_ylabel(f"{label} (rolling)")
    axes[0][0].legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _rolling(
    timeline: Sequence[Finished], window: int, hits: Callable[[Finished], int]
) -> list[float]:
    """Hit tokens over prompt tokens of the last ``window`` requests, after each request."""
    rates: list[float] = []
    for end in range(1, len(timeline) + 1):
        recent = timeline[max(0, end - window) : end]
        prompt = sum(f.prompt_tokens for f in recent)
        rates.append(sum(hits(f) for f in recent) / prompt if prompt else 0.0)
    return rates


# ------------------------------------------------------------------------------- main


def run_replay(
    config: ReplayConfig, out_dir: Path, print_line: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """Run every (workload, concurrency, mode), print the table, write JSON and the plot.

    Args:
        config: what to run.
        out_dir: where ``lazy-replay.json`` and ``lazy-replay.png`` go.
        print_line: where table lines go.

    Returns:
        The result rows, as written to the JSON file.
    """
    model = build_model(TINY)
    modes, notes = available_modes(config.modes)
    for note in notes:
        print_line(f"note: {note}")
    threads = torch.get_num_threads()
    # One thread: on a shared 2-core machine a 2-thread copy stalls on its busy neighbour.
    torch.set_num_threads(1)
    results: list[RunResult] = []
    started = time.perf_counter()
    try:
        print_line(format_header())
        for workload in config.workloads:
            for concurrency in config.concurrencies:
                for mode in modes:
                    result = run_one(config, model, workload, concurrency, mode)
                    results.append(result)
                    print_line(format_row(result.row))
    finally:
        torch.set_num_threads(threads)
    rows = [r.row for r in results]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "lazy-replay.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot_timelines(results, out_dir / "lazy-replay.png")
    print_line(
        f"{len(rows)} runs in {time.perf_counter() - started:.0f} s; "
        f"wrote {out_dir / 'lazy-replay.json'} and {out_dir / 'lazy-replay.png'}"
    )
    return rows


def main(*, quick: bool, out_dir: Path) -> int:
    """Run ``kvshelf bench lazy``.

    Args:
        quick: run the ``QUICK`` smoke configuration instead of the full one.
        out_dir: the output folder.

    Returns:
        The exit status.
    """
    run_replay(QUICK if quick else ReplayConfig(), out_dir)
    return 0


__all__ = [
    "FIELDS",
    "MODES",
    "QUICK",
    "WORKLOADS",
    "ReplayConfig",
    "run_one",
    "run_replay",
]
