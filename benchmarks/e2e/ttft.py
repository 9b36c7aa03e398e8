"""The TTFT rows of ``make bench-e2e``: recompute, storing, hit and floor engines, taking turns.

`run_ttft_rows` runs the engines (`testbed.run_engine`) of every mode against its cache
backend and hands their measurements to `benchmarks.e2e.ttft_rows`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.e2e.backends import cache_backend
from benchmarks.e2e.config import E2EConfig, Mode, model_name
from benchmarks.e2e.measure import descendants_cpu_s, wait_quiet
from benchmarks.e2e.ttft_prompts import (
    control_prompts,
    floor_prompt,
    hit_candidates,
    ttft_prompts,
)
from benchmarks.e2e.ttft_rows import ModeRuns, Turns, build_rows
from testbed.models import ModelSpec, build_model
from testbed.prompts import random_tokens
from testbed.run_engine import EngineProcess, EngineSpec, start_engine


def first_requests(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Return the single request of every round of an engine result."""
    return [round_["requests"][0] for round_ in result["rounds"]]


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
    prompts right after: the prompt in vLLM's own cache plus new tokens. A floor engine F
    without a connector, up for all modes like R, takes turns with B on the prompts of the
    control lengths: it computes the prompt, then runs the same floor prompts, so that each of
    B's floors has a paired floor without kvshelf (or LMCache) minutes apart at most. Every
    engine starts with the same unmeasured warm-up prompt, as long as the longest measured one;
    engine B's is a hit on what A stored.

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
    # F's rounds: the warm-up, then for every connector mode, each paired prompt and its floor
    # prompts (the rounds B runs for it), and a last round so that every one ends at a barrier.
    paired = [i for i, p in enumerate(prompts) if len(p) in config.control_lengths] or list(
        range(len(prompts))
    )
    hit_rounds = [
        _hit_rounds(prompt, config.block_size, f"{name}:{i}") for i, prompt in enumerate(prompts)
    ]
    floor_reference = start_engine(
        replace(
            base,
            rounds=[
                warmup,
                *(
                    r
                    for mode in modes
                    if mode.system != "none"
                    for i in paired
                    for r in hit_rounds[i]
                ),
                [flush[0]],
            ],
        )
    )
    # Each mode's runs, and F's round of each paired floor (None: not paired).
    measured_runs: list[tuple[ModeRuns, list[int | None]]] = []
    reference_rounds = 0
    floor_reference_rounds = 0
    try:
        reference.wait_round(0, timeout_s=900)
        floor_reference.wait_round(0, timeout_s=900)
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
                    measured_runs.append((ModeRuns(mode, mode_prompts, turns, [], []), []))
                    continue
                print(f"[{name}] {mode.name}: hit and floor engine B, floor engine F", flush=True)
                hits, floors, none_floors = _hits_and_floors(
                    replace(
                        base,
                        rounds=[warmup, *(r for rounds in hit_rounds for r in rounds), [flush[1]]],
                        kv_transfer_config=kv,
                    ),
                    python,
                    floor_reference,
                    hit_rounds,
                    paired,
                    first_floor_reference_round=1 + floor_reference_rounds,
                )
                floor_reference_rounds += sum(len(hit_rounds[i]) for i in paired)
            measured_runs.append((ModeRuns(mode, mode_prompts, turns, hits, floors), none_floors))
        reference.resume(reference_rounds)
        floor_reference.resume(floor_reference_rounds)
        recompute = first_requests(reference.result(timeout_s=900))[1:-1]
        none_floor_requests = first_requests(floor_reference.result(timeout_s=900))
    finally:
        reference.close()
        floor_reference.close()
    runs = [
        replace(run, none_floor=[None if k is None else none_floor_requests[k] for k in rounds])
        for run, rounds in measured_runs
    ]
    return build_rows(config, model, prompts, runs, recompute, memcpy)


