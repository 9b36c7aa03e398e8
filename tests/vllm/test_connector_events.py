"""kvshelf's KV events from vLLM's real Scheduler (no model: `ConnectorRig`), published by
vLLM's ZMQ publisher to a subscriber built from vLLM's own types.

A router must never be told a block is in kvshelf when it is not: no ``BlockStored`` ``CPU``
for a block whose store failed (no server) or was skipped by lazy offload's hash check.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from testbed.events import EventEndpoints, EventSubscriber, blocks
from testbed.rig import ConnectorRig
from testbed.server import ServerProcess, free_port
from testbed.vllm_scheduler import make_request

BLOCK = 16
LAZY = {
    "lmcache.mp.lazy_offload": True,
    "lmcache.mp.lazy_offload_policy": "FIFO",
    "lmcache.mp.lazy_offload_threshold": 2,
    "lmcache.mp.lazy_offload_select_count": 1,
}


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


def settle(rig: ConnectorRig, subscriber: EventSubscriber, seconds: float = 0.5) -> None:
    """Step on a little (the reader's log reads land within a step or two), then make sure
    the subscriber has every batch published so far."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rig.step()
        time.sleep(0.02)
    subscriber.replay(0)


def test_no_cpu_event_for_blocks_lazy_offload_skipped(tiny_model: Path) -> None:
    endpoints = EventEndpoints.free()
    with ServerProcess(l1_size_gb=1 / 16, lease_timeout_s=5.0) as server:
        rig = ConnectorRig(
            tiny_model,
            host=server.host,
            port=server.port,
            block_size=BLOCK,
            num_gpu_blocks=20,
            extra_config=LAZY,
            kv_events_config=endpoints.engine_config(),
        )
        subscriber = EventSubscriber(endpoints)
        try:
            victim = make_request(
                "victim", prompt(6, 6 * BLOCK + 2), max_tokens=1, block_size=BLOCK
            )
            rig.add(victim)
            rig.run()
            # A long prompt takes every free block: vLLM reuses the victim's blocks before
            # lazy offload drains them, so their hash check skips them.
            big = make_request("big", prompt(7, 18 * BLOCK), max_tokens=1, block_size=BLOCK)
            rig.add(big)
            rig.run()
            # Finished requests trigger the drains (two finished, one selected per drain).
            for i in range(4):
                trigger = prompt(8 + i, 2 * BLOCK)
                rig.add(make_request(f"t{i}", trigger, max_tokens=1, block_size=BLOCK))
                rig.run()
            settle(rig, subscriber)
            lazy = rig.connector.lazy_offloader
            assert lazy is not None and lazy.snapshot()["requests_skipped_hash_mismatch"] >= 1
            events = subscriber.events()
            gpu = {h for h, _, _ in blocks(events, "GPU")}
            cpu = {h for h, _, _ in blocks(events, "CPU")}
            victims = {maybe_convert_block_hash(h) for h in victim.block_hashes}
            assert victims <= gpu and not victims & cpu
            assert cpu, "the other requests' blocks were stored and advertised"
            # What was advertised is what the server holds.
            with server.client() as client:
                assert client.stats()["committed_objects_total"] == len(cpu)
        finally:
            subscriber.close()
            rig.close()


def test_no_cpu_event_when_stores_fail_and_none_without_events(tiny_model: Path) -> None:
    endpoints = EventEndpoints.free()
    # No server on this port: every store fails.
    rig = ConnectorRig(
        tiny_model,
        host="127.0.0.1",
        port=free_port(),
        block_size=BLOCK,
        extra_config={"kvshelf.request_timeout_s": 0.2, "kvshelf.reconnect_interval_s": 0.2},
        kv_events_config=endpoints.engine_config(),
    )
    subscriber = EventSubscriber(endpoints)
    try:
        rig.add(make_request("r", prompt(1, 4 * BLOCK + 3), max_tokens=2, block_size=BLOCK))
        rig.run()
        settle(rig, subscriber)
        events = subscriber.events()
        assert len(list(blocks(events, "GPU"))) >= 4
        assert list(blocks(events, "CPU")) == []
    finally:
        subscriber.close()
        rig.close()

    # vLLM's events off: the connector has nothing to publish.
    with ServerProcess(l1_size_gb=1 / 16, lease_timeout_s=5.0) as server:
        rig = ConnectorRig(tiny_model, host=server.host, port=server.port, block_size=BLOCK)
        try:
            rig.add(make_request("r", prompt(2, 4 * BLOCK + 3), max_tokens=2, block_size=BLOCK))
            rig.run()
            assert list(rig.connector.take_events()) == []
            with server.client() as client:
                stats = client.stats()
            assert stats["committed_objects_total"] == 4
        finally:
            rig.close()
