"""``make bench-hybrid``'s pieces that need no engine: the error line a row that could not run
carries, LMCache's chunk size per model, the table and the flags; and ``make
bench-hybrid-decode``'s paired comparison. (The benchmarks themselves start several vLLM
engines, many minutes here: they run as ``make bench-hybrid`` and ``make bench-hybrid-decode``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshelf.bench.hybrid import MODELS, error_line, format_table, main

# The shape of a vLLM engine's log when a connector fails in a worker at start-up: the root
# cause first, then the engine core and the parent wrapping it.
FAILED_START = """\
(EngineCore pid=10) INFO 12-02 04:02:30 [core.py:90] Initializing a V1 LLM engine
(Worker pid=20) ERROR 12-02 04:02:37 [multiproc_executor.py:1063] Traceback (most recent call last):
(Worker pid=20) ERROR 12-02 04:02:37 [multiproc_executor.py:1063]     raise ValueError(
(Worker pid=20) ERROR 12-02 04:02:37 [multiproc_executor.py:1063] ValueError: chunk size 256 \
must be a multiple of 96. Set --chunk-size to a multiple of 96.
(EngineCore pid=10) ERROR 12-02 04:02:37 [core.py:1510] RuntimeError: Worker failed with error \
'chunk size 256 must be a multiple of 96.', please check the stack trace above
vllm.exceptions.SomethingError: not this one either
RuntimeError: Engine core initialization failed. See root cause above.
"""


def test_error_line_is_the_root_cause_without_prefixes() -> None:
    assert error_line(FAILED_START) == (
        "ValueError: chunk size 256 must be a multiple of 96. Set --chunk-size to a multiple of 96."
    )


def test_error_line_drops_a_module_path_and_falls_back_to_the_last_line() -> None:
    assert error_line("x\nvllm.exceptions.VLLMValidationError: too long\n") == (
        "VLLMValidationError: too long"
    )
    assert error_line("starting\nKilled\n\n") == "Killed"
    assert error_line("") == "no output"


def test_lmcache_chunk_size_is_a_multiple_of_each_models_attention_block() -> None:
    sizes = {name: model.lmcache_chunk_size for name, model in MODELS.items()}
    assert sizes == {
        "gemma3-like-h1024-6sw2full": 256,
        "mistral-like-h1024-8sw": 256,
        "qwen3-next-like-h1024-6gdn2full": 288,
    }
    for name, model in MODELS.items():
        assert sizes[name] % model.attention_block == 0


def test_table_shows_figures_notes_and_rows_that_did_not_run() -> None:
    common = {"model": "m", "prompt_tokens": 2048}
    rows = [
        {
            **common,
            "system": "kvshelf",
            "hit_tokens_median": 0,
            "recompute_ttft_ms": 1000.0,
            "hit_ttft_ms": 1010.0,
            "hit_vs_recompute": 1.01,
            "hybrid_manager_on": True,
            "same_outputs": True,
            "error": None,
            "note": "kvshelf disabled: MambaSpec",
        },
        {**common, "system": "lmcache", "error": "ValueError: no"},
    ]
    lines = format_table(rows).splitlines()
    figures = ["2048", "0", "1000.0", "1010.0", "1.010", "on", "True"]
    assert lines[1].split() == ["m", "kvshelf", *figures]
    assert lines[2].strip() == "kvshelf disabled: MambaSpec"
    assert lines[3].split() == ["m", "lmcache", "2048", "did", "not", "run"]
    assert lines[4].strip() == "ValueError: no"


def test_an_unknown_model_is_named_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--models", "mistral-like-h1024-8sw,llama-9", "--out", str(tmp_path)])
    assert exited.value.code == 2
    assert "llama-9" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _engine_result(wall_s: float, timings: list[tuple[float, float]]) -> dict:
    requests = [
        {"ttft_s": ttft, "e2e_s": e2e, "token_ids": [1, 2, 3, 4, 5]} for ttft, e2e in timings
    ]
    return {
        "rounds": [
            {"wall_s": 1.0, "requests": requests[:1]},
            {"wall_s": wall_s, "requests": requests},
        ]
    }


def test_hybrid_decode_compares_paired_itl_and_throughput_of_the_measured_round() -> None:
    from kvshelf.bench.hybrid_decode import compare, summarize

    # 5 tokens: 4 gaps after the first. ITLs 100 and 200 ms: median 150.
    plain = summarize(_engine_result(2.0, [(0.1, 0.5), (0.2, 1.0)]), max_tokens=5)
    assert plain["itl_ms_median"] == pytest.approx(150.0)
    assert plain["itl_ms_p90"] == pytest.approx(200.0)
    assert plain["tokens_per_s"] == pytest.approx(5.0)  # 2 requests x 5 tokens in 2 s
    slower = summarize(_engine_result(2.2, [(0.1, 0.54), (0.2, 1.08)]), max_tokens=5)
    summary = compare([{"vllm": plain, "kvshelf": slower}])
    assert summary["itl_ratio"] == pytest.approx(165.0 / 150.0)
    assert summary["throughput_ratio"] == pytest.approx(2.0 / 2.2)
    assert not summary["itl_within_target"] and not summary["throughput_within_target"]
    assert summary["same_outputs"]
