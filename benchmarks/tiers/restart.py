"""How long the disk tier takes to restore its index at start, for a directory of small objects.

`restart_seconds` writes ``count`` objects of one 4 KiB page in the tier's format, then times
:meth:`~kvshelf.server.tiers.disk.DiskTier.attach` (the scan a starting server does) with a
real index. Imports neither torch nor vLLM.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvshelf.metric_types import Counters
from kvshelf.metrics import SERVER
from kvshelf.protocol import PageLayout, pool_name
from kvshelf.server.completions import Completions
from kvshelf.server.index import CacheIndex
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.disk import DiskTier
from kvshelf.server.tiers.disk_format import object_name, write_layout, write_object
from kvshelf.server.tiers.shared_memory import ExtentAllocator

PAGE = 4096
LAYOUT = PageLayout(
    model_fingerprint="bench", layout_fingerprint="restart", page_bytes=PAGE, world_size=1, rank=0
)


def restart_seconds(directory: Path, count: int) -> float:
    """Fill ``directory`` with ``count`` objects; return the seconds a restart's scan takes."""
    pool = pool_name(LAYOUT.model_fingerprint, LAYOUT.layout_fingerprint, 1)
    folder = directory / pool
    write_layout(str(folder), LAYOUT)
    payload = memoryview(bytes(PAGE))
    for i in range(count):
        block_hash = i.to_bytes(32, "big")
        path = str(folder / object_name(0, block_hash))
        write_object(path, str(folder / ".tmp-bench"), pool, 0, block_hash, payload)
    os.sync()
    counters = Counters(SERVER)
    arena = ArenaTier(ExtentAllocator(1 << 30), eviction_watermark=1.0, counters=counters)
    tier = DiskTier(str(directory), 1 << 40, counters, queue_bytes=1 << 20)
    completions = Completions()
    try:
        start = time.perf_counter()
        index = CacheIndex([arena, tier], lease_timeout_s=30.0, completions=completions)
        elapsed = time.perf_counter() - start
        assert index.stats()["l2_resident_objects"] == count
        index.close()
    finally:
        completions.close()
    return elapsed
