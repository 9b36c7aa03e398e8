"""The targets of ``make bench-e2e``, checked as ratios within one run, and the row selectors.

Reads result rows only (see `benchmarks.e2e.ttft_rows` and `.load`); the report
(`benchmarks.e2e.report`) lists the verdicts.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

Row = dict[str, Any]
TARGET_LENGTH = 4096
HIT_RATIO_LIMIT = 0.6
LOAD_VS_MEMCPY_LIMIT = 0.8
STORE_OVERHEAD_LIMITS = {"kvshelf-eager": 0.03, "kvshelf-lazy-fifo": 0.01}
FLOOR_RATIO_LIMIT = 1.03


def ttft_only(rows: Sequence[Row]) -> list[Row]:
    """Return the TTFT rows."""
    return [r for r in rows if r["workload"] == "ttft"]


def load_only(rows: Sequence[Row]) -> list[Row]:
    """Return the load (multi-round QA) rows."""
    return [r for r in rows if r["workload"] == "multi-round-qa"]


def _find(rows: Sequence[Row], **match: Any) -> Row | None:
    """Return the first row whose fields equal ``match``, or None."""
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _target(text: str, value: float | None, limit: float, ok: Callable[[float], bool]) -> Row:
    """Return one target verdict (``met`` is None when the value could not be measured)."""
    return {
        "target": text,
        "value": value,
        "limit": limit,
        "met": None if value is None else ok(value),
    }


def evaluate_targets(rows: Sequence[Row]) -> list[Row]:
    """Check the targets of the benchmark's issue, as ratios measured in this run.

    - kvshelf's hit-run TTFT at 4096 tokens <= 0.6 x LMCache's (eager vs eager, lazy vs lazy,
      per model), and its implied load bandwidth >= 0.8 x the one-thread memcpy;
    - a prompt already in vLLM's own cache plus new tokens (the floor) at 4096 tokens costs
      kvshelf <= 1.03 x what it costs without a connector: the median of the per-prompt
      ratios to the floor engine's, paired in the same run (per kvshelf mode);
    - kvshelf's storing run <= 1.03 x recompute TTFT (eager) and <= 1.01 x (lazy FIFO): the
      median over every paired prompt of every length (a maximum over per-length medians of
      four noisy pairs would be biased upwards); the worst length and the control row (no
      connector, same pairing) are quoted beside it;
    - under multi-round load, kvshelf's best mode (by throughput) has throughput >= LMCache's
      best mode and TTFT p99 <= that mode's.

    Args:
        rows: The run's rows.

    Returns:
        One verdict per target and model/mode: ``target``, ``value``, ``limit``, ``met``
        (None where the value is missing, e.g. LMCache's rows were skipped).
    """
    ttft = ttft_only(rows)
    verdicts = []
    for model in dict.fromkeys(r["model"] for r in ttft):
        for ours, theirs in (
            ("kvshelf-eager", "lmcache-eager"),
            ("kvshelf-lazy-fifo", "lmcache-lazy-fifo"),
        ):
            mine = _find(ttft, model=model, mode=ours, prompt_len=TARGET_LENGTH)
            if mine is None:
                continue
            peer = _find(ttft, model=model, mode=theirs, prompt_len=TARGET_LENGTH)
            ratio = mine["ttft_s_median"] / peer["ttft_s_median"] if peer else None
            verdicts.append(
                _target(
                    f"{model} {TARGET_LENGTH}: {ours} hit TTFT / {theirs} hit TTFT",
                    ratio,
                    HIT_RATIO_LIMIT,
                    lambda v: v <= HIT_RATIO_LIMIT,
                )
            )
            verdicts.append(
                _target(
                    f"{model} {TARGET_LENGTH}: {ours} load bandwidth / 1-thread memcpy",
                    mine.get("load_vs_memcpy_1t"),
                    LOAD_VS_MEMCPY_LIMIT,
                    lambda v: v >= LOAD_VS_MEMCPY_LIMIT,
                )
            )
        for row in ttft:
            if (
                row["model"] == model
                and row["prompt_len"] == TARGET_LENGTH
                and row["mode"].startswith("kvshelf")
                and "floor_vs_no_connector" in row
            ):
                verdicts.append(
                    _target(
                        f"{model} {TARGET_LENGTH}: {row['mode']} floor TTFT / no-connector "
                        "floor TTFT (prompt in vLLM's own cache plus new tokens)",
                        row["floor_vs_no_connector"],
                        FLOOR_RATIO_LIMIT,
                        lambda v: v <= FLOOR_RATIO_LIMIT,
                    )
                )
        control = _pooled_overhead(ttft, model, "none")
        # What the same pairing reads with nothing stored: the resolution of the figure.
        noise = f"; control without connector: {percent(control)}" if control is not None else ""
        for mode, limit in STORE_OVERHEAD_LIMITS.items():
            pooled = _pooled_overhead(ttft, model, mode)
            if pooled is None:
                continue
            worst = max(
                r["store_overhead"] for r in ttft if r["model"] == model and r["mode"] == mode
            )
            verdicts.append(
                _target(
                    f"{model}: {mode} storing TTFT / recompute TTFT - 1 (median of all paired "
                    f"prompts; worst length's median: {percent(worst)}{noise})",
                    pooled,
                    limit,
                    lambda v, limit=limit: v <= limit,
                )
            )
    load = load_only(rows)
    ours = [r for r in load if r["mode"].startswith("kvshelf")]
    theirs = [r for r in load if r["mode"].startswith("lmcache")]
    if ours:
        best = max(ours, key=lambda r: r["throughput_tok_s"])
        peer = max(theirs, key=lambda r: r["throughput_tok_s"]) if theirs else None
        peer_name = peer["mode"] if peer else "LMCache"
        verdicts.append(
            _target(
                f"load: {best['mode']} throughput / {peer_name} throughput",
                best["throughput_tok_s"] / peer["throughput_tok_s"] if peer else None,
                1.0,
                lambda v: v >= 1.0,
            )
        )
        verdicts.append(
            _target(
                f"load: {best['mode']} TTFT p99 / {peer_name} TTFT p99",
                best["ttft_p99_s"] / peer["ttft_p99_s"] if peer else None,
                1.0,
                lambda v: v <= 1.0,
            )
        )
    return verdicts


def _pooled_overhead(ttft: Sequence[Row], model: str, mode: str) -> float | None:
    """Median storing/recompute - 1 over every paired prompt of ``mode``, all lengths pooled.

    Rows written before per-prompt ratios were kept give the median of their lengths' medians.
    """
    rows = [r for r in ttft if r["model"] == model and r["mode"] == mode]
    if not rows:
        return None
    if all("store_overheads" in r for r in rows):
        return statistics.median(v for r in rows for v in r["store_overheads"])
    return statistics.median(r["store_overhead"] for r in rows)


def percent(value: float | None) -> str:
    """Format a fraction as a signed percentage, or ``-`` for None."""
    return "-" if value is None else f"{100 * value:+.1f}%"
