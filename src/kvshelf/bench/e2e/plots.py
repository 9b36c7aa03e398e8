"""The plots of ``make bench-e2e``: ``e2e-ttft.png`` and ``e2e-load.png``, from ``e2e.json``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvshelf.bench.e2e.targets import load_only, ttft_only


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def plot(document: dict[str, Any], out: Path) -> list[Path]:
    """Write ``e2e-ttft.png`` and ``e2e-load.png`` (whichever rows exist) into ``out``.

    Args:
        document: The ``e2e.json`` document.
        out: Output folder.

    Returns:
        The files written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    ttft = [r for r in ttft_only(document["rows"]) if r["mode"] != "recompute"]
    if ttft:
        groups = list(dict.fromkeys((r["model"], r["prompt_len"]) for r in ttft))
        fig, axes = plt.subplots(2, len(groups), figsize=(4 * len(groups), 7), squeeze=False)
        for column, (model, length) in enumerate(groups):
            rows = [r for r in ttft if (r["model"], r["prompt_len"]) == (model, length)]
            names = [r["mode"] for r in rows]
            xs = range(len(rows))
            top, bottom = axes[0][column], axes[1][column]
            # The control row (mode none) has no hit run: NaN draws nothing.
            top.bar(xs, [_nan(r["ttft_s_median"]) for r in rows], label="hit", color="tab:blue")
            top.scatter(
                xs,
                [_nan(r.get("floor_ttft_s_median")) for r in rows],
                label="floor",
                color="k",
                zorder=3,
            )
            top.axhline(
                rows[0]["recompute_ttft_s_median"], color="tab:red", ls="--", label="recompute"
            )
            top.set_yscale("log")
            top.set_title(f"{model}, {length} tokens: TTFT (s)")
            bottom.bar(xs, [100 * r["store_overhead"] for r in rows], color="tab:orange")
            bottom.axhline(0, color="k", lw=0.5)
            bottom.set_title("storing run vs recompute (%)")
            for ax in (top, bottom):
                ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
            if column == 0:
                top.legend(fontsize=8)
        fig.tight_layout()
        path = out / "e2e-ttft.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    load = load_only(document["rows"])
    if load:
        names = [r["mode"] for r in load]
        xs = range(len(load))
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        left.bar(xs, [r["throughput_tok_s"] for r in load], color="tab:green")
        left.set_title("multi-round QA throughput (tok/s)")
        right.bar([x - 0.2 for x in xs], [r["ttft_p50_s"] for r in load], 0.4, label="p50")
        right.bar([x + 0.2 for x in xs], [r["ttft_p99_s"] for r in load], 0.4, label="p99")
        right.set_title("TTFT (s)")
        right.legend()
        for ax in (left, right):
            ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
        fig.tight_layout()
        path = out / "e2e-load.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
