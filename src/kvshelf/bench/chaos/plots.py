"""``chaos.png``: hit rate, latency and memory over time per mode, chaos events marked.

One column per mode. Top: engine A's hit rate over a rolling window of requests (by send
time); middle: each request's latency, failed ones in red; bottom: the server's RSS and its
arenas' ``/dev/shm`` bytes. Vertical lines mark the events, one colour per kind. Linear axes from
zero.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

EVENT_COLOURS = {
    "server_kill": "tab:red",
    "server_stall": "tab:orange",
    "engine_kill": "tab:purple",
    "final_server_kill": "tab:brown",
}
ROLLING = 20
"""Requests per point of the hit-rate curve."""


def rolling_hit_rate(rows: list[dict[str, Any]], size: int = ROLLING) -> tuple[list, list]:
    """Cached over prompt tokens of each ``size`` consecutive successful requests of engine A.

    Args:
        rows: ``per_request`` rows of a mode.
        size: Window length.

    Returns:
        Send times (of each window's last request) and rates.
    """
    done = sorted(
        (
            r
            for r in rows
            if r["engine"] == "A" and r["error"] is None and r["cached_tokens"] is not None
        ),
        key=lambda r: r["start_s"],
    )
    times, rates = [], []
    for end in range(size, len(done) + 1):
        window = done[end - size : end]
        times.append(window[-1]["start_s"])
        rates.append(
            sum(r["cached_tokens"] for r in window) / sum(r["prompt_tokens"] for r in window)
        )
    return times, rates


def _mark_events(ax: Any, events: list[dict[str, Any]]) -> None:
    for event in events:
        ax.axvline(event["at_s"], color=EVENT_COLOURS.get(event["kind"], "k"), lw=1, alpha=0.8)


def plot(document: dict[str, Any], path: Path) -> Path:
    """Draw ``chaos.png`` from a ``chaos.json`` document.

    Args:
        document: The document.
        path: Where to write the PNG.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    modes = list(document["modes"].values())
    fig, axes = plt.subplots(
        3, len(modes), figsize=(6 * len(modes), 9), squeeze=False, sharex="col"
    )
    for column, mode in enumerate(modes):
        hit, latency, memory = (axes[row][column] for row in range(3))
        times, rates = rolling_hit_rate(mode["per_request"])
        hit.plot(times, rates, color="tab:blue", lw=1)
        hit.set_ylim(0, 1.05)
        hit.set_title(f"{mode['mode']}: hit rate (last {ROLLING} requests of A)", fontsize=9)
        rows = [r for r in mode["per_request"] if r["engine"] == "A"]
        for failed, colour in ((False, "tab:blue"), (True, "tab:red")):
            chosen = [r for r in rows if (r["error"] is not None) == failed]
            latency.scatter(
                [r["start_s"] for r in chosen], [r["latency_s"] for r in chosen], s=3, c=colour
            )
        latency.set_ylim(bottom=0)
        latency.set_title("request latency (s) of A; red: failed", fontsize=9)
        samples = mode["samples"]
        for field, colour, label in (
            ("rss_bytes", "tab:green", "server RSS"),
            ("shm_bytes", "tab:gray", "/dev/shm arenas"),
        ):
            points = [(s["t_s"], s[field] / 2**20) for s in samples if s.get(field) is not None]
            memory.plot([t for t, _ in points], [v for _, v in points], color=colour, label=label)
        memory.set_ylim(bottom=0)
        memory.set_title("MiB", fontsize=9)
        memory.set_xlabel("seconds")
        memory.legend(fontsize=7, loc="upper left")
        for ax in (hit, latency, memory):
            ax.set_xlim(left=0)
            _mark_events(ax, mode["events"])
    handles = [Line2D([], [], color=c, label=k) for k, c in EVENT_COLOURS.items()]
    fig.legend(handles=handles, fontsize=8, loc="lower center", ncol=len(handles))
    fig.suptitle("kvshelf under chaos: vLLM OpenAI server, multi-round QA", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
