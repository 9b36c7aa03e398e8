"""What the server sees of the connector (vLLM's real Scheduler, a real worker side and server;
no model):

- the load counters tell the truth: ``loaded_objects_total`` counts the pages workers copied,
  ``locked_objects_total`` the pages lookups locked;
- vLLM's ``reset_cache()`` (its call after changing the weights in place) starts a new identity
  epoch: a random nonce the scheduler role sends to the workers in the step plan, so that
  lookups and stores of both roles move to a pool no earlier epoch and no other engine shares.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.prompts import random_tokens
from testbed.rig import ConnectorRig
from testbed.server import ServerProcess
from testbed.vllm_scheduler import make_request

BLOCK = 16


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    # Room for three pools' first extents.
    with ServerProcess(l1_size_gb=0.25, lease_timeout_s=5.0) as process:
        yield process


def make_rig(model: Path, server: ServerProcess) -> ConnectorRig:
    return ConnectorRig(model, host=server.host, port=server.port, block_size=BLOCK)


def test_loaded_counts_copied_pages_locked_counts_locked_pages(
    tiny_model: Path, server: ServerProcess
) -> None:
    prompt = random_tokens(8 * BLOCK + 5, seed=1)
    writer = make_rig(tiny_model, server)
    try:
        writer.add(make_request("first", prompt, max_tokens=2, block_size=BLOCK))
        writer.run()
    finally:
        writer.close()
    before = server.client().stats()

    reader = make_rig(tiny_model, server)
    try:
        # 3 full blocks and one token: the lookup locks 3 blocks, vLLM loads all 3.
        reader.add(make_request("short", prompt[: 3 * BLOCK + 1], max_tokens=1, block_size=BLOCK))
        reader.run()
        # The whole prompt: 3 blocks are in vLLM's own prefix cache now; the lookup locks the
        # 8 stored blocks, vLLM loads the 5 it lacks.
        again = make_request("again", prompt, max_tokens=1, block_size=BLOCK)
        reader.add(again)
        reader.run()
        assert reader.worker.counters["blocks_loaded"] == 3 + 5
    finally:
        reader.close()
    after = server.client().stats()
    assert after["loaded_objects_total"] - before["loaded_objects_total"] == 3 + 5
    assert after["locked_objects_total"] - before["locked_objects_total"] == 3 + 8
    assert after["locked_objects"] == 0


def stored_blocks(server: ServerProcess, pool: str, hashes: list[bytes]) -> int:
    with server.client() as client:
        return client.lookup(pool, hashes, world_size=1, lock=False).num_hit_blocks


def test_reset_cache_moves_both_roles_to_a_fresh_pool(
    tiny_model: Path, server: ServerProcess
) -> None:
    prompt = random_tokens(6 * BLOCK + 3, seed=1)
    rig = make_rig(tiny_model, server)
    try:
        first = make_request("first", prompt, max_tokens=1, block_size=BLOCK)
        rig.add(first)
        rig.run()
        old_pool = rig.worker.pool
        assert stored_blocks(server, old_pool, list(first.block_hashes)) == 6

        assert rig.connector.reset_cache() is True
        assert rig.scheduler.reset_prefix_cache()
        again = make_request("again", prompt, max_tokens=1, block_size=BLOCK)
        rig.add(again)
        scheduler_output, _ = rig.step_until_scheduled("again")
        plan = scheduler_output.kv_connector_metadata.plan
        # The old epoch's pages are never read again ...
        assert plan.loads == () and len(plan.identity_epoch) == 32
        rig.run()
        # ... and the workers stored the recomputed blocks into the new epoch's pool.
        new_pool = rig.worker.pool
        assert new_pool != old_pool
        assert stored_blocks(server, new_pool, list(again.block_hashes)) == 6
        # The old epoch's pool had no other holder: registering the new one retired it.
        assert server.client().stats()["pools"] == 1

        # A second reset: another nonce, another pool.
        rig.connector.reset_cache()
        assert rig.scheduler.reset_prefix_cache()
        third = make_request("third", prompt, max_tokens=1, block_size=BLOCK)
        rig.add(third)
        scheduler_output, _ = rig.step_until_scheduled("third")
        assert scheduler_output.kv_connector_metadata.plan.loads == ()
        assert scheduler_output.kv_connector_metadata.plan.identity_epoch != plan.identity_epoch
        rig.run()
        assert rig.worker.pool not in (old_pool, new_pool)
    finally:
        rig.close()
