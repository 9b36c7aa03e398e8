"""The index at scale: lookup cost per block and index memory per resident object.

In process, the server's own index and L1 tier (no shared memory behind it: pages are never
read, so none is needed) with pages of the smallest size, filled with ``objects`` resident
objects in chains of ``CHAIN`` blocks, evicting by the given policy. Then lookups of random
resident chains (no lock, and with a lock released at once, as a scheduler and its workers
do), timed per block. Memory: what Python allocated while filling (tracemalloc), per object:
the page, its key-table entry and its policy entries.

:func:`ping_under_lookups`: a real server holding ``objects`` objects, one client looking up
random resident chains as fast as it can, another timing pings meanwhile (and idle, before):
what a lookup of a big pool costs everyone else on the server's single loop.

Must not import torch or vLLM.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
import tracemalloc

from kvshelf.protocol import PageLayout
from kvshelf.server.index import CacheIndex
from kvshelf.server.limits import MIN_PAGE_BYTES
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.shared_memory import ExtentAllocator
from testbed.server import ServerProcess

CHAIN = 64
DEFAULT_SCALES = (10_000, 100_000, 1_000_000)
LAYOUT = PageLayout(
    model_fingerprint="scale",
    layout_fingerprint="blocks",
    page_bytes=MIN_PAGE_BYTES,
    world_size=1,
    rank=0,
)


def _key(chain: int, depth: int) -> bytes:
    return chain.to_bytes(8, "little") + depth.to_bytes(8, "little")


def measure(objects: int, policy: str, lookups: int = 2000) -> dict[str, float]:
    """Fill an index with ``objects`` resident objects and time lookups of it."""
    chains = objects // CHAIN
    tracemalloc.start()
    arena = ArenaTier(
        ExtentAllocator(chains * CHAIN * MIN_PAGE_BYTES),
        eviction_watermark=1.0,
        eviction_policy=policy,
    )
    index = CacheIndex([arena], lease_timeout_s=30.0)
    pool = index.register(LAYOUT).name
    before = tracemalloc.get_traced_memory()[0]
    for chain in range(chains):
        reservation, _ = index.reserve(pool, 0, [_key(chain, d) for d in range(CHAIN)], now=0.0)
        index.commit(reservation)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    resident = index.stats()["resident_objects"]
    assert resident == chains * CHAIN, resident
    rng = random.Random(0)
    asked = [[_key(c, d) for d in range(CHAIN)] for c in rng.choices(range(chains), k=lookups)]
    # One untimed pass first: every timed lookup is then of blocks looked up before, at every
    # size (without it, the small pools' repeats are timed against the big pools' first uses,
    # which cost a policy more: reuse's first hit of a page records its key).
    for hashes in asked:
        index.lookup(pool, hashes, 1, lock=False, now=0.0)
    started = time.perf_counter()
    for hashes in asked:
        index.lookup(pool, hashes, 1, lock=False, now=0.0)
    plain = time.perf_counter() - started
    started = time.perf_counter()
    for hashes in asked:
        _, lock_id, _ = index.lookup(pool, hashes, 1, lock=True, now=0.0)  # type: ignore[misc]
        index.release(lock_id, 0)
    locked = time.perf_counter() - started
    blocks = lookups * CHAIN
    return {
        "objects": resident,
        "policy": policy,
        "index_bytes_per_object": round((after - before) / resident, 1),
        "lookup_us_per_block": round(1e6 * plain / blocks, 3),
        "lookup_lock_release_us_per_block": round(1e6 * locked / blocks, 3),
        "dict_us_per_block": round(1e6 * _dict_reference(chains, asked) / blocks, 3),
    }


def _dict_reference(chains: int, asked: list[list[bytes]]) -> float:
    """Seconds for the same lookups in a bare dict of the same keys: what this machine's memory
    adds to any hash lookup as the table outgrows its caches, the floor under the index's
    growth."""
    table = {_key(c, d): c for c in range(chains) for d in range(CHAIN)}
    started = time.perf_counter()
    for hashes in asked:
        for key in hashes:
            table[key]
    return time.perf_counter() - started


def _ping_ms(client: object, seconds: float) -> list[float]:
    latencies = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter()
        client.ping()  # type: ignore[attr-defined]
        latencies.append(1e3 * (time.perf_counter() - started))
        time.sleep(0.001)
    return latencies


def _summary(latencies: list[float]) -> dict[str, float]:
    quantiles = statistics.quantiles(latencies, n=100)
    return {
        "pings": len(latencies),
        "p50_ms": round(quantiles[49], 3),
        "p99_ms": round(quantiles[98], 3),
        "max_ms": round(max(latencies), 3),
    }


def ping_under_lookups(objects: int, policy: str, seconds: float = 5.0) -> dict[str, object]:
    """Ping latency of a real server holding ``objects`` objects, idle and under lookups."""
    chains = objects // CHAIN
    with ServerProcess(
        l1_size_gb=chains * CHAIN * MIN_PAGE_BYTES / 2**30,
        eviction_watermark=1.0,
        extra_args=["--eviction-policy", policy, "--no-prefault", "--no-local-socket"],
        startup_timeout_s=120.0,
    ) as server:
        with server.client() as filler:
            pool = filler.register(LAYOUT).pool
            for chain in range(chains):
                reservation = filler.reserve(pool, 0, [_key(chain, d) for d in range(CHAIN)])
                filler.commit_nowait(reservation.reservation_id)
            resident = filler.stats()["resident_objects"]
        with server.client() as pinger:
            idle = _ping_ms(pinger, seconds)
            stop = threading.Event()
            looked_up = [0]

            def lookups() -> None:
                rng = random.Random(0)
                with server.client() as client:
                    while not stop.is_set():
                        chain = rng.randrange(chains)
                        hashes = [_key(chain, d) for d in range(CHAIN)]
                        client.lookup(pool, hashes, world_size=1, lock=False)
                        looked_up[0] += 1

            thread = threading.Thread(target=lookups)
            thread.start()
            try:
                busy = _ping_ms(pinger, seconds)
            finally:
                stop.set()
                thread.join()
    return {
        "objects": resident,
        "policy": policy,
        "ping_idle": _summary(idle),
        "ping_under_lookups": _summary(busy),
        "lookups_per_s": round(looked_up[0] / seconds, 1),
    }
