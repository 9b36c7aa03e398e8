"""The disaggregated prefill example end to end: two vLLM OpenAI servers (a ``kv_producer``
and a ``kv_consumer``) sharing a kvshelf server, behind ``deploy/disagg_prefill_proxy.py``.

The proxy's answers must be the greedy answers of one engine, token for token, with the
decode engine loading each prompt from kvshelf (it stores nothing; the prefill engine makes
no lookup).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.e2e.api_server import ApiServer, read_counters
from testbed.prompts import random_tokens
from testbed.run_engine import kvshelf_transfer_config
from testbed.server import ServerProcess, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

PROXY = Path(__file__).resolve().parents[2] / "deploy" / "disagg_prefill_proxy.py"
BLOCK = 32
PROMPTS = [random_tokens(5 * BLOCK + 7, seed=700 + i) for i in range(2)]


def server_args(role: str, port: int) -> list[str]:
    transfer = {**kvshelf_transfer_config(port), "kv_role": role}
    return [
        "--dtype",
        "float32",
        "--enforce-eager",
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        "512",
        "--seed",
        "0",
        "--kv-transfer-config",
        json.dumps(transfer),
    ]


def complete(url: str, model: str, prompt: list[int], stream: bool = False) -> list[str]:
    """The greedy completion's text pieces (one per streamed event, or the whole text)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    with httpx.Client(timeout=120.0) as client:
        if not stream:
            response = client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            return [response.json()["choices"][0]["text"]]
        pieces = []
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
        return pieces


def test_proxy_answers_as_one_engine_with_the_decode_engine_loading_the_prompt(
    tiny_model: Path, vllm_env: dict[str, str]
) -> None:
    env = {**os.environ, **vllm_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    model = str(tiny_model)
    proxy_port = free_port()
    with (
        ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0) as kvshelf,
        ApiServer(sys.executable, model, server_args("kv_producer", kvshelf.port), env) as prefill,
        ApiServer(sys.executable, model, server_args("kv_consumer", kvshelf.port), env) as decode,
    ):
        proxy = subprocess.Popen(
            [
                sys.executable,
                str(PROXY),
                "--port",
                str(proxy_port),
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
            ],
        )
        try:
            url = f"http://127.0.0.1:{proxy_port}"
            deadline = time.monotonic() + 30
            while True:
                try:
                    httpx.get(f"{url}/health", timeout=2.0).raise_for_status()
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline, "the proxy did not come up"
                    time.sleep(0.2)
            before = read_counters(decode.url)
            answers = [
                complete(url, model, PROMPTS[0]),
                complete(url, model, PROMPTS[1], stream=True),
            ]
            after = read_counters(decode.url)
            with kvshelf.client() as client:
                stats = client.stats()
            # The same prompts on the prefill engine alone: one engine's greedy answers.
            reference = [complete(prefill.url, model, p) for p in PROMPTS]
        finally:
            proxy.terminate()
            proxy.wait(10)
    assert ["".join(a) for a in answers] == ["".join(r) for r in reference]
    assert len(answers[1]) > 1, "the streamed answer came as events"
    # The decode engine computed only each prompt's last token: 5 blocks each were loaded.
    loaded = after["external_hit_tokens"] - before["external_hit_tokens"]
    assert loaded == 2 * 5 * BLOCK
    assert stats["committed_objects_total"] == 2 * 5
    # Only the decode engine looked up (two prompts, maybe asked again), only prefill stored.
    assert stats["lookup_requests_total"] >= 2 and stats["reservations_total"] >= 1
