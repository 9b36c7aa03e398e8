"""The lazy offload replay benchmark, end to end in its ``--quick`` configuration.

Real Scheduler and BlockPool, real connector, one real server per run, real KV page copies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


@pytest.mark.timeout(180)
def test_quick_replay_writes_rows_and_plot(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.replay.config import QUICK, available_modes
    from benchmarks.replay.report import FIELDS, format_header
    from benchmarks.replay.run import main

    assert main(["--quick", "--out", str(tmp_path)]) == 0

    assert format_header() in capsys.readouterr().out.splitlines()
    rows = json.loads((tmp_path / "lazy-replay.json").read_text())
    assert (tmp_path / "lazy-replay.png").stat().st_size > 0
    modes, _ = available_modes(QUICK.modes)
    assert {"none", "eager", "fifo-100", "fifo-20"} <= set(modes)
    expected = {
        (workload, concurrency, mode)
        for workload in QUICK.workloads
        for concurrency in QUICK.concurrencies
        for mode in modes
    }
    assert {(r["workload"], r["concurrency"], r["mode"]) for r in rows} == expected
    by_key = {(r["workload"], r["mode"]): r for r in rows}
    for row in rows:
        assert set(FIELDS) <= set(row), row
        assert row["protected_at_end"] == 0, row
        assert row["block_refs_at_end"] == 0, row
        assert 0.0 <= row["hit_rate"] <= 1.0
        assert row["hit_rate"] == pytest.approx(
            row["local_hit_rate"] + row["kvshelf_hit_rate"], abs=2e-4
        )
        if row["mode"] == "none":
            assert row["kvshelf_hit_rate"] == 0 and row["blocks_stored"] == 0
        if row["mode"] == "eager":
            assert row["blocks_stored"] > 0 and row["tail_unstored"] == 0
        if row["workload"] == "unique":
            assert row["hit_rate"] == 0
    assert by_key["chat", "eager"]["hit_rate"] > by_key["chat", "none"]["hit_rate"]
