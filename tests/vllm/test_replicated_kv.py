"""Tensor parallel with replicated KV, in vLLM's real Scheduler with a real server and one
worker side per rank (`ConnectorRig`): MLA's latent (every rank the same) and a single KV head
at TP=2 (vLLM gives both ranks that head) are stored once, exactly TP=1's objects and bytes,
and a fresh engine loads them on both ranks; sharded KV (KV heads >= ranks) is stored per rank
in the pool it always had.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from kvshelf.protocol import pool_name
from testbed.models import TINY, build_model
from testbed.rig import ConnectorRig
from testbed.server import ServerProcess
from testbed.vllm_scheduler import make_request

pytestmark = pytest.mark.vllm

BLOCK = 16
BLOCKS = 8


@pytest.fixture(scope="module")
def one_kv_head_model() -> Path:
    pytest.importorskip("transformers")
    return build_model(replace(TINY, num_kv_heads=1))


def prompt() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(3, 1000) for _ in range(BLOCKS * BLOCK + 5)]


def store_then_load(
    model: Path, tp: int, *, mla: bool = False
) -> tuple[dict[str, int], list[dict[str, int]], list[dict[str, int]], int]:
    """Store a prompt with one rig, load it with a fresh one, on one fresh server.

    Returns:
        The server's stats, each rank's counters of the storing and of the loading rig, and
        the storing rig's replicas.
    """
    with ServerProcess(l1_size_gb=1 / 16, lease_timeout_s=5.0) as server:
        rigs = []
        for name in ("first", "again"):
            rig = ConnectorRig(
                model,
                host=server.host,
                port=server.port,
                block_size=BLOCK,
                tensor_parallel_size=tp,
                mla=mla,
            )
            rigs.append(rig)
            try:
                request = make_request(name, prompt(), max_tokens=2, block_size=BLOCK)
                rig.add(request)
                if name == "again":
                    scheduler_output, _ = rig.step_until_scheduled(name)
                    (load,) = scheduler_output.kv_connector_metadata.plan.loads
                    assert len(load.block_ids) == BLOCKS
                    # Every rank holds exactly the bytes the storing engine computed.
                    assert rig.block_content_ok(request, BLOCKS)
                rig.run()
            finally:
                rig.close()
        stats = server.client().stats()
    first, again = rigs
    return (
        stats,
        [worker.snapshot() for worker in first.workers],
        [worker.snapshot() for worker in again.workers],
        first.kv_replicas,
    )


@pytest.mark.parametrize("kv", ["mla", "one KV head"])
def test_replicated_kv_at_tp2_stores_tp1s_bytes_and_both_ranks_load_them(
    kv: str, tiny_model: Path, one_kv_head_model: Path
) -> None:
    model, mla = (tiny_model, True) if kv == "mla" else (one_kv_head_model, False)
    stats1, stored1, _, replicas1 = store_then_load(model, 1, mla=mla)
    stats2, stored2, loaded2, replicas2 = store_then_load(model, 2, mla=mla)
    # Stored once: TP=1's objects and bytes, the copies shared by the two ranks.
    assert stats2["committed_objects_total"] == stats1["committed_objects_total"] == BLOCKS
    stored_bytes = stored1[0]["bytes_stored"]
    assert sum(rank["bytes_stored"] for rank in stored2) == stored_bytes
    assert all(rank["blocks_stored"] > 0 for rank in stored2)
    # A fresh engine hits the same tokens on both ranks, each loading all the stored bytes
    # and releasing its share of the lock.
    for rank in loaded2:
        assert rank["blocks_loaded"] == BLOCKS and rank["bytes_loaded"] == stored_bytes
        assert rank["blocks_load_failed"] == 0
    assert stats2["loaded_objects_total"] == 2 * BLOCKS
    assert stats2["active_locks"] == 0
    assert (replicas1, replicas2) == (1, 2)


def test_sharded_kv_at_tp2_is_stored_per_rank_in_the_pool_it_always_had(
    tiny_model: Path,
) -> None:
    """TINY has 2 KV heads: at TP=2 each rank its own, stored twice (as before)."""
    stats, stored, loaded, replicas = store_then_load(tiny_model, 2)
    assert replicas == 1
    assert stats["committed_objects_total"] == 2 * BLOCKS
    assert [rank["blocks_stored"] for rank in stored] == [BLOCKS, BLOCKS]
    assert [rank["blocks_loaded"] for rank in loaded] == [BLOCKS, BLOCKS]


def test_a_replicated_pool_is_named_apart_and_a_sharded_one_as_always(
    tiny_model: Path,
) -> None:
    with ServerProcess(l1_size_gb=1 / 16, lease_timeout_s=5.0) as server:
        for mla, expected_replicas in ((False, 1), (True, 2)):
            rig = ConnectorRig(
                tiny_model,
                host=server.host,
                port=server.port,
                block_size=BLOCK,
                tensor_parallel_size=2,
                mla=mla,
            )
            try:
                link = rig.worker._link
                legacy = pool_name(link._model_fingerprint, link._layout_fingerprint, 2)
                assert (rig.worker.pool == legacy) is (expected_replicas == 1)
                assert rig.worker.pool == pool_name(
                    link._model_fingerprint, link._layout_fingerprint, 2, expected_replicas
                )
            finally:
                rig.close()
