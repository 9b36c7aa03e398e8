"""The output of ``make bench-lazy``: the row fields, the table and the hit-rate plot."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.replay.measurement import Finished, RunResult

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
