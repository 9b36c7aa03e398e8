"""vLLM's ``reset_cache()`` (its call after changing the weights in place) starts a new identity
epoch: a random nonce the scheduler role sends to the workers in the step plan, so that lookups
and stores of both roles move to a pool no earlier epoch and no other engine shares."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshelf.testbed.rig import ConnectorRig
from kvshelf.testbed.scheduler import make_request
from kvshelf.testbed.server import ServerProcess

BLOCK = 16


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    # Room for three pools' first extents.
    with ServerProcess(l1_size_gb=0.25, lease_timeout_s=5.0) as process:
        yield process


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


def stored_blocks(server: ServerProcess, pool: str, hashes: list[bytes]) -> int:
    with server.client() as client:
        return client.lookup(pool, hashes, world_size=1, lock=False).num_hit_blocks


def test_reset_cache_moves_both_roles_to_a_fresh_pool(
    tiny_model: Path, server: ServerProcess
) -> None:
    prompt = tokens(1, 6 * BLOCK + 3)
    rig = ConnectorRig(tiny_model, host=server.host, port=server.port, block_size=BLOCK)
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
        assert server.client().stats()["pools"] == 2

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
