"""Metrics after real vLLM runs: the server's /metrics after an engine stored and loaded through
it, and kvshelf's connector metrics in the /metrics of vLLM's OpenAI server."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from testbed.prompts import random_tokens
from testbed.run_engine import EngineSpec, run_engine
from testbed.server import ServerProcess, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

BLOCK = 32
# Three prompts of 5 full blocks and a tail: every full block is loadable.
PROMPTS = [random_tokens(5 * BLOCK + 7, seed=f"metrics-{i}") for i in range(3)]


def connector(port: int) -> dict[str, Any]:
    return {
        "kv_connector": "KVShelfConnector",
        "kv_connector_module_path": "kvshelf.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "127.0.0.1",
            "lmcache.mp.port": port,
            "kvshelf.request_timeout_s": 5.0,
        },
    }


def scrape(url: str) -> dict[str, float]:
    """Samples of a Prometheus endpoint, parsed with prometheus_client: ``name`` -> value summed
    over label sets."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if sample.name.endswith("_bucket"):
                key = f"{sample.name}{{le={sample.labels['le']}}}"
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def test_server_metrics_after_an_engine_stored_and_loaded(
    tiny_model: Path, vllm_env: dict[str, str]
) -> None:
    metrics_port = free_port()
    with ServerProcess(
        l1_size_gb=0.25, lease_timeout_s=10.0, extra_args=["--metrics-port", str(metrics_port)]
    ) as server:
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        before = scrape(url)
        # Round 1 computes and stores the prompts; round 2 (vLLM's prefix cache emptied) loads
        # them from kvshelf.
        run_engine(
            EngineSpec(
                model=str(tiny_model),
                rounds=[PROMPTS, PROMPTS],
                block_size=BLOCK,
                env=vllm_env,
                kv_transfer_config=connector(server.port),
                reset_prefix_cache_between_rounds=True,
            )
        )
        after = scrape(url)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz") as response:
            assert response.status == 200

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    blocks = 5 * len(PROMPTS)
    lookups = moved("kvshelf_lookup_requests_total")
    assert moved("kvshelf_committed_objects_total") == blocks
    assert moved("kvshelf_loaded_objects_total") == blocks
    assert moved("kvshelf_lookup_hit_objects_total") >= blocks
    # Every lookup asked for a prompt's 5 full blocks; each round-1 request missed at block 0.
    assert lookups >= 2 * len(PROMPTS)
    assert moved("kvshelf_lookup_requested_objects_total") == 5 * lookups
    assert moved("kvshelf_miss_never_stored_total") == len(PROMPTS)
    for reason in ("evicted", "rank_incomplete", "tier_error"):
        assert moved(f"kvshelf_miss_{reason}_total") == 0
    assert after["kvshelf_resident_objects"] == after["kvshelf_pool_resident_objects"] == blocks
    assert moved("kvshelf_lookup_duration_seconds_count") == lookups
    assert moved("kvshelf_release_duration_seconds_count") == len(PROMPTS)
    # The worker's store thread puts every job waiting when it wakes into one reserve.
    reserves = moved("kvshelf_reserve_duration_seconds_count")
    assert 1 <= reserves <= len(PROMPTS)
    assert moved("kvshelf_commit_duration_seconds_count") == reserves


def test_openai_server_metrics_show_the_connector(
    tiny_model: Path, vllm_env: dict[str, str]
) -> None:
    from benchmarks.e2e.api_server import ApiServer

    a, b, c = (random_tokens(11 * BLOCK + 7, seed=f"api-{i}") for i in range(3))
    with ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0) as server:
        args = [
            "--dtype",
            "float32",
            "--enforce-eager",
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            "512",
            # 30 blocks: A is (partly) evicted from vLLM's own cache by B and C, so A again
            # loads from kvshelf.
            "--num-gpu-blocks-override",
            "30",
            "--uvicorn-log-level",
            "warning",
            "--kv-transfer-config",
            json.dumps(connector(server.port)),
        ]
        env = {**os.environ, **vllm_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        with ApiServer(sys.executable, str(tiny_model), args, env) as api:
            for prompt in (a, b, c, a):
                body = {"model": str(tiny_model), "prompt": prompt, "max_tokens": 4}
                request = urllib.request.Request(
                    f"{api.url}/v1/completions",
                    data=json.dumps({**body, "temperature": 0.0}).encode(),
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(request, timeout=120) as response:
                    assert response.status == 200
            # Stats reach the frontend with the engine's outputs; the last ones may trail.
            deadline = time.monotonic() + 30.0
            while True:
                metrics = scrape(f"{api.url}/metrics")
                if metrics.get("kvshelf_connector_load_seconds_count", 0) >= 1:
                    break
                assert time.monotonic() < deadline, sorted(
                    k for k in metrics if k.startswith("kvshelf")
                )
                time.sleep(0.5)

    assert metrics["kvshelf_connector_lookups_total"] >= 4
    # A's blocks that vLLM's own cache lost by then are loaded from kvshelf.
    loaded = metrics["kvshelf_connector_blocks_loaded_total"]
    assert loaded >= 1 and metrics["kvshelf_connector_lookup_hit_blocks_total"] >= loaded
    hit_tokens = metrics["kvshelf_connector_hit_tokens_total"]
    assert hit_tokens == metrics["vllm:external_prefix_cache_hits_total"]
    assert (loaded - 1) * BLOCK < hit_tokens <= loaded * BLOCK
    assert metrics["kvshelf_connector_miss_never_stored_total"] == 3
    assert metrics["kvshelf_connector_blocks_stored_total"] >= 33
    assert metrics["kvshelf_connector_bytes_stored_total"] > 0
    assert metrics["kvshelf_connector_bytes_loaded_total"] > 0
    assert metrics["kvshelf_connector_store_seconds_count"] >= 3
    assert metrics["kvshelf_connector_blocks_load_failed_total"] == 0
    for name in ("buffered_requests", "blocks_protected", "drains_total", "stores_dropped_total"):
        assert f"kvshelf_connector_{name}" in metrics
