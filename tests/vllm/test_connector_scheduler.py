"""The connector inside vLLM's real Scheduler and BlockPool, with a real server and worker side.

No model runs: `ConnectorRig` makes up sampled tokens and fills computed blocks with a pattern
derived from each block's hash, so a load that brings back the wrong bytes is caught.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm.v1.request import Request

from testbed.rig import ConnectorRig
from testbed.server import ServerProcess
from testbed.vllm_scheduler import make_request

BLOCK = 16
LAZY = "lmcache.mp.lazy_offload"
THRESHOLD = "lmcache.mp.lazy_offload_threshold"
SELECT = "lmcache.mp.lazy_offload_select_count"
# The specified policy, named: the default is EVICTION_AWARE (LMCache 0.5.6's).
FIFO = {LAZY: True, "lmcache.mp.lazy_offload_policy": "FIFO"}


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    with ServerProcess(l1_size_gb=1 / 16, lease_timeout_s=5.0) as process:
        yield process


def make_rig(model: Path, server: ServerProcess, **kwargs: object) -> ConnectorRig:
    return ConnectorRig(model, host=server.host, port=server.port, block_size=BLOCK, **kwargs)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


def ref_counts(rig: ConnectorRig) -> list[int]:
    return [block.ref_cnt for block in rig.block_pool.blocks[1:]]


def hit_blocks(server: ServerProcess, rig: ConnectorRig, hashes: list[bytes]) -> int:
    with server.client() as client:
        pool = rig.worker.pool
        return client.lookup(pool, hashes, world_size=1, lock=False).num_hit_blocks


def test_eager_store_then_load_after_local_eviction(
    tiny_model: Path, server: ServerProcess
) -> None:
    rig = make_rig(tiny_model, server, num_gpu_blocks=24)
    try:
        first = make_request("first", prompt(1, 8 * BLOCK + 5), max_tokens=2, block_size=BLOCK)
        rig.add(first)
        rig.run()
        assert hit_blocks(server, rig, list(first.block_hashes)) == 8
        # Fill vLLM's small KV cache with other prompts so its prefix cache forgets `first`.
        for i in range(3):
            rig.add(
                make_request(
                    f"filler{i}", prompt(100 + i, 18 * BLOCK), max_tokens=1, block_size=BLOCK
                )
            )
            rig.run()
        again = make_request("again", prompt(1, 8 * BLOCK + 5), max_tokens=2, block_size=BLOCK)
        rig.add(again)
        scheduler_output, _ = rig.step_until_scheduled("again")
        plan = scheduler_output.kv_connector_metadata.plan
        assert [load.request_id for load in plan.loads] == ["again"]
        assert len(plan.loads[0].block_ids) == 8
        # The loaded blocks hold exactly the bytes `first` computed for them.
        assert rig.block_content_ok(again, 8)
        rig.run()
        assert rig.worker.counters["blocks_load_failed"] == 0
        assert all(count == 0 for count in ref_counts(rig))
    finally:
        rig.close()


def test_hit_never_covers_the_whole_prompt(tiny_model: Path, server: ServerProcess) -> None:
    rig = make_rig(tiny_model, server, num_gpu_blocks=24)
    try:
        exact = prompt(2, 4 * BLOCK)
        rig.add(make_request("a", exact, max_tokens=1, block_size=BLOCK))
        rig.run()
        for i in range(2):
            rig.add(
                make_request(f"f{i}", prompt(200 + i, 20 * BLOCK), max_tokens=1, block_size=BLOCK)
            )
            rig.run()
        again = make_request("b", exact, max_tokens=2, block_size=BLOCK)
        rig.add(again)
        scheduler_output, _ = rig.step_until_scheduled("b")
        # 4 full blocks are stored; vLLM must compute the last token, and a load is of whole
        # blocks, so the hit stops a block short (as vLLM's own prefix cache does): 3 blocks
        # are loaded and vLLM computes the 4th. Loading it would write the slot of the last
        # token in the step vLLM writes it (unordered on a GPU).
        (load,) = scheduler_output.kv_connector_metadata.plan.loads
        last_block = rig.scheduler.kv_cache_manager.get_block_ids("b")[0][3]
        assert len(load.block_ids) == 3 and last_block not in load.block_ids
        assert scheduler_output.num_scheduled_tokens["b"] == BLOCK
        assert rig.worker.counters["blocks_loaded"] == 3
        assert rig.block_content_ok(again, 4)
        rig.run()
    finally:
        rig.close()


def server_counter(server: ServerProcess, name: str) -> int:
    with server.client() as client:
        return client.stats()[name]


def test_a_prompt_vllm_holds_whole_is_neither_looked_up_nor_stored_again(
    tiny_model: Path, server: ServerProcess
) -> None:
    rig = make_rig(tiny_model, server, num_gpu_blocks=32)
    try:
        tokens = prompt(5, 4 * BLOCK)
        rig.add(make_request("a", tokens, max_tokens=1, block_size=BLOCK))
        rig.run()
        reserved = server_counter(server, "reservations_total")
        looked_up = server_counter(server, "lookup_requests_total")
        # The prompt plus one token: vLLM's own prefix cache holds all of its full blocks.
        again = make_request("b", [*tokens, 7], max_tokens=2, block_size=BLOCK)
        rig.add(again)
        scheduler_output, _ = rig.step_until_scheduled("b")
        assert scheduler_output.num_scheduled_tokens["b"] == 1
        plan = scheduler_output.kv_connector_metadata.plan
        assert plan.loads == () and plan.stores == ()
        rig.run()
        assert server_counter(server, "lookup_requests_total") == looked_up
        assert server_counter(server, "reservations_total") == reserved
        # Its new full block, once decoded, is stored as usual.
        grown = make_request("c", [*tokens, *prompt(6, BLOCK + 1)], max_tokens=1, block_size=BLOCK)
        rig.add(grown)
        rig.run()
        assert hit_blocks(server, rig, list(grown.block_hashes)) == 5
    finally:
        rig.close()


def test_blocks_vllm_holds_are_stored_again_when_a_lookup_shows_them_missing(
    tiny_model: Path, server: ServerProcess
) -> None:
    rig = make_rig(tiny_model, server, num_gpu_blocks=32)
    try:
        tokens = prompt(7, 4 * BLOCK)
        rig.add(make_request("a", tokens, max_tokens=1, block_size=BLOCK))
        rig.run()
        # A fresh server: nothing of `a` is stored anymore, vLLM still holds its 4 blocks.
        server.restart()
        longer = make_request("b", [*tokens, *prompt(8, 2 * BLOCK)], max_tokens=1, block_size=BLOCK)
        rig.add(longer)
        rig.run()
        assert hit_blocks(server, rig, list(longer.block_hashes)) == 6
    finally:
        rig.close()


def test_eager_keeps_blocks_until_the_worker_reports(
    tiny_model: Path, server: ServerProcess
) -> None:
    rig = make_rig(tiny_model, server, num_gpu_blocks=32)
    try:
        request = make_request("r", prompt(3, 4 * BLOCK + 3), max_tokens=1, block_size=BLOCK)
        rig.add(request)
        rig.hold_reports = True
        rig.step_until_scheduled("r")
        assert request.is_finished()
        # The store is not confirmed: vLLM was told to delay the free.
        assert rig.scheduler.requests.get("r") is request
        assert sum(ref_counts(rig)) > 0
        rig.hold_reports = False
        rig.run()
        assert "r" not in rig.scheduler.requests
        assert all(count == 0 for count in ref_counts(rig))
    finally:
        rig.close()


def test_lazy_no_drain_on_a_step_without_scheduled_tokens(
    tiny_model: Path, server: ServerProcess
) -> None:
    rig = make_rig(tiny_model, server, extra_config={**FIFO, THRESHOLD: 1, SELECT: 10})
    try:
        request = make_request("r", prompt(4, 3 * BLOCK + 1), max_tokens=1, block_size=BLOCK)
        rig.add(request)
        rig.run()
        lazy = rig.connector.lazy_offloader
        assert lazy is not None
        assert lazy.snapshot()["ready_requests"] == 1
        scheduler_output, _ = rig.step()
        assert scheduler_output.total_num_scheduled_tokens == 0
        assert scheduler_output.kv_connector_metadata.plan.stores == ()
        assert lazy.snapshot()["drains"] == 0 and lazy.snapshot()["ready_requests"] == 1
        assert hit_blocks(server, rig, list(request.block_hashes)) == 0
        # The next step with work triggers the drain and stores the finished request.
        rig.add(make_request("next", prompt(5, 2 * BLOCK), max_tokens=1, block_size=BLOCK))
        scheduler_output, _ = rig.step_until_scheduled("next")
        assert [s.request_id for s in scheduler_output.kv_connector_metadata.plan.stores] == ["r"]
        rig.run()
        assert hit_blocks(server, rig, list(request.block_hashes)) == 3
    finally:
        rig.close()


def test_lazy_skips_blocks_reused_before_the_drain(
    tiny_model: Path, server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    rig = make_rig(
        tiny_model, server, num_gpu_blocks=20, extra_config={**FIFO, THRESHOLD: 2, SELECT: 1}
    )
    try:
        victim = make_request("victim", prompt(6, 6 * BLOCK + 2), max_tokens=1, block_size=BLOCK)
        rig.add(victim)
        rig.run()
        # A long prompt takes every free block, so vLLM reuses the victim's blocks.
        rig.add(make_request("big", prompt(7, 18 * BLOCK), max_tokens=1, block_size=BLOCK))
        with caplog.at_level(logging.WARNING, logger="kvshelf"):
            rig.run()
            rig.add(make_request("trigger", prompt(8, BLOCK), max_tokens=1, block_size=BLOCK))
            rig.run()
        assert "Part block hashes mismatch for request victim, skip it" in caplog.messages
        lazy = rig.connector.lazy_offloader
        assert lazy is not None and lazy.snapshot()["requests_skipped_hash_mismatch"] >= 1
        assert hit_blocks(server, rig, list(victim.block_hashes)) == 0
        assert all(count == 0 for count in ref_counts(rig))
    finally:
        rig.close()


def test_lazy_protects_blocks_until_reported_then_restores_baseline(
    tiny_model: Path, server: ServerProcess
) -> None:
    rig = make_rig(tiny_model, server, extra_config={**FIFO, THRESHOLD: 1, SELECT: 1})
    try:
        first = make_request("first", prompt(9, 3 * BLOCK + 1), max_tokens=1, block_size=BLOCK)
        rig.add(first)
        rig.run()
        baseline = ref_counts(rig)
        rig.hold_reports = True
        rig.add(make_request("second", prompt(10, BLOCK), max_tokens=1, block_size=BLOCK))
        scheduler_output, _ = rig.step_until_scheduled("second")
        stores = scheduler_output.kv_connector_metadata.plan.stores
        assert [s.request_id for s in stores] == ["first"]
        protected = [b for s in stores for b in s.block_ids]
        for block_id in protected:
            assert rig.block_pool.blocks[block_id].ref_cnt == baseline[block_id - 1] + 1
        rig.hold_reports = False
        rig.step()
        for block_id in protected:
            assert rig.block_pool.blocks[block_id].ref_cnt == 0
        rig.run()
        lazy = rig.connector.lazy_offloader
        assert lazy is not None and lazy.snapshot()["blocks_protected"] == 0
    finally:
        rig.close()


@pytest.mark.parametrize(
    "policy_config",
    [{**FIFO, THRESHOLD: 5, SELECT: 3}, {"lmcache.mp.lazy_offload_policy": "EVICTION_AWARE"}],
    ids=["fifo", "eviction-aware"],
)
def test_lazy_hundreds_of_requests_leave_no_block_protected(
    tiny_model: Path, server: ServerProcess, policy_config: dict[str, object]
) -> None:
    rig = make_rig(
        tiny_model,
        server,
        num_gpu_blocks=48,
        max_num_seqs=8,
        extra_config={LAZY: True, **policy_config},
    )
    try:
        rng = random.Random(11)
        shared = prompt(12, 3 * BLOCK)
        for i in range(240):
            tail = prompt(1000 + i, rng.randrange(1, 3 * BLOCK))
            rig.add(
                make_request(
                    f"r{i}", shared + tail, max_tokens=rng.randrange(1, 4), block_size=BLOCK
                )
            )
            if i % 6 == 5:
                rig.run()
        rig.run()
        lazy = rig.connector.lazy_offloader
        assert lazy is not None
        stats = lazy.snapshot()
        assert stats["requests_submitted"] > 0 and stats["lazy_blocks_stored"] > 0
        assert stats["blocks_protected"] == 0
        # The counters reach vLLM's own stats (the scheduler merges connector stats each step).
        # (vLLM gets them on steps where some counter moved or a gauge is not zero.)
        rig.add(make_request("last", shared + [7] * BLOCK, max_tokens=1, block_size=BLOCK))
        reported = None
        while reported is None and rig.scheduler.has_requests():
            _, outputs = rig.step()
            reported = outputs.scheduler_stats.kv_connector_stats
        assert reported is not None
        assert reported["buffered_requests"] == lazy.snapshot()["buffered_requests"]
        assert {"drains", "requests_submitted", "blocks_protected"} <= set(reported)
        rig.run()
        assert lazy.snapshot()["blocks_protected"] == 0
        assert all(count == 0 for count in ref_counts(rig))
    finally:
        rig.close()


EVICTION_AWARE = {LAZY: True, "lmcache.mp.lazy_offload_policy": "EVICTION_AWARE"}


def test_eviction_aware_stores_blocks_before_vllm_evicts_them(
    tiny_model: Path, server: ServerProcess
) -> None:
    # Each newcomer below takes 10 blocks in one step; a 24-block window sees a block about two
    # steps before vLLM evicts it.
    extra = {
        **EVICTION_AWARE,
        "lmcache.mp.lazy_offload_max_delay_ms": 600_000,
        "lmcache.mp.lazy_offload_eviction_window": 24,
    }
    rig = make_rig(tiny_model, server, num_gpu_blocks=96, extra_config=extra)

    def step_until_finished(request: Request) -> None:
        while not request.is_finished():
            rig.step()

    try:
        # A long decode keeps every step busy: no idle flush, only the policy decides.
        busy = make_request("busy", prompt(19, BLOCK), max_tokens=400, block_size=BLOCK)
        rig.add(busy)
        early = make_request("early", prompt(20, 6 * BLOCK + 3), max_tokens=1, block_size=BLOCK)
        rig.add(early)
        step_until_finished(early)
        for _ in range(3):
            rig.step()
        lazy = rig.connector.lazy_offloader
        assert lazy is not None
        # Far from eviction (vLLM has plenty of free blocks): kept in vLLM's cache, not stored.
        assert lazy.snapshot()["buffered_requests"] == 1
        assert hit_blocks(server, rig, list(early.block_hashes)) == 0
        # New prompts consume the free queue; just before `early`'s blocks are reused, they
        # are stored (which sends them to the back of the queue), and once vLLM has evicted
        # them after all, the repeat loads them from kvshelf.
        for i in range(20):
            newcomer = make_request(
                f"n{i}", prompt(40 + i, 9 * BLOCK), max_tokens=1, block_size=BLOCK
            )
            rig.add(newcomer)
            step_until_finished(newcomer)
        assert hit_blocks(server, rig, list(early.block_hashes)) == 6
        assert lazy.snapshot()["requests_flushed"] == 0
        again = make_request("again", prompt(20, 6 * BLOCK + 3), max_tokens=2, block_size=BLOCK)
        rig.add(again)
        scheduler_output, _ = rig.step_until_scheduled("again")
        loads = scheduler_output.kv_connector_metadata.plan.loads
        assert len(loads) == 1 and len(loads[0].block_ids) == 6
        assert rig.block_content_ok(again, 6)
        rig.run()
        assert lazy.snapshot()["blocks_protected"] == 0
    finally:
        rig.close()


def test_eviction_aware_flushes_the_tail_when_traffic_stops(
    tiny_model: Path, server: ServerProcess
) -> None:
    rig = make_rig(tiny_model, server, num_gpu_blocks=64, extra_config=EVICTION_AWARE)
    try:
        requests = [
            make_request(f"t{i}", prompt(60 + i, 3 * BLOCK + 1), max_tokens=2, block_size=BLOCK)
            for i in range(5)
        ]
        for request in requests:
            rig.add(request)
        # run() steps while the connector reports pending work: idle steps flush the tail.
        rig.run()
        lazy = rig.connector.lazy_offloader
        assert lazy is not None
        assert (
            lazy.snapshot()["buffered_requests"] == 0 and lazy.snapshot()["blocks_protected"] == 0
        )
        for request in requests:
            assert hit_blocks(server, rig, list(request.block_hashes)) == 3
        assert all(count == 0 for count in ref_counts(rig))
    finally:
        rig.close()


def test_two_ranks_each_store_their_shard_and_a_store_counts_when_both_report(
    tiny_model: Path, server: ServerProcess
) -> None:
    rig = make_rig(tiny_model, server, num_gpu_blocks=24, tensor_parallel_size=2)
    try:
        first = make_request("first", prompt(30, 5 * BLOCK + 2), max_tokens=1, block_size=BLOCK)
        rig.add(first)
        rig.hold_reports = True
        rig.step_until_scheduled("first")
        # Both ranks stored (one object per block per rank), but the reports are withheld:
        # the scheduler still counts the store as in flight.
        assert server.client().stats()["committed_objects_total"] == 2 * 5
        assert rig.connector._scheduler.snapshot()["inflight_store_requests"] == 1
        rig.hold_reports = False
        rig.run()
        assert rig.connector._scheduler.snapshot()["inflight_store_requests"] == 0
        with server.client() as client:
            hit = client.lookup(rig.worker.pool, list(first.block_hashes), world_size=2, lock=False)
        assert hit.num_hit_blocks == 5
        for i in range(2):
            rig.add(
                make_request(f"f{i}", prompt(300 + i, 20 * BLOCK), max_tokens=1, block_size=BLOCK)
            )
            rig.run()
        again = make_request("again", prompt(30, 5 * BLOCK + 2), max_tokens=2, block_size=BLOCK)
        rig.add(again)
        scheduler_output, _ = rig.step_until_scheduled("again")
        (load,) = scheduler_output.kv_connector_metadata.plan.loads
        assert len(load.pages) == 2 and len(load.block_ids) == 5
        # Each rank loaded its own shard back.
        assert rig.block_content_ok(again, 5)
        rig.run()
    finally:
        rig.close()
