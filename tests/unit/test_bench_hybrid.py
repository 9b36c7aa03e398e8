"""``make bench-hybrid``'s pieces that need no engine: the error line a row that could not run
carries, LMCache's chunk size per model, the table and the flags, the rows of a model vLLM
cannot cache here (MLA without AMX), TP=2's thread binding; and ``make
bench-hybrid-decode``'s paired comparison. (The benchmarks themselves start several vLLM
engines, many minutes here: they run as ``make bench-hybrid`` and ``make bench-hybrid-decode``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.hybrid import (
    MODELS,
    HybridModel,
    error_line,
    format_table,
    main,
    measure,
    threads_bind,
)
from testbed.mla_models import VLLM_MLA_NO_PREFIX_CACHING, mla_prefix_caching_refusal

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
        "gpt-oss-like-h1024-4sw4full": 256,
        "deepseek-v3-like-mla-h1024-tp1": 256,
        "deepseek-v3-like-mla-h1024-tp2": 256,
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
            "stored_bytes_per_prompt": 2.5 * 1024,
            "error": None,
            "note": "kvshelf disabled: MambaSpec",
        },
        {**common, "system": "lmcache", "error": "ValueError: no"},
    ]
    rows.append({**rows[0], "system": "vllm", "note": None, "stored_bytes_per_prompt": None})
    lines = format_table(rows).splitlines()
    figures = ["2048", "0", "1000.0", "1010.0", "1.010", "on", "True"]
    assert lines[1].split() == ["m", "kvshelf", *figures, "2.5"]
    assert lines[2].strip() == "kvshelf disabled: MambaSpec"
    assert lines[3].split() == ["m", "lmcache", "2048", "did", "not", "run"]
    assert lines[4].strip() == "ValueError: no"
    assert lines[5].split() == ["m", "vllm", *figures, "-"]


def test_an_unknown_model_is_named_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--models", "mistral-like-h1024-8sw,llama-9", "--out", str(tmp_path)])
    assert exited.value.code == 2
    assert "llama-9" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_model_vllm_cannot_cache_here_gives_rows_with_the_reason_and_builds_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def build(folder: Path) -> Path:
        raise AssertionError("built a model no row runs")

    model = HybridModel(build, "bfloat16", refusal=lambda: "no AMX here")
    monkeypatch.setitem(MODELS, "mla-like", model)
    rows = measure("mla-like", 64, 1, tmp_path, lmcache_python=tmp_path / "python")
    assert [(r["system"], r["error"]) for r in rows] == [
        ("vllm-prefix-cache", "skipped: no AMX here"),
        ("kvshelf", "skipped: no AMX here"),
        ("lmcache", "skipped: no AMX here"),
    ]
    assert format_table(rows).splitlines()[2].strip() == "skipped: no AMX here"
    assert not list(tmp_path.iterdir())


def test_mla_rows_are_refused_exactly_where_the_cpu_lacks_amx(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n")
    assert mla_prefix_caching_refusal(cpuinfo) is None
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    reason = mla_prefix_caching_refusal(cpuinfo)
    assert reason is not None and reason.endswith(VLLM_MLA_NO_PREFIX_CACHING)
    assert mla_prefix_caching_refusal(tmp_path / "absent") is not None
    mla = [m for name, m in MODELS.items() if name.startswith("deepseek-v3-like-mla")]
    assert [m.tensor_parallel_size for m in mla] == [1, 2]
    assert all(m.refusal is mla_prefix_caching_refusal for m in mla)


def test_tensor_parallel_two_binds_each_rank_to_half_the_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 5, 6})
    assert threads_bind(1) == {}
    assert threads_bind(2) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1,2|3,5,6"}


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
    from benchmarks.hybrid_decode import compare, summarize

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
