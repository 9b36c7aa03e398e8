"""``chaos.png``: hit rate, latency and memory over time per mode, chaos events marked.

One column per mode, from the mode's ``timeline`` (engine A's requests in time bins by send
time). Top: the hit rate per bin; middle: the worst and the median latency per bin, failed
requests as black dots; bottom: the server's RSS and its arenas' ``/dev/shm`` bytes.
Vertical lines mark the events, one colour per kind; grey spans the hostile clients' attacks.
Linear axes from zero.
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


def _mark_events(ax: Any, events: list[dict[str, Any]], attacks: list[dict[str, Any]]) -> None:
    for event in events:
        ax.axvline(event["at_s"], color=EVENT_COLOURS.get(event["kind"], "k"), lw=1, alpha=0.8)
    for attack in attacks:
        if "at_s" in attack:
            ax.axvspan(attack["at_s"], attack["done_s"], color="tab:gray", alpha=0.15, lw=0)


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
        bins = mode["timeline"]
        rated = [b for b in bins if b["hit_rate"] is not None]
        hit.plot([b["t_s"] for b in rated], [b["hit_rate"] for b in rated], color="tab:blue")
        hit.set_ylim(0, 1.05)
        hit.set_title(f"{mode['mode']}: hit rate of A's requests per time bin", fontsize=9)
        timed = [b for b in bins if b["latency_max_s"] is not None]
        for field, colour in (("latency_max_s", "tab:red"), ("latency_p50_s", "tab:blue")):
            latency.plot([b["t_s"] for b in timed], [b[field] for b in timed], color=colour, lw=1)
        failures = [f for f in mode["failures"] if f["engine"] == "A"]
        latency.scatter(
            [f["start_s"] for f in failures], [f["latency_s"] for f in failures], c="k", s=12
        )
        latency.set_ylim(bottom=0)
        latency.set_title(
            "latency (s) of A per bin: max red, median blue; failed: dots", fontsize=9
        )
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
            _mark_events(ax, mode["events"], mode.get("attacks", {}).get("runs", []))
    handles = [Line2D([], [], color=c, label=k) for k, c in EVENT_COLOURS.items()]
    fig.legend(handles=handles, fontsize=8, loc="lower center", ncol=len(handles))
    fig.suptitle("kvshelf under chaos: vLLM OpenAI server, multi-round QA", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
