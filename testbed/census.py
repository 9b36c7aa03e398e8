"""What a server holds, block by block, read from outside: per pool, its committed objects and
the blocks committed for every rank (a lookup would hit them), from the pool's event log
(:mod:`kvshelf.server.event_log`). Pages of blocks some rank never committed are what is left:
``rank_incomplete_objects``. And what each worker of an engine said as it stopped
(:func:`worker_stops`). For tests and benchmarks of engines that stop (docs/safety.md,
"Stopping an engine").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvshelf.client import KVShelfClient
from kvshelf.server.event_log import EventKind

# The line a worker logs as it stops (kvshelf.roles.store_thread.StoreThread.stop).
_STOP_LINE = re.compile(
    r"kvshelf worker rank (\d+) stopped in ([\d.]+) s: (\d+) queued store jobs committed, "
    r"(\d+) aborted"
)


@dataclass(frozen=True)
class WorkerStop:
    """One worker's stop: its rank, how long its drain took, the store jobs it committed and
    aborted (past its drain bound)."""

    rank: int
    seconds: float
    committed: int
    aborted: int


def worker_stops(log: str) -> list[WorkerStop]:
    """The stop lines in an engine's log, by rank."""
    stops = [
        WorkerStop(int(rank), float(took), int(done), int(aborted))
        for rank, took, done, aborted in _STOP_LINE.findall(log)
    ]
    return sorted(stops, key=lambda stop: stop.rank)


@dataclass(frozen=True)
class PoolCensus:
    """One pool's committed objects and whole blocks."""

    pool: str
    objects: int
    whole_blocks: int
    stored_ranks: int

    @property
    def rank_incomplete_objects(self) -> int:
        """Committed objects of blocks not committed for every rank."""
        return self.objects - self.whole_blocks * self.stored_ranks


def census(client: KVShelfClient, stored_ranks: int) -> list[PoolCensus]:
    """Every pool of the server, for pools of ``stored_ranks`` stored ranks each.

    Exact while nothing was evicted, demoted or cleared (the tests and benchmarks that use it
    size their arenas so): a whole block then is one the log says was stored.

    Raises:
        RuntimeError: a pool's log overflowed (too many blocks to tell from it).
    """
    pools = client.server_stats().pool_objects
    found = []
    for pool, objects in sorted(pools.items()):
        whole: set[bytes] = set()
        after = 0
        while True:
            reply = client.events(pool, after_seq=after)
            if reply.overflowed:
                raise RuntimeError(f"pool {pool}'s event log overflowed")
            for kind, block_hash in zip(reply.kinds, reply.hashes, strict=True):
                if kind == EventKind.STORED:
                    whole.add(block_hash)
                else:
                    whole.discard(block_hash)
            if not reply.hashes:
                break
            after = reply.next_seq
        found.append(PoolCensus(pool, objects, len(whole), stored_ranks))
    return found
