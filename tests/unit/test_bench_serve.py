"""The pure parts of ``make bench-serve``: the Mooncake to ``timed_trace`` converter, the
workload and scale checks, and the row, ratio and page builder. The engines, servers and
vLLM's client run in ``make bench-serve`` itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.serve import report
from benchmarks.serve.workloads import (
    PrefixRepetition,
    TraceScaling,
    Workload,
    convert_trace,
    ideal_gpu_blocks,
    make_workloads,
    prefix_args,
    trace_args,
    trace_chunk_tokens,
)

MOONCAKE = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 300, "hash_ids": [7, 8, 9]},
    {"timestamp": 1500, "input_length": 40000, "output_length": 5, "hash_ids": list(range(79))},
    {"timestamp": 4000, "input_length": 512, "output_length": 1, "hash_ids": [7]},
]


def test_converter_scales_lengths_time_and_cuts_long_prompts_at_whole_blocks() -> None:
    scaling = TraceScaling(token_divisor=16, max_input=1984, time_stretch=4.0)
    out = list(convert_trace(MOONCAKE, 3, 1.0, scaling))
    assert trace_chunk_tokens(1.0, scaling) == 32
    # 1100 / 16 = 68.75 -> 69 tokens over 3 blocks of 32; 300 / 16 -> 19 output tokens.
    assert out[0] == {
        "timestamp": 0.0,
        "input_length": 69,
        "output_length": 19,
        "hash_ids": [7, 8, 9],
    }
    # 40000 / 16 = 2500 tokens, cut at 1984 = 62 blocks of 32; the ids kept are its first 62.
    assert out[1]["input_length"] == 1984
    assert out[1]["hash_ids"] == list(range(62))
    assert out[1]["timestamp"] == 2.0  # 500 ms later, stretched 4 x
    assert out[2] == {"timestamp": 12.0, "input_length": 32, "output_length": 1, "hash_ids": [7]}


def test_converter_takes_the_first_requests_and_scales_with_scale() -> None:
    scaling = TraceScaling(token_divisor=16, max_input=1984, time_stretch=1.0)
    out = list(convert_trace(MOONCAKE, 2, 0.25, scaling))
    assert len(out) == 2
    assert trace_chunk_tokens(0.25, scaling) == 8
    assert out[1]["input_length"] == 496 and len(out[1]["hash_ids"]) == 62
    assert (
        trace_args(Workload("t", "timed_trace", 2, ("none",)), "f.jsonl", 0.25, scaling)[-3] == "1"
    )  # seconds already: the sec multiplier is 1


def test_converter_names_a_missing_field() -> None:
    with pytest.raises(ValueError, match="trace record 2: no field 'hash_ids'"):
        list(
            convert_trace(
                [MOONCAKE[0], {"timestamp": 1, "input_length": 1, "output_length": 1}],
                5,
                1.0,
                TraceScaling(),
            )
        )


def test_scale_that_leaves_a_fraction_of_a_token_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"--scale 0\.3: trace block tokens 32"):
        trace_chunk_tokens(0.3, TraceScaling())
    workload = make_workloads(["prefix"], ["none"], 12)[0]
    assert prefix_args(workload, 0.5, PrefixRepetition())[:8] == [
        "--dataset-name", "prefix_repetition", "--num-prompts", "12",
        "--prefix-repetition-prefix-len", "768", "--prefix-repetition-suffix-len", "64",
    ]  # fmt: skip


def test_workloads_check_names_and_launch_skips_no_connector() -> None:
    with pytest.raises(ValueError, match="--systems: unknown system 'vllm'"):
        make_workloads(["prefix"], ["vllm"], None)
    with pytest.raises(ValueError, match="--workloads: unknown workload 'trace'"):
        make_workloads(["trace"], ["none"], None)
    with pytest.raises(ValueError, match="--requests 3: prefix needs at least 6"):
        make_workloads(["prefix"], ["none"], 3)
    launch, trace = make_workloads(
        ["launch", "trace-synthetic"], ["none", "kvshelf", "lmcache"], None
    )
    assert launch.systems == ("kvshelf", "lmcache") and launch.lazy_only
    assert trace.trace == "synthetic" and trace.requests == 100


def test_only_the_prefix_workload_runs_the_ideal_cache_sized_for_all_of_it() -> None:
    prefix, launch, trace = make_workloads(
        ["prefix", "launch", "trace-conversation"], ["ideal", "kvshelf"], None
    )
    assert prefix.systems == ("ideal", "kvshelf")
    assert launch.systems == trace.systems == ("kvshelf",)
    # 8 prefixes of 24 blocks, 48 tails of 128 + 16 tokens (3 blocks each), the null block.
    assert ideal_gpu_blocks(prefix, 1.0, PrefixRepetition()) == 8 * 24 + 48 * 3 + 1
    # At 0.25: prefixes of 384 tokens (6 blocks), tails of 32 + 16 tokens (1 block).
    assert ideal_gpu_blocks(prefix, 0.25, PrefixRepetition()) == 8 * 6 + 48 * 1 + 1


def _result(ttfts_s: list[float], throughput: float) -> dict[str, object]:
    ms = sorted(t * 1000 for t in ttfts_s)
    return {
        "completed": len(ttfts_s), "failed": 0, "duration": 10.0,
        "total_token_throughput": throughput, "output_throughput": throughput / 10,
        "mean_ttft_ms": sum(ms) / len(ms), "median_ttft_ms": ms[len(ms) // 2],
        "p90_ttft_ms": ms[-1], "p99_ttft_ms": ms[-1], "ttfts": ttfts_s,
    }  # fmt: skip


def _row(
    workload: str, system: str, ttfts_s: list[float], throughput: float, groups: list[int] | None
) -> dict[str, object]:
    before = {"external_hit_tokens": 100.0, "local_hit_tokens": 0.0}
    after = {"external_hit_tokens": 1100.0, "local_hit_tokens": 64.0}
    result = _result(ttfts_s, throughput)
    return {
        "workload": workload,
        "system": system,
        **report.summarize(result, before, after, groups),
    }


def test_rows_split_misses_by_prefix_group_and_ratios_stay_within_a_workload() -> None:
    groups = [0, 1, 0, 1]
    rows = [
        _row("prefix", "none", [2, 2, 1, 1], 100.0, groups),
        _row("prefix", "kvshelf", [3, 1, 0.5, 0.5], 200.0, groups),
        _row("prefix", "lmcache", [2, 2, 0.5, 0.5], 160.0, groups),
        _row("trace-synthetic", "kvshelf", [1, 1], 50.0, None),
    ]
    report.add_ratios(rows)
    kvshelf = rows[1]
    # Requests 0 and 1 are the first of their prefixes: misses.
    assert kvshelf["miss_ttft_ms"] == [3000, 1000] and kvshelf["miss_ttft_mean_ms"] == 2000
    assert kvshelf["hit_ttft_mean_ms"] == 500
    assert kvshelf["external_hit_tokens"] == 1000 and kvshelf["local_hit_tokens"] == 64
    assert kvshelf["throughput_tok_s_vs_lmcache"] == 1.25
    assert kvshelf["throughput_tok_s_vs_none"] == 2.0
    assert kvshelf["ttft_p99_ms_vs_lmcache"] == 1.5
    # No LMCache or none row in the trace workload: no ratio, not a ratio to another workload.
    assert rows[3]["throughput_tok_s_vs_lmcache"] is None
    assert rows[3]["throughput_tok_s_vs_none"] is None
    assert "miss_ttft_mean_ms" not in rows[3]
    table = report.workload_table(rows[:3])
    line = "| kvshelf | 4 | 10.0 | 200 | 1250 / 1000 / 3000 / 3000 | 2000 | 1000 | 64 |"
    assert f"{line} 1.25, 1.00, 1.50 | 2.00, 0.83, 1.50 |" in table


def test_page_section_is_replaced_between_the_markers_only(tmp_path: Path) -> None:
    rows = [_row("prefix", "none", [1, 1], 10.0, None)]
    report.add_ratios(rows)
    document = {
        "meta": {
            "command": "python -m benchmarks.serve", "started": "today", "machine": "x",
            "wall_s": 60.0, "versions": {"vllm": "0.32", "lmcache": "0.5.6"},
            "model": "tiny", "block_size": 64, "gpu_blocks": 64, "concurrency": 2, "scale": 1.0,
            "workloads": [{"name": "prefix", "description": "the prefix run."}],
            "skipped": [],
        },
        "rows": rows,
    }  # fmt: skip
    page = tmp_path / "performance.md"
    marked = "<!-- serve:start (generated) -->\nOLD TEXT\n<!-- serve:end -->"
    page.write_text(f"before\n{marked}\nafter\n")
    report.update_page(document, page)
    text = page.read_text()
    assert text.startswith("before\n<!-- serve:start (generated) -->\n")
    assert text.endswith("<!-- serve:end -->\nafter\n") and "OLD TEXT" not in text
    assert "**prefix**: the prefix run." in text and "| none | 2 |" in text
    json.dumps(document)  # the document stays JSON
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="serve:start"):
        report.update_page(document, page)
