"""Lazy EVICTION_AWARE offload across a kvshelf server SIGKILL and restart (issue 15).

vLLM's real Scheduler and BlockPool with the connector's both roles (`ConnectorRig`) and real
server processes: the server is killed with SIGKILL and restarted on the same port, empty
(``--no-adopt``) or adopting the dead server's arena. The conversations come back as in the
chaos benchmark (the same prompts again, after vLLM's own cache forgot them): their stores must
resume, later repeats must hit with the right bytes, and no block may stay protected.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshelf.lazy.offloader import LazyOffloader
from testbed.rig import ConnectorRig
from testbed.server import ServerProcess
from testbed.vllm_scheduler import make_request

BLOCK = 16
PROMPT_BLOCKS = 6
# Six prompts of seven blocks each cycle through a 24-block GPU cache: a prompt's blocks are
# always evicted from vLLM's cache by the time it comes back.
NUM_PROMPTS = 6
EVICTION_AWARE = {
    "lmcache.mp.lazy_offload": True,
    "lmcache.mp.lazy_offload_policy": "EVICTION_AWARE",
}


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(PROMPT_BLOCKS * BLOCK + 3)]


def make_rig(model: Path, server: ServerProcess) -> ConnectorRig:
    """A 24-block engine with lazy EVICTION_AWARE offload, on ``server``'s port."""
    return ConnectorRig(
        model,
        host=server.host,
        port=server.port,
        block_size=BLOCK,
        num_gpu_blocks=24,
        extra_config=EVICTION_AWARE,
    )


@contextlib.contextmanager
def lazy_rig(model: Path) -> Iterator[tuple[ServerProcess, ConnectorRig, LazyOffloader]]:
    """A server, and a rig (see `make_rig`) on its port with its lazy offloader."""
    with ServerProcess(l1_size_gb=1 / 16, lease_timeout_s=5.0) as server:
        rig = make_rig(model, server)
        try:
            lazy = rig.connector.lazy_offloader
            assert lazy is not None
            yield server, rig, lazy
        finally:
            rig.close()


def run_round(rig: ConnectorRig, name: str, seeds: list[int]) -> int:
    """Send each prompt once, one after the other, until all stores are done.

    Returns:
        The blocks loaded from kvshelf in this round, each checked bit for bit.
    """
    loaded = 0
    for seed in seeds:
        request = make_request(f"{name}-{seed}", prompt(seed), max_tokens=2, block_size=BLOCK)
        rig.add(request)
        scheduler_output, _ = rig.step_until_scheduled(request.request_id)
        for load in scheduler_output.kv_connector_metadata.plan.loads:
            assert rig.block_content_ok(request, len(load.block_ids))
            loaded += len(load.block_ids)
        rig.run()
    return loaded


def held_blocks(server: ServerProcess, rig: ConnectorRig, seeds: list[int]) -> list[int]:
    """How many leading blocks of each prompt the server holds."""
    pool = rig.worker.pool
    with server.client(timeout_s=5.0) as client:
        return [
            client.lookup(
                pool,
                list(make_request("q", prompt(s), max_tokens=1, block_size=BLOCK).block_hashes),
                world_size=1,
                lock=False,
            ).num_hit_blocks
            for s in seeds
        ]


@pytest.mark.parametrize("adopt", [False, True], ids=["no-adopt", "adopt"])
def test_eviction_aware_stores_again_after_a_server_sigkill_and_restart(
    tiny_model: Path, adopt: bool
) -> None:
    seeds = list(range(100, 100 + NUM_PROMPTS))
    with lazy_rig(tiny_model) as (first, rig, lazy):
        assert run_round(rig, "before", seeds) == 0
        assert held_blocks(first, rig, seeds) == [PROMPT_BLOCKS] * NUM_PROMPTS
        first.send_signal(signal.SIGKILL)
        restart_args = () if adopt else ("--no-adopt",)
        second = ServerProcess(
            l1_size_gb=1 / 16, lease_timeout_s=5.0, port=first.port, extra_args=restart_args
        )
        with second:
            drains = lazy.snapshot()["drains"]
            expected_held = PROMPT_BLOCKS if adopt else 0
            assert held_blocks(second, rig, seeds) == [expected_held] * NUM_PROMPTS
            # The same conversations come back: from the adopted arena they hit; after an
            # empty restart they miss once and are stored again.
            loaded = run_round(rig, "after", seeds)
            assert loaded == (NUM_PROMPTS * PROMPT_BLOCKS if adopt else 0)
            assert held_blocks(second, rig, seeds) == [PROMPT_BLOCKS] * NUM_PROMPTS
            if not adopt:
                assert lazy.snapshot()["drains"] > drains
            # New prompts are stored by the new server either way.
            fresh = list(range(200, 200 + NUM_PROMPTS))
            run_round(rig, "fresh", fresh)
            assert held_blocks(second, rig, fresh) == [PROMPT_BLOCKS] * NUM_PROMPTS
            # Later identical prompts hit, bit for bit.
            assert run_round(rig, "again", seeds) == NUM_PROMPTS * PROMPT_BLOCKS
            assert lazy.snapshot()["blocks_protected"] == 0
            assert all(block.ref_cnt == 0 for block in rig.block_pool.blocks[1:])
            with second.client(timeout_s=5.0) as client:
                assert client.stats()["resident_objects"] > 0


def test_eviction_aware_releases_a_drain_the_dead_server_dropped_and_stores_it_later(
    tiny_model: Path,
) -> None:
    with lazy_rig(tiny_model) as (first, rig, lazy):
        run_round(rig, "warm", [300])
        request = make_request("early", prompt(301), max_tokens=2, block_size=BLOCK)
        rig.add(request)
        while not request.is_finished():
            rig.step()
        # Finished next to eviction: protected, its drain comes on the next step.
        assert lazy.snapshot()["blocks_protected"] == PROMPT_BLOCKS
        first.send_signal(signal.SIGKILL)
        drains = lazy.snapshot()["drains"]
        rig.run()
        assert lazy.snapshot()["drains"] > drains
        assert lazy.snapshot()["blocks_protected"] == 0
        assert all(block.ref_cnt == 0 for block in rig.block_pool.blocks[1:])
        second = ServerProcess(
            l1_size_gb=1 / 16, lease_timeout_s=5.0, port=first.port, extra_args=["--no-adopt"]
        )
        with second:
            # Others push it out of vLLM's cache; when it comes back the store that was
            # dropped is made again (a store made before the worker's client saw the new
            # server is dropped too, and made again on the next return), and once stored
            # its next return hits.
            deadline = time.monotonic() + 30.0
            for attempt in itertools.count():
                run_round(rig, f"others{attempt}", list(range(310, 310 + NUM_PROMPTS)))
                assert run_round(rig, f"back{attempt}", [301]) == 0
                if held_blocks(second, rig, [301]) == [PROMPT_BLOCKS]:
                    break
                assert time.monotonic() < deadline, "never stored again"
            run_round(rig, "more", list(range(320, 320 + NUM_PROMPTS)))
            assert run_round(rig, "again", [301]) == PROMPT_BLOCKS
            assert lazy.snapshot()["blocks_protected"] == 0
