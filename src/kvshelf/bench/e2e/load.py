"""The load rows of ``make bench-e2e``: vLLM's OpenAI server under the multi-round QA workload.

One server per mode, behind that mode's cache backend; `kvshelf.bench.e2e.multiround` drives
it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvshelf.bench.e2e.api_server import ApiServer
from kvshelf.bench.e2e.backends import cache_backend
from kvshelf.bench.e2e.config import E2EConfig, Mode, model_name
from kvshelf.bench.e2e.multiround import run_multi_round_qa
from kvshelf.testbed.models import build_model


def run_load_rows(
    config: E2EConfig,
    modes: Sequence[Mode],
    env: dict[str, str],
    lmcache_python: Path | None,
    memcpy: dict[str, float],
) -> list[dict[str, Any]]:
    """Run the multi-round QA workload on vLLM's OpenAI server once per mode.

    Args:
        config: The run's configuration.
        modes: Modes to run.
        env: Engine environment (`engine_env`).
        lmcache_python: The peer venv's interpreter, or None.
        memcpy: The memcpy reference.

    Returns:
        One row per mode.
    """
    model = config.load_model
    path = str(build_model(model))
    workload = config.workload
    rows = []
    for mode in modes:
        with cache_backend(mode, config, config.load_cache_gib, lmcache_python) as (kv, python):
            args = [
                "--dtype",
                model.dtype,
                "--enforce-eager",
                "--block-size",
                str(config.block_size),
                "--max-model-len",
                str(workload.max_prompt_len + workload.answer_len + config.block_size),
                "--num-gpu-blocks-override",
                str(config.load_gpu_blocks),
                "--max-num-seqs",
                str(workload.users),
                "--seed",
                "0",
                "--uvicorn-log-level",
                "warning",
            ]
            if kv is not None:
                args += ["--kv-transfer-config", json.dumps(kv)]
            print(f"[load] {mode.name}: OpenAI server, multi-round QA", flush=True)
            server_env = {**os.environ, **env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
            with ApiServer(python, path, args, server_env) as server:
                result = run_multi_round_qa(server, path, workload)
        rows.append(
            {
                "mode": mode.name,
                "workload": "multi-round-qa",
                "model": model_name(model),
                "prompt_len": workload.max_prompt_len,
                "ttft_s_median": result["ttft_p50_s"],
                "cached_tokens": result["local_hit_tokens"] + result["external_hit_tokens"],
                "kv_bytes": None,
                "load_gbps": None,
                "store_overhead": None,
                **memcpy,
                **{k: v for k, v in result.items() if k != "per_request"},
                "request_ttft_s": [r["ttft_s"] for r in result["per_request"]],
            }
        )
    return rows
