"""``make bench-hybrid``'s pieces that need no engine: the error line a row that could not run
carries, LMCache's chunk size per model, the table and the flags. (The benchmark itself starts
five vLLM engines per model, many minutes here: it runs as ``make bench-hybrid``.)"""

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
