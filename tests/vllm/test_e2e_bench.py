"""The end-to-end benchmark: its smallest real run (kvshelf only) and its pure helpers.

The real run starts a kvshelf server, real vLLM engines (recompute, storing run, hit run; in
single-process mode, which starts in seconds) and vLLM's OpenAI server under a tiny
multi-round load; it needs no ``.venv-peers`` (LMCache's rows are skipped with a message).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("httpx")  # comes with vLLM; the benchmark's load client uses it

from benchmarks.e2e.report import PERF_END, update_page
from benchmarks.e2e.targets import evaluate_targets
from benchmarks.e2e.ttft_prompts import (
    control_prompts,
    floor_prompt,
    hit_candidates,
    ttft_prompts,
)

COMMON_FIELDS = {
    "mode",
    "workload",
    "prompt_len",
    "ttft_s_median",
    "cached_tokens",
    "load_gbps",
    "memcpy_1t_gbps",
    "memcpy_2t_gbps",
    "store_overhead",
    "throughput_tok_s",
    "ttft_p99_s",
}

PAGE = """# x

## Performance

<!-- perf:start (regenerated; do not edit by hand) -->
old text
<!-- perf:end -->

## After
"""


@pytest.mark.vllm
@pytest.mark.engine
@pytest.mark.timeout(360)
def test_quick_kvshelf_run_writes_rows_plots_and_performance_page(
    tiny_model: Path, vllm_env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.e2e.cli import main

    page = tmp_path / "performance.md"
    page.write_text(PAGE)
    argv = ["--quick", "--lengths", "1000", "--ttft-modes", "none,kvshelf-eager"]
    argv += ["--load-modes", "kvshelf-eager", "--single-process", "--out", str(tmp_path)]
    assert main([*argv, "--page", str(page)]) == 0

    out = capsys.readouterr().out
    assert "SKIPPING LMCache rows" in out
    document = json.loads((tmp_path / "e2e.json").read_text())
    rows = document["rows"]
    assert [(r["mode"], r["workload"]) for r in rows] == [
        ("recompute", "ttft"),
        ("none", "ttft"),
        ("kvshelf-eager", "ttft"),
        ("kvshelf-eager", "multi-round-qa"),
    ]
    for row in rows:
        assert set(row) >= COMMON_FIELDS, row
        assert row["memcpy_1t_gbps"] > 0 and row["memcpy_2t_gbps"] > 0
    recompute, control, hit, load = rows
    assert recompute["ttft_s_median"] > 0 and recompute["cached_tokens"] == 0
    # The control pairs a connector-less engine A with R exactly like a storing run.
    assert control["ttft_s_median"] is None and control["store_overhead"] is not None
    assert len(control["storing_ttft_s"]) == 4 and len(control["storing_cpu_s"]) == 4
    # Every prompt came back from kvshelf in the fresh engine: all blocks but the last token's.
    assert hit["hit_cached_tokens"] == [896] * 4
    assert hit["floor_matches_hit"] is True
    # Every floor is paired with the no-connector floor engine's run of the same floor prompt.
    assert len(hit["no_connector_floor_ttft_s"]) == 4 and hit["no_connector_floor_matches"]
    assert hit["floor_vs_no_connector"] > 0 and len(hit["floor_vs_no_connector_ratios"]) == 4
    assert "floor / no connector" in out
    assert hit["kv_bytes"] > 0 and hit["store_overhead"] is not None
    assert len(hit["storing_cpu_s"]) == 4 and min(hit["recompute_cpu_s"]) > 0
    assert load["requests"] == 9 and load["throughput_tok_s"] > 0
    assert 0 < load["ttft_p50_s"] <= load["ttft_p99_s"]
    assert load["external_hit_tokens"] > 0
    assert (tmp_path / "e2e-ttft.png").stat().st_size > 0
    assert (tmp_path / "e2e-load.png").stat().st_size > 0
    text = page.read_text()
    assert "old text" not in text and "| kvshelf-eager |" in text
    assert text.startswith("# x\n\n## Performance\n\n<!-- perf:start (regenerated")
    assert text.endswith(f"{PERF_END}\n\n## After\n")


def test_hit_candidates_and_floor_prompt_compute_the_same_tokens() -> None:
    prompt = list(range(10, 4106))  # 4096 tokens
    assert hit_candidates(4096, 128) == [4095, 3968, 3840]
    assert hit_candidates(4000, 128) == [3968, 3840]
    assert hit_candidates(1000, 128) == [896, 768]
    floor = floor_prompt(prompt, 3968, 128, "s")
    assert len(floor) == 4096 and floor[:3968] == prompt[:3968] and floor[3968:] != prompt[3968:]
    # A hit of all but the last token: the whole prompt cached locally, one new token computed.
    floor = floor_prompt(prompt, 4095, 128, "s")
    assert len(floor) == 4097 and floor[:4096] == prompt


def test_targets_compare_within_the_run_and_report_missing_peers() -> None:
    def ttft(mode: str, hit: float, overhead: float, load: float) -> dict[str, object]:
        return {
            "workload": "ttft",
            "model": "perf",
            "mode": mode,
            "prompt_len": 4096,
            "ttft_s_median": hit,
            "store_overhead": overhead,
            "load_vs_memcpy_1t": load,
        }

    rows = [
        ttft("kvshelf-eager", 0.5, 0.02, 0.9),
        ttft("lmcache-eager", 1.0, 0.5, 0.3),
        ttft("kvshelf-lazy-fifo", 0.5, 0.02, 0.7),
    ]
    verdicts = {v["target"]: v["met"] for v in evaluate_targets(rows)}
    assert verdicts == {
        "perf 4096: kvshelf-eager hit TTFT / lmcache-eager hit TTFT": True,
        "perf 4096: kvshelf-eager load bandwidth / 1-thread memcpy": True,
        "perf 4096: kvshelf-lazy-fifo hit TTFT / lmcache-lazy-fifo hit TTFT": None,
        "perf 4096: kvshelf-lazy-fifo load bandwidth / 1-thread memcpy": False,
        "perf: kvshelf-eager storing TTFT / recompute TTFT - 1 (median of all paired "
        "prompts; worst length's median: +2.0%)": True,
        "perf: kvshelf-lazy-fifo storing TTFT / recompute TTFT - 1 (median of all paired "
        "prompts; worst length's median: +2.0%)": False,
    }


def test_floor_target_reads_the_paired_no_connector_ratio_of_kvshelf_rows() -> None:
    def row(mode: str, ratio: float | None) -> dict[str, object]:
        return {
            "workload": "ttft",
            "model": "perf",
            "mode": mode,
            "prompt_len": 4096,
            "ttft_s_median": 0.5,
            "store_overhead": 0.0,
            "load_vs_memcpy_1t": 1.0,
            "floor_vs_no_connector": ratio,
        }

    verdicts = evaluate_targets(
        [row("kvshelf-eager", 1.02), row("kvshelf-lazy-fifo", 1.2), row("lmcache-eager", 1.5)]
    )
    floors = {v["target"].split(":")[1].split()[0]: v for v in verdicts if "floor" in v["target"]}
    assert {mode: v["met"] for mode, v in floors.items()} == {
        "kvshelf-eager": True,
        "kvshelf-lazy-fifo": False,
    }
    assert floors["kvshelf-eager"]["limit"] == 1.03


def test_storing_target_pools_every_paired_prompt_and_quotes_the_control() -> None:
    def row(mode: str, length: int, overheads: list[float]) -> dict[str, object]:
        return {
            "workload": "ttft",
            "model": "perf",
            "mode": mode,
            "prompt_len": length,
            "ttft_s_median": None,
            "store_overhead": sorted(overheads)[len(overheads) // 2],
            "store_overheads": overheads,
        }

    rows = [
        row("none", 2048, [0.04, -0.02, 0.01]),
        row("none", 4096, [-0.05, 0.0, 0.02]),
        # One noisy length (median +5%) but a pooled median of +1%.
        row("kvshelf-eager", 2048, [0.0, 0.01, -0.01]),
        row("kvshelf-eager", 4096, [0.05, 0.06, 0.01]),
    ]
    (verdict,) = [v for v in evaluate_targets(rows) if "storing" in v["target"]]
    assert verdict["value"] == 0.01 and verdict["met"] is True
    assert "worst length's median: +5.0%" in verdict["target"]
    assert "control without connector: +0.5%" in verdict["target"]


def test_update_page_needs_both_markers(tmp_path: Path) -> None:
    page = tmp_path / "performance.md"
    page.write_text("# no markers\n")
    with pytest.raises(ValueError, match="markers"):
        update_page({}, page)


def test_the_control_measures_the_target_length_or_else_every_length() -> None:
    prompts = ttft_prompts([2048, 4096, 4000], 4)
    control = control_prompts(prompts, (4096,))
    assert [len(p) for p in control] == [4096] * 4
    assert control == [p for p in prompts if len(p) == 4096]
    assert control_prompts(prompts, (1000,)) == prompts
