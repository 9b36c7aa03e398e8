"""The trace replay through a real ``kvshelf server``: its eviction policy, its index, its loop.

One server per (trace, capacity, policy): an arena of ``capacity`` pages of the smallest size
(:data:`~kvshelf.server.limits.MIN_PAGE_BYTES`), eviction watermark 1, ``--eviction-policy``.
Each request's demand (:mod:`.traces`) is a lookup (no lock, so the server touches the hit
prefix and reports the block that ended it), then a reservation of the blocks after the hit
and its commit, as a connector stores what vLLM computed. No bytes are written: which pages
the server keeps does not depend on them.

With ``disk_blocks``, a disk tier (L2) of that many objects sits behind L1 (each 4 KiB object
is a file of two 4 KiB blocks, header and payload): every commit is written behind, L1 evicts
to it, and a lookup loads what L1 lacks from it (asked again while the answer is pending). The
disk tier evicts in the order of ``--l2-disk-eviction-policy``. After each store the replay
waits until the disk tier has written it: requests come back to back here, with none of the
seconds of compute that separate them in service, and without the wait the write queue (a
quarter of this tiny arena) overflows and most writes are dropped (18,121 of 28,655 in a
1,200-request smoke run), which measures the queue rather than the policy.

Must not import torch or vLLM.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence

from benchmarks.trace.traces import BLOCK_TOKENS, Demand
from kvshelf.client import KVShelfClient
from kvshelf.protocol import PageLayout
from kvshelf.server.limits import MIN_PAGE_BYTES
from testbed.server import ServerProcess

LAYOUT = PageLayout(
    model_fingerprint="trace",
    layout_fingerprint="blocks",
    page_bytes=MIN_PAGE_BYTES,
    world_size=1,
    rank=0,
)


def block_key(block: int) -> bytes:
    return block.to_bytes(16, "little")


_WRITE_OUTCOMES = ("l2_stored_objects_total", "l2_dropped_writes_total", "l2_errors_total")
# A replay is not a latency test: on a busy machine a disk tier's writes can hold a reply up.
CLIENT_TIMEOUT_S = 60.0
# A disk object of one 4 KiB page: a 4 KiB block of header and padding, then the payload.
DISK_BYTES_PER_OBJECT = 2 * MIN_PAGE_BYTES


def replay(
    stream: Sequence[Demand],
    capacity: int,
    policy: str | None,
    disk_blocks: int = 0,
    disk_policy: str | None = None,
) -> dict[str, int]:
    """Hit tokens and requested tokens of ``stream`` through a real server of ``capacity``
    pages evicting by ``policy`` (and a disk tier of ``disk_blocks`` objects behind it,
    evicting by ``disk_policy``); a policy of None is the server's default."""
    args = ["--no-local-socket"]
    if policy is not None:
        args += ["--eviction-policy", policy]
    with tempfile.TemporaryDirectory(prefix="kvshelf-trace-") as folder:
        if disk_blocks:
            disk_gb = disk_blocks * DISK_BYTES_PER_OBJECT / 2**30
            args += ["--l2-disk-path", folder, "--l2-disk-size-gb", repr(disk_gb)]
            if disk_policy is not None:
                args += ["--l2-disk-eviction-policy", disk_policy]
        return _replay(stream, capacity, args, bool(disk_blocks))


def _written(client: KVShelfClient, committed: int) -> None:
    """Wait until the disk tier has written (or failed) every committed object."""
    while True:
        stats = client.stats()
        done = sum(stats.get(k, 0) for k in _WRITE_OUTCOMES)
        if done >= committed:
            return
        time.sleep(0.001)


def _replay(stream: Sequence[Demand], capacity: int, args: list[str], disk: bool) -> dict[str, int]:
    hit_tokens = demand_tokens = all_tokens = committed = 0
    with (
        ServerProcess(
            l1_size_gb=capacity * MIN_PAGE_BYTES / 2**30, eviction_watermark=1.0, extra_args=args
        ) as server,
        server.client(timeout_s=CLIENT_TIMEOUT_S) as client,
    ):
        pool = client.register(LAYOUT).pool
        for demand in stream:
            all_tokens += demand.tokens
            if not demand.blocks:
                continue
            hashes = [block_key(b) for b in demand.blocks]
            result = client.lookup(pool, hashes, world_size=1, lock=False)
            while result.pending:
                result = client.lookup(pool, hashes, world_size=1, lock=False)
            hits = result.num_hit_blocks
            if hits < len(hashes):
                reservation = client.reserve(pool, 0, hashes[hits:])
                client.commit(reservation.reservation_id)
                committed += sum(page is not None for page in reservation.pages)
                if disk:
                    _written(client, committed)
            hit_tokens += hits * BLOCK_TOKENS
            demand_tokens += len(hashes) * BLOCK_TOKENS
        stats = client.stats()
    return {
        "hit_tokens": hit_tokens,
        "demand_tokens": demand_tokens,
        "tokens": all_tokens,
        "evicted_objects": stats["evicted_objects_total"],
        "l2_stored_objects": stats.get("l2_stored_objects_total", 0),
        "l2_dropped_writes": stats.get("l2_dropped_writes_total", 0),
        "l2_hit_objects": stats.get("l2_hit_objects_total", 0),
    }
