"""Which pools give arena extents back when another pool needs room (reclaim across pools).

A pool takes extents of the arena as it grows; without reclaim it would keep them forever, so
that after a redeploy (new weights, hence a new pool) on a full arena the new pool would get no
page. The arena tier asks :func:`reclaim_order` for the pools it may take an extent from, when
a pool below its fair share needs a page and the arena has no free extent left:

- *idle* pools (not used for :data:`IDLE_S` while others were) first, least recently used
  first: an old model's or an old identity epoch's pool stops being used at once;
- then pools holding more than their fair share (the arena divided by the active pools).

Must not import torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvshelf.server.pool import Pool

# A pool not used for this long, while another pool was, counts as idle.
IDLE_S = 60.0


def _active(pools: list[Pool]) -> list[Pool]:
    newest = max(pool.last_used for pool in pools)
    return [pool for pool in pools if pool.last_used >= newest - IDLE_S]


def fair_share_bytes(pools: Iterable[Pool], requester: Pool, capacity_bytes: int) -> float:
    """The arena bytes each active pool (the requester counts as one) may hold."""
    active = _active([*pools, requester])
    return capacity_bytes / len({id(pool) for pool in active})


def below_fair_share(
    pools: Iterable[Pool], requester: Pool, capacity_bytes: int, extent_bytes: int
) -> bool:
    """Whether ``requester`` stays within its fair share of the arena with one more extent.

    Extents are coarse: both this and :func:`reclaim_order` leave a whole extent of slack, so
    that pools near their share do not take extents from one another back and forth.
    """
    share = fair_share_bytes(pools, requester, capacity_bytes)
    return requester.num_pages * requester.page_bytes + extent_bytes <= share


def reclaim_order(
    pools: Iterable[Pool], requester: Pool, capacity_bytes: int, extent_bytes: int
) -> list[Pool]:
    """The pools ``requester`` may take an extent of ``extent_bytes`` from, in order."""
    holders = [pool for pool in pools if pool is not requester and pool.extents]
    if not holders:
        return []
    share = fair_share_bytes(holders, requester, capacity_bytes)
    active = {id(pool) for pool in _active([*holders, requester])}
    idle = [pool for pool in holders if id(pool) not in active]
    over = [
        pool
        for pool in holders
        if id(pool) in active and pool.num_pages * pool.page_bytes - extent_bytes >= share
    ]
    return sorted(idle, key=lambda p: p.last_used) + sorted(over, key=lambda p: p.last_used)
