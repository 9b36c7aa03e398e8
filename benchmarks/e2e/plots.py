"""The plots of ``make bench-e2e``: ``e2e-ttft.png`` and ``e2e-load.png``, from ``e2e.json``.

Honest by construction: linear axes from zero, one colour per system (kvshelf, LMCache, no
connector) whatever its mode, every paired measurement drawn beside its median, and the
storing-overhead panels shaded with the control's spread (an engine without a connector
measured exactly like a storing run), which is the measurement's own noise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.e2e.targets import load_only, ttft_only

SYSTEM_COLOURS = {"kvshelf": "tab:blue", "lmcache": "tab:orange", "none": "tab:gray"}
SYSTEM_NAMES = {"kvshelf": "kvshelf", "lmcache": "LMCache", "none": "no connector"}


def system(mode: str) -> str:
    """The system a mode belongs to: ``kvshelf``, ``lmcache`` or ``none``."""
    return mode.split("-", 1)[0]


def _colours(rows: list[dict[str, Any]]) -> list[str]:
    return [SYSTEM_COLOURS[system(r["mode"])] for r in rows]


def _system_legend(fig: Any, rows: list[dict[str, Any]]) -> None:
    """One legend for the figure: a colour per system present."""
    from matplotlib.patches import Patch

    systems = list(dict.fromkeys(system(r["mode"]) for r in rows))
    handles = [Patch(color=SYSTEM_COLOURS[s], label=SYSTEM_NAMES[s]) for s in systems]
    fig.legend(handles=handles, fontsize=8, loc="lower right", ncol=len(handles))


def control_band(rows: list[dict[str, Any]], model: str) -> tuple[float, float] | None:
    """Min and max (percent) of the paired ratios of ``model``'s control row, if it has one."""
    for row in rows:
        if row["model"] == model and row["mode"] == "none" and row.get("store_overheads"):
            values = [100 * v for v in row["store_overheads"]]
            return min(values), max(values)
    return None


def _ttft_figure(plt: Any, rows: list[dict[str, Any]]) -> Any:
    groups = list(dict.fromkeys((r["model"], r["prompt_len"]) for r in rows))
    fig, axes = plt.subplots(2, len(groups), figsize=(3.6 * len(groups), 7), squeeze=False)
    for column, (model, length) in enumerate(groups):
        group = [r for r in rows if (r["model"], r["prompt_len"]) == (model, length)]
        xs = list(range(len(group)))
        names = [r["mode"] for r in group]
        top, bottom = axes[0][column], axes[1][column]
        hits = [r for r in group if r["ttft_s_median"] is not None]
        hit_xs = [xs[group.index(r)] for r in hits]
        top.bar(hit_xs, [r["ttft_s_median"] for r in hits], color=_colours(hits))
        floors = [(x, r.get("floor_ttft_s_median")) for x, r in zip(hit_xs, hits, strict=True)]
        floors = [(x, f) for x, f in floors if f is not None]
        if floors:
            top.scatter(*zip(*floors, strict=True), color="k", s=12, zorder=3)
        recompute = group[0].get("recompute_ttft_s_median")
        title = f"{model}, {length} tok"
        top.set_title(title + (f"\n(recompute {recompute:.1f} s)" if recompute else ""), fontsize=9)
        top.set_ylim(bottom=0)
        if column == 0:
            top.set_ylabel("hit TTFT (s), median\ndot: floor (same tokens computed)")

        band = control_band(rows, model)
        if band is not None:
            bottom.axhspan(*band, color="0.85", zorder=0, label="control spread")
        bottom.bar(xs, [100 * (r["store_overhead"] or 0) for r in group], color=_colours(group))
        for x, row in zip(xs, group, strict=True):
            pairs = [100 * v for v in row.get("store_overheads") or []]
            bottom.scatter([x] * len(pairs), pairs, color="k", s=8, zorder=3)
        bottom.axhline(0, color="k", lw=0.5)
        if column == 0:
            bottom.set_ylabel("storing / recompute TTFT - 1 (%)\nbar: median, dots: pairs")
        if band is not None:
            bottom.legend(fontsize=7, loc="lower right")
        for ax in (top, bottom):
            ax.set_xticks(xs, names, rotation=35, ha="right", fontsize=7)
    fig.suptitle(
        "Time to first token: hit (top) and storing overhead (bottom); grey band: the "
        "control's paired ratios (noise)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    _system_legend(fig, rows)
    return fig


def _load_figure(plt: Any, rows: list[dict[str, Any]]) -> Any:
    xs = list(range(len(rows)))
    names = [r["mode"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    panels = (
        ("throughput_tok_s", "throughput (tok/s)"),
        ("ttft_p50_s", "TTFT p50 (s)"),
        ("ttft_p99_s", "TTFT p99 (s)"),
    )
    for ax, (field, title) in zip(axes, panels, strict=True):
        ax.bar(xs, [r[field] for r in rows], color=_colours(rows))
        ax.set_title(title, fontsize=9)
        ax.set_ylim(bottom=0)
        ax.set_xticks(xs, names, rotation=35, ha="right", fontsize=7)
    fig.suptitle("Multi-round QA on the OpenAI server (one run per mode)", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    _system_legend(fig, rows)
    return fig


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
    figures = (
        ("e2e-ttft.png", _ttft_figure, ttft),
        ("e2e-load.png", _load_figure, load_only(document["rows"])),
    )
    for name, draw, rows in figures:
        if not rows:
            continue
        fig = draw(plt, rows)
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
