"""The load rows of ``make bench-e2e``: vLLM's OpenAI server under the multi-round QA workload.

One server per mode, behind that mode's cache backend; `benchmarks.e2e.multiround` drives
it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.e2e.api_server import ApiServer
from benchmarks.e2e.backends import cache_backend
from benchmarks.e2e.config import E2EConfig, Mode, model_name
from benchmarks.e2e.multiround import run_multi_round_qa
from testbed.models import ModelSpec, build_model


def openai_server_args(
    model: ModelSpec,
    *,
    block_size: int,
    max_model_len: int,
    gpu_blocks: int,
    max_num_seqs: int,
    kv_transfer_config: dict[str, Any] | None,
) -> list[str]:
    """Return the flags of a load server (after ``--model``): eager mode, a small KV cache.

    Args:
        model: The model (its dtype).
        block_size: vLLM's KV block size.
        max_model_len: ``--max-model-len``.
        gpu_blocks: ``--num-gpu-blocks-override``: below what the workload needs, so vLLM's
            prefix cache evicts.
        max_num_seqs: ``--max-num-seqs``.
        kv_transfer_config: The connector config, or None for no connector.

    Returns:
        The flags.
    """
    args = [
        "--dtype",
        model.dtype,
        "--enforce-eager",
        "--block-size",
        str(block_size),
        "--max-model-len",
        str(max_model_len),
        "--num-gpu-blocks-override",
        str(gpu_blocks),
        "--max-num-seqs",
        str(max_num_seqs),
        "--seed",
        "0",
        "--uvicorn-log-level",
        "warning",
    ]
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return args


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
            args = openai_server_args(
                model,
                block_size=config.block_size,
                max_model_len=workload.max_prompt_len + workload.answer_len + config.block_size,
                gpu_blocks=config.load_gpu_blocks,
                max_num_seqs=workload.users,
                kv_transfer_config=kv,
            )
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
