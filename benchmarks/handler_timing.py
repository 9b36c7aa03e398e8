"""What timing every request costs the server: lookup+release pairs with and without it.

``python -m benchmarks.handler_timing`` drives a :class:`RequestHandler` in this process
(no sockets, so the handler's own cost is all that is measured) through lookup+release pairs
of a 16-block hit, in alternating rounds with the request handling histograms on and off
(``kvshelf.metrics.SERVER_TIMINGS``), and prints one JSON line: seconds per pair each way and
their ratio, measured in the same run.
"""

from __future__ import annotations

import json
import os
import time

from kvshelf.protocol import Lookup, PageLayout, Release, Reserve, decode_reply, encode
from kvshelf.server import handler as handler_module
from kvshelf.server.handler import RequestHandler
from kvshelf.server.index import CacheIndex
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.shared_memory import ExtentAllocator, SharedMemoryArena

PAIRS = 20_000
ROUNDS = 10
BLOCKS = 16


def _pairs(handler: RequestHandler, lookup: bytes, count: int) -> float:
    """Seconds for ``count`` lookup+release pairs."""
    started = time.perf_counter()
    for _ in range(count):
        reply = decode_reply(handler.handle(b"peer", lookup))
        handler.handle(b"peer", encode(Release(request_id=2, lock_id=reply.lock_id, rank=0)))
    return time.perf_counter() - started


def main() -> None:
    memory = SharedMemoryArena(f"kvshelf-bench-timing-{os.getpid()}", 64 * 4096)
    try:
        arena = ArenaTier(ExtentAllocator(memory.size_bytes), eviction_watermark=1.0)
        index = CacheIndex([arena], lease_timeout_s=30.0)
        handler = RequestHandler(index, memory, boot_id="b" * 16)
        layout = PageLayout(
            model_fingerprint="m", layout_fingerprint="l", page_bytes=4096, world_size=1, rank=0
        )
        pool = index.register(layout).name
        hashes = [bytes([i]) * 32 for i in range(BLOCKS)]
        reserved = decode_reply(
            handler.handle(b"peer", encode(Reserve(request_id=1, pool=pool, rank=0, hashes=hashes)))
        )
        index.commit(reserved.reservation_id)
        lookup = encode(Lookup(request_id=1, pool=pool, hashes=hashes, world_size=1, lock=True))
        timings = handler_module._TIMINGS
        seconds = {"timed": 0.0, "untimed": 0.0}
        _pairs(handler, lookup, PAIRS // ROUNDS)  # warm-up
        for _ in range(ROUNDS):
            for mode in ("timed", "untimed"):
                handler_module._TIMINGS = timings if mode == "timed" else {}
                seconds[mode] += _pairs(handler, lookup, PAIRS // ROUNDS)
        handler_module._TIMINGS = timings
    finally:
        memory.close()
    print(
        json.dumps(
            {
                "pairs": PAIRS,
                "blocks_per_lookup": BLOCKS,
                "timed_us_per_pair": round(seconds["timed"] / PAIRS * 1e6, 2),
                "untimed_us_per_pair": round(seconds["untimed"] / PAIRS * 1e6, 2),
                "timed_over_untimed": round(seconds["timed"] / seconds["untimed"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
