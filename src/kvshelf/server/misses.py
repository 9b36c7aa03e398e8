"""Why a lookup stopped short: the reason of its first missing block, and its counter.

Owns the classification only; the index calls it with the answer of a lookup that asked to
count its miss (``Lookup.count_miss``). Must not import torch or vLLM.
"""

from __future__ import annotations

from kvshelf.protocol import MissReason
from kvshelf.server.evicted import RecentlyEvicted
from kvshelf.server.pool import EntryState, Pool

# The server counter (kvshelf.metrics.SERVER) of each reason.
MISS_COUNTERS = {
    MissReason.NEVER_STORED: "miss_never_stored_total",
    MissReason.EVICTED: "miss_evicted_total",
    MissReason.RANK_INCOMPLETE: "miss_rank_incomplete_total",
    MissReason.TIER_ERROR: "miss_tier_error_total",
}


def miss_reason(
    pool_name: str, pool: Pool | None, block_hash: bytes, evicted: RecentlyEvicted
) -> MissReason:
    """The reason ``block_hash`` (a lookup's first missing block) is missing now.

    Checked in this order: stored for some ranks but not all (rank incomplete); held by a tier
    below L1 that did not load it (tier error); among the recently evicted keys (evicted);
    else never stored (also a key still being written, or an unknown pool).
    """
    entries = [] if pool is None else [table.get(block_hash) for table in pool.tables]
    if any(e is not None and e.state is EntryState.COMMITTED for e in entries):
        return MissReason.RANK_INCOMPLETE
    if any(e is not None and e.state is EntryState.STORED for e in entries):
        return MissReason.TIER_ERROR
    if (pool_name, block_hash) in evicted:
        return MissReason.EVICTED
    return MissReason.NEVER_STORED
