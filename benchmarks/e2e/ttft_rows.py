"""The TTFT rows of ``make bench-e2e``: what the engines measured, summarized per mode and length.

`Turns` and `ModeRuns` hold one mode's raw measurements (`benchmarks.e2e.ttft` fills them);
`build_rows` turns them into the result rows (medians, paired ratios, load bandwidth).
Arithmetic only: nothing here starts a process.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from benchmarks.e2e.config import E2EConfig, Mode, kv_bytes_per_token, model_name
from testbed.models import ModelSpec


@dataclass
class Turns:
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
class ModeRuns:
    """What one mode's engines measured, per measured prompt (in prompt order).

    Attributes:
        none_floor: The floor engine's (no connector) floor of the same floor prompt as
            ``floor``, None for a prompt it did not run; empty for the control.
    """

    mode: Mode
    prompts: list[list[int]]
    turns: Turns
    hit: list[dict[str, Any]]
    floor: list[dict[str, Any]]
    none_floor: list[dict[str, Any] | None] = field(default_factory=list)


def build_rows(
    config: E2EConfig,
    model: ModelSpec,
    prompts: list[list[int]],
    runs: list[ModeRuns],
    recompute: list[dict[str, Any]],
    memcpy: dict[str, float],
) -> list[dict[str, Any]]:
    """Turn the measurements of `benchmarks.e2e.ttft.run_ttft_rows` into rows.

    Args:
        config: The run's configuration.
        model: The model.
        prompts: The measured prompts.
        runs: Per mode, its engines' measurements.
        recompute: R's measured requests: each mode's prompts (`ModeRuns.prompts`), in mode
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
                    none_floor=[run.none_floor[i] for i in at] if run.none_floor else [],
                )
                | _turn_fields(run.turns, at)
            )
    return rows


def _turn_fields(turns: Turns, at: list[int]) -> dict[str, Any]:
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
    none_floor: list[dict[str, Any] | None],
) -> dict[str, Any]:
    """Summarize one mode at one prompt length (lists are per prompt, in the same order).

    Returns:
        The row: medians of the hit, storing, floor and recompute TTFTs, the hit's cached
        tokens and KV bytes, ``bytes / median(hit - floor)`` (paired per prompt; None when
        the median is not positive), the median of ``storing / recompute - 1`` (paired per
        prompt) and its per-prompt values (``store_overheads``), the per-prompt lists, and
        `_floor_pairing`'s fields.
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
        **_floor_pairing(floor, none_floor),
    )


def _floor_pairing(
    floor: list[dict[str, Any]], none_floor: list[dict[str, Any] | None]
) -> dict[str, Any]:
    """Compare the floors with the floor engine's (no connector) floors of the same prompts.

    A floor is a prompt already in vLLM's own prefix cache plus new tokens: a request the
    connector has nothing to add to.

    Returns:
        ``floor_vs_no_connector``: the median over the paired prompts of the floor's TTFT
        over the no-connector floor's (None when no prompt was paired), its per-prompt values
        (``floor_vs_no_connector_ratios``), the no-connector floors' TTFTs and their median,
        and ``no_connector_floor_matches``: whether every pair computed as many tokens.
    """
    pairs = [(f, n) for f, n in zip(floor, none_floor, strict=False) if n is not None]
    ratios = [f["ttft_s"] / n["ttft_s"] for f, n in pairs]
    return {
        "floor_vs_no_connector": statistics.median(ratios) if ratios else None,
        "floor_vs_no_connector_ratios": ratios,
        "no_connector_floor_ttft_s": [n["ttft_s"] for _, n in pairs],
        "no_connector_floor_ttft_s_median": (
            statistics.median(n["ttft_s"] for _, n in pairs) if pairs else None
        ),
        "no_connector_floor_matches": all(
            f["num_cached_tokens"] == n["num_cached_tokens"] for f, n in pairs
        ),
    }
