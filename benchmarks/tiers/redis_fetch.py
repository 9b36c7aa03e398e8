"""A kvshelf server's fetch from Redis without an engine: the tier's own bandwidth and CPU.

Node one (a kvshelf server on the run's Redis) is given ``count`` pages of ``page_bytes``
random bytes through its arena, as a worker writes them, and writes them to Redis; node two
(L1 empty) then answers one locking lookup of them, which fetches every page from Redis into
its arena. ``fetch_gbps``: the page bytes over the lookup's wall time (asked again while
"pending", as the scheduler does); ``server_cpu_s_per_gb``: node two's CPU seconds (user +
system) over the same time per GB of values received. The pages are checked byte for byte
afterwards. With the engine's hits (:mod:`benchmarks.tiers.redis_hits`), node two's CPU
also pays for the engine's lookups and the writes of the blocks it computes; here it pays for
the fetch alone. Imports neither torch nor vLLM.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from kvshelf.protocol import PageLayout
from testbed.server import ServerProcess, map_arena_file

# Lookups answered "pending" before the fetch is given up.
MAX_ASKS = 2000


@dataclass(frozen=True)
class Fetch:
    """One fetch of ``count`` pages."""

    fetch_gbps: float
    server_cpu_s_per_gb: float
    seconds: float


def _node(url: str, secret_file: Path | None, arena_bytes: int) -> ServerProcess:
    extra = [
        "--l3-redis-url",
        url,
        *(["--l3-secret-file", str(secret_file)] if secret_file else []),
    ]
    return ServerProcess(l1_size_gb=arena_bytes / 2**30, extra_args=extra, startup_timeout_s=120.0)


def fetch_from_redis(
    url: str, secret_file: Path | None, page_bytes: int, count: int, value_bytes: int
) -> Fetch:
    """Store ``count`` pages through node one, fetch them on node two; see the module."""
    layout = PageLayout(
        model_fingerprint="bench-tiers-fetch",
        layout_fingerprint=f"pages-{page_bytes}",
        page_bytes=page_bytes,
        world_size=1,
        rank=0,
    )
    hashes = [os.urandom(32) for _ in range(count)]
    pages = [os.urandom(page_bytes) for _ in range(count)]
    arena_bytes = (count + 8) * page_bytes
    with _node(url, secret_file, arena_bytes) as one, one.client() as client:
        one.wait_zeroed()
        registration = client.register(layout)
        reservation = client.reserve(registration.pool, 0, hashes)
        arena = map_arena_file(registration.shm_name)
        try:
            for page, data in zip(reservation.pages, pages, strict=True):
                assert page is not None
                arena[page * page_bytes : (page + 1) * page_bytes] = data
        finally:
            arena.close()
        client.commit(reservation.reservation_id)
        while client.stats()["l3_stored_objects_total"] < count:
            assert client.stats()["l3_dropped_writes_total"] == 0, "writes dropped"
            time.sleep(0.05)
    with _node(url, secret_file, arena_bytes) as two, two.client() as client:
        two.wait_zeroed()
        registration = client.register(layout)
        process = psutil.Process(two.pid)
        cpu = sum(process.cpu_times()[:2])
        start = time.perf_counter()
        for _ in range(MAX_ASKS):
            result = client.lookup(registration.pool, hashes, world_size=1, lock=True)
            if not result.pending:
                break
        seconds = time.perf_counter() - start
        cpu = sum(process.cpu_times()[:2]) - cpu
        assert result.num_hit_blocks == count, f"{result.num_hit_blocks} of {count} fetched"
        arena = map_arena_file(registration.shm_name)
        try:
            for page, data in zip(result.pages[0], pages, strict=True):
                assert arena[page * page_bytes : (page + 1) * page_bytes] == data
        finally:
            arena.close()
        client.release(result.lock_id, 0)
    return Fetch(
        fetch_gbps=count * page_bytes / seconds / 1e9,
        server_cpu_s_per_gb=cpu / (count * value_bytes / 1e9),
        seconds=seconds,
    )
