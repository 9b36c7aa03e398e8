"""What kvshelf's KV events cost vLLM's scheduler step, per block.

``python -m benchmarks.event_cost`` measures the scheduler-thread work the events add, with
a real server and the real log reader (:mod:`kvshelf.roles.events`): describing the blocks of
a planned store (``blocks_planned``, vLLM's extra-keys helper included), and taking what the
reader read and turning it into vLLM's ``BlockStored``/``BlockRemoved`` events (``take`` and
``to_vllm``), for stored blocks and for evicted ones; and, for scale, what vLLM's own block
pool spends hashing the same blocks (``Request`` construction with its block hasher). The
server's commits stand in for the workers' (nothing is copied). Prints one JSON line: CPU
microseconds per block of each (this thread's CPU time), measured in one run.
"""

from __future__ import annotations

import json
import random
import time

from kvshelf.client import KVShelfClient
from kvshelf.protocol import PageLayout
from kvshelf.roles.events import EventReader, EventTracker
from kvshelf.vllm.events import describe_blocks, to_vllm
from testbed.server import ServerProcess
from testbed.vllm_scheduler import make_request

BLOCK = 16
BLOCKS_PER_REQUEST = 64
REQUESTS = 100
PAGE = 16 * 1024
# Arena pages: the later requests evict the earlier ones' blocks.
PAGES = BLOCKS_PER_REQUEST * REQUESTS // 2


def _wait_taken(tracker: EventTracker, expected: int, timeout_s: float = 10.0) -> tuple[int, float]:
    """Take until ``expected`` blocks' events came; returns (blocks, CPU seconds taking)."""
    taken = 0
    cpu_s = 0.0
    deadline = time.monotonic() + timeout_s
    while taken < expected and time.monotonic() < deadline:
        started = time.thread_time()
        events = to_vllm(tracker.take(), BLOCK)
        cpu_s += time.thread_time() - started
        taken += sum(len(getattr(e, "block_hashes", ())) for e in events)
        time.sleep(0.01)
    return taken, cpu_s


def main() -> None:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, 30000) for _ in range(BLOCKS_PER_REQUEST * BLOCK)]
        for _ in range(REQUESTS)
    ]
    started = time.thread_time()
    requests = [
        make_request(f"r{i}", p, max_tokens=1, block_size=BLOCK) for i, p in enumerate(prompts)
    ]
    hash_s = time.thread_time() - started
    layout = PageLayout(
        model_fingerprint="bench",
        layout_fingerprint="events",
        page_bytes=PAGE,
        world_size=1,
        rank=0,
    )
    with (
        ServerProcess(l1_size_gb=PAGES * PAGE / 2**30, eviction_watermark=1.0) as server,
        server.client() as client,
    ):
        pool = client.register(layout).pool
        reader = EventReader(KVShelfClient(server.host, server.port), pool)
        tracker = EventTracker(reader, lambda r, s, e: describe_blocks(BLOCK, r, s, e))
        plan_s = 0.0
        stored = removed = 0
        take_s = 0.0
        for request in requests:
            started = time.thread_time()
            tracker.blocks_planned(request, 0, BLOCKS_PER_REQUEST)
            plan_s += time.thread_time() - started
            hashes = [bytes(h) for h in request.block_hashes]
            before = client.stats()["evicted_objects_total"]
            client.commit(client.reserve(pool, 0, hashes).reservation_id)
            evicted = client.stats()["evicted_objects_total"] - before
            taken, cpu_s = _wait_taken(tracker, BLOCKS_PER_REQUEST + evicted)
            stored += BLOCKS_PER_REQUEST
            removed += evicted
            take_s += cpu_s
            assert taken == BLOCKS_PER_REQUEST + evicted, (taken, evicted)
        tracker.close()
    blocks = REQUESTS * BLOCKS_PER_REQUEST
    print(
        json.dumps(
            {
                "blocks": blocks,
                "block_size": BLOCK,
                "evicted_blocks": removed,
                "plan_us_per_block": round(plan_s / blocks * 1e6, 2),
                "take_us_per_event_block": round(take_s / (stored + removed) * 1e6, 2),
                "vllm_request_hashing_us_per_block": round(hash_s / blocks * 1e6, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
