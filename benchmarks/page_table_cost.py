"""What the arena's page table costs a store: reserve and commit of 64 keys, with and without.

``python -m benchmarks.page_table_cost`` drives two :class:`CacheIndex` in this process (no
sockets: the index's own cost is all that is measured), one whose arena tier keeps the page
table of :mod:`kvshelf.server.page_table` up to date and one without, through stores of 64 new
keys each on a full arena (so every store also evicts 64 pages), in alternating rounds, and
prints one JSON line: CPU microseconds per reserve, per commit and per store each way, and
the stores' ratio, measured in one run.
"""

from __future__ import annotations

import itertools
import json
import os
import time

from kvshelf.protocol import PageLayout
from kvshelf.server.index import CacheIndex
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.shared_memory import ExtentAllocator, SharedMemoryArena

PAGE = 16 * 1024
PAGES = 2048
KEYS = 64
STORES = 4000
ROUNDS = 10


def _index(memory: SharedMemoryArena, table: bool) -> tuple[CacheIndex, str]:
    arena = ArenaTier(
        ExtentAllocator(memory.size_bytes),
        eviction_watermark=1.0,
        memory=memory,
        table=memory.table() if table else None,
    )
    index = CacheIndex([arena], lease_timeout_s=30.0)
    layout = PageLayout(
        model_fingerprint="m", layout_fingerprint="l", page_bytes=PAGE, world_size=1, rank=0
    )
    return index, index.register(layout).name


def _stores(
    index: CacheIndex, pool: str, names: itertools.count, count: int
) -> tuple[float, float]:
    """Seconds of the reserves and of the commits of ``count`` stores of ``KEYS`` new keys."""
    batches = [[next(names).to_bytes(32, "big") for _ in range(KEYS)] for _ in range(count)]
    # CPU time of this thread: what the socket loop would spend, unaffected by other
    # processes competing for the cores (wall time on a shared machine is not).
    clock = time.thread_time
    reserving = committing = 0.0
    for hashes in batches:
        started = clock()
        reservation_id, _ = index.reserve(pool, 0, hashes, now=0.0)
        reserved = clock()
        index.commit(reservation_id)
        reserving += reserved - started
        committing += clock() - reserved
    return reserving, committing


def main() -> None:
    memories = [
        SharedMemoryArena(f"kvshelf-bench-table-{mode}-{os.getpid()}", PAGES * PAGE)
        for mode in ("on", "off")
    ]
    try:
        runs = {
            "with_table": (*_index(memories[0], True), itertools.count()),
            "without_table": (*_index(memories[1], False), itertools.count()),
        }
        reserve = dict.fromkeys(runs, 0.0)
        commit = dict.fromkeys(runs, 0.0)
        for index, pool, names in runs.values():  # warm-up: fills the arena
            _stores(index, pool, names, 2 * PAGES // KEYS)
        for _ in range(ROUNDS):
            for mode, (index, pool, names) in runs.items():
                reserving, committing = _stores(index, pool, names, STORES // ROUNDS)
                reserve[mode] += reserving
                commit[mode] += committing
    finally:
        for memory in memories:
            memory.close()
    report: dict[str, float] = {"stores": STORES, "keys_per_store": KEYS}
    for step, seconds in (("reserve", reserve), ("commit", commit)):
        for mode in runs:
            report[f"{step}_{mode}_us"] = round(seconds[mode] / STORES * 1e6, 1)
    for mode in runs:
        report[f"store_{mode}_us"] = round((reserve[mode] + commit[mode]) / STORES * 1e6, 1)
    report["store_with_over_without"] = round(
        report["store_with_table_us"] / report["store_without_table_us"], 3
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