def _hit_rounds(prompt: list[int], block_size: int, seed: str) -> list[list[list[int]]]:
    """Return the rounds engine B runs for ``prompt``: the prompt, then one per floor prompt.

    Args:
        prompt: A measured prompt.
        block_size: vLLM's block size.
        seed: Seed of the floor prompts' new tokens (with the candidate hit size).

    Returns:
        ``[[prompt], [floor for the largest hit], ...]`` (see `hit_candidates`).
    """
    return [[prompt]] + [
        [floor_prompt(prompt, cached, block_size, f"{seed}:{cached}")]
        for cached in hit_candidates(len(prompt), block_size)
    ]


def _hits_and_floors(
    spec: EngineSpec,
    python: str,
    floor_reference: EngineProcess,
    hit_rounds: list[list[list[list[int]]]],
    paired: list[int],
    first_floor_reference_round: int,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[int | None]]:
    """Run hit engine B, taking turns with the paused floor engine F on the paired prompts.

    B's turn runs one prompt's rounds back to back (the hit, then its floors); on a paired
    prompt F's turn follows: the same rounds, the prompt computed instead of loaded. Both go
    idle between turns.

    Args:
        spec: B's spec: a warm-up round, the rounds of ``hit_rounds`` in order, a last round.
        python: B's interpreter.
        floor_reference: F, paused after round ``first_floor_reference_round - 1``; its next
            rounds are those of the paired prompts, in order.
        hit_rounds: Per measured prompt, its rounds (`_hit_rounds`).
        paired: Indexes of the prompts F runs too.
        first_floor_reference_round: F's round that runs the first paired prompt.

    Returns:
        Per measured prompt: B's hit; B's floor that computed as many tokens as the hit did;
        and F's round that ran the same floor prompt (None for a prompt F does not run).
    """
    engine = start_engine(spec, python=python)
    done = 0
    reference_done = first_floor_reference_round - 1
    reference_first: list[int | None] = []
    try:
        engine.wait_round(0, timeout_s=900)
        wait_quiet()
        for i, rounds in enumerate(hit_rounds):
            for _ in rounds:
                engine.resume(done)
                done += 1
                engine.wait_round(done)
            wait_quiet()
            if i not in paired:
                reference_first.append(None)
                continue
            reference_first.append(reference_done + 1)
            for _ in rounds:
                floor_reference.resume(reference_done)
                reference_done += 1
                floor_reference.wait_round(reference_done)
            wait_quiet()
        engine.resume(done)
        requests = iter(first_requests(engine.result(timeout_s=900))[1:])
    finally:
        engine.close()
    hits, floors, none_floors = [], [], []
    for rounds, first in zip(hit_rounds, reference_first, strict=True):
        hit = next(requests)
        candidates = [next(requests) for _ in rounds[1:]]
        floor = _matching_floor(hit, candidates)
        hits.append(hit)
        floors.append(floor)
        # F's round of the same floor prompt: the prompt's first round, then its floors.
        at = next(k for k, candidate in enumerate(candidates) if candidate is floor)
        none_floors.append(None if first is None else first + 1 + at)
    return hits, floors, none_floors


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
) -> Turns:
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
    turns = Turns()
    storing = start_engine(spec, python=python)
    try:
        storing.wait_round(0, timeout_s=900)
        wait_quiet()
        for i in range(count):
            cpu = descendants_cpu_s()
            storing.resume(i)
            storing.wait_round(i + 1)
            turns.storing_tail_s.append(wait_quiet())
            turns.storing_cpu_s.append(descendants_cpu_s() - cpu)
            round_index = first_reference_round + i
            cpu = descendants_cpu_s()
            reference.resume(round_index - 1)
            reference.wait_round(round_index)
            turns.recompute_tail_s.append(wait_quiet())
            turns.recompute_cpu_s.append(descendants_cpu_s() - cpu)
        for round_index in range(count + 1, len(spec.rounds) - 1):
            storing.resume(round_index - 1)
            storing.wait_round(round_index)
        storing.resume(len(spec.rounds) - 2)
        turns.storing = first_requests(storing.result())[1 : 1 + count]
    finally:
        storing.close()
    return turns
