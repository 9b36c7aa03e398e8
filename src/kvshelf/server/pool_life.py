"""The life cycle of pools: who holds them, and when the index retires them.

Every reset of a connector's cache (vLLM's ``reset_cache()``: a weight update, ``sleep``,
``reset_prefix_cache(reset_connector=True)``) starts a new identity epoch, and each epoch is a
pool of its own. Pools that were never retired would fill the server's ``max_pools`` and
refuse the next epoch. The rules (docs/architecture.md, "Pool life cycle"):

- **holders**: each ``Register`` of a pool adds its holder token (``Registered.holder``: a
  secret random number the registrant sends again with its later registrations), once however
  often it registers; a ``Register`` whose ``retires`` names a pool its token holds takes that
  token away (the rank moved on to a new epoch). A pool whose last holder leaves is retired:
  the first epoch of a model is shared by every engine with its weights, so it stays while
  another engine's rank still holds it; later epochs are one engine's own. No client can let
  go of a pool for another (it does not know the other's token), and a ``Register`` sent again
  after a lost reply lets go of nothing more. A pool holds at most
  :data:`~kvshelf.server.limits.MAX_HOLDERS_PER_POOL` tokens; once more registered, only the
  idle rules retire it.
- **idle and empty**: a pool without a key, lease or job in flight that nobody used for
  :data:`~kvshelf.server.tiers.reclaim.IDLE_S` is retired.
- **at the limit**: a registration that would exceed ``max_pools`` retires its registrant's
  ``retires`` pool if it was its last holder, else the least recently used pool that has no
  lease or job of a tier in flight and is either empty or unused for ``IDLE_S``: a pool in use
  in the last minute is never taken for someone else's registration. Otherwise it is refused
  with ``LIMIT_EXCEEDED``.

A pool retired while busy (its holders left while a lock or a store was still out) is
*retiring*: unknown to requests by name from then on (lookups miss, reservations get
``UNKNOWN_POOL``), while its leases and jobs end as usual; it is dropped once they have. A
registration of its name before then revives it. Dropping frees its L1 pages at once (no
eviction into tiers below: those drop the pool too, the disk tier its folder). A worker whose
pool was retired under it gets ``UNKNOWN_POOL`` and registers again.

Holders are counted per server boot: a restarted server (or pools restored from disk) starts
at none, and ranks count again as they register. Must not import torch or vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvshelf.metric_types import Counters
from kvshelf.protocol import ErrorCode
from kvshelf.server.leases import RequestRejected
from kvshelf.server.limits import MAX_HOLDERS_PER_POOL
from kvshelf.server.pool import Pool
from kvshelf.server.tiers.reclaim import IDLE_S

logger = logging.getLogger(__name__)

# How often the index looks for retiring pools whose leases ended and for idle, empty pools.
SWEEP_INTERVAL_S = 1.0


class PoolLife:
    """The index's pools by name and the retirement rules above; on the socket loop.

    Args:
        pools: the index's pools by name (shared: the index reads it for every request).
        max_pools: the most pools held at once, retiring ones included.
        busy: whether a lease, the quarantine or a job of a tier below in flight holds a pool.
        drop: frees a pool's pages and makes the tiers below drop it.
        counters: the server's counters.
    """

    def __init__(
        self,
        pools: dict[str, Pool],
        max_pools: int,
        busy: Callable[[Pool], bool],
        drop: Callable[[Pool], None],
        counters: Counters,
    ) -> None:
        self.pools = pools
        self._max_pools = max_pools
        self._busy = busy
        self._drop = drop
        self._counters = counters
        # Pools whose holders left while they were busy: dropped once idle.
        self.retiring: dict[str, Pool] = {}
        self._next_sweep = 0.0

    def __len__(self) -> int:
        return len(self.pools) + len(self.retiring)

    def held(self) -> list[Pool]:
        """Every pool the index holds pages and keys for: live and retiring."""
        return [*self.pools.values(), *self.retiring.values()]

    def find(self, name: str) -> Pool | None:
        """The pool of that name, live or retiring."""
        pool = self.pools.get(name)
        return pool if pool is not None else self.retiring.get(name)

    def victim(self, retires: str, holder: int, now: float | None) -> Pool | None:
        """Make sure a new pool fits: None when there is room, else the pool to drop for it
        (``retires`` when ``holder`` is its last holder, else the least recently used pool
        that is neither busy nor in use: empty, or unused for ``IDLE_S``).

        Args:
            retires: the pool the registrant lets go of, or "".
            holder: the registrant's holder token.
            now: the time; None for a pool a tier restores at start (which never retires
                another).

        Raises:
            RequestRejected: LIMIT_EXCEEDED when no pool may go.
        """
        if len(self) < self._max_pools:
            return None
        if now is not None:
            replaced = self.pools.get(retires)
            if (
                replaced is not None
                and replaced.holders == {holder}
                and not replaced.holders_capped
                and not self._busy(replaced)
            ):
                return replaced
            for pool in sorted(self.pools.values(), key=lambda p: p.last_used):
                in_use = pool.last_used >= now - IDLE_S and any(pool.tables)
                if not in_use and not self._busy(pool):
                    return pool
        raise RequestRejected(
            ErrorCode.LIMIT_EXCEEDED,
            f"the server holds its maximum of {self._max_pools} pools, each busy or in use "
            f"in the last {IDLE_S:.0f} s",
        )

    def admit(
        self, pool: Pool, retires: str, holder: int, victim: Pool | None, now: float | None
    ) -> None:
        """Carry out an accepted registration of ``pool`` (new, live or retiring).

        Args:
            pool: the pool registered.
            retires: the pool the registrant lets go of, or "".
            holder: the registrant's holder token (0: none).
            victim: what :meth:`victim` chose to make room, or None.
            now: the time; None for a pool a tier restores at start (no holder).
        """
        if retires and retires != pool.name:
            self.leave(retires, holder)
        if victim is not None and self.pools.get(victim.name) is victim:
            self.retire(victim, "least recently used pool not in use, at the limit of pools")
        # A retiring pool registered again is revived, pages and all.
        self.retiring.pop(pool.name, None)
        self.pools[pool.name] = pool
        if now is not None:
            pool.last_used = now
            if holder and holder not in pool.holders:
                if len(pool.holders) < MAX_HOLDERS_PER_POOL:
                    pool.holders.add(holder)
                else:
                    pool.holders_capped = True

    def leave(self, name: str, holder: int) -> None:
        """``holder`` no longer uses the pool ``name``: retire it when that was its last
        holder.

        Nothing happens for a token that does not hold it (another client's guess, or a
        registration sent again), nor for a pool without holders (restored from disk, or
        registered before this boot: left to the idle rules, nobody known to this boot used
        it).
        """
        pool = self.pools.get(name)
        if pool is None or holder not in pool.holders:
            return
        pool.holders.discard(holder)
        if not pool.holders and not pool.holders_capped:
            self.retire(pool, "its last holder moved to a new identity epoch")

    def retire(self, pool: Pool, why: str) -> None:
        """Retire a live pool: drop it now if idle, else once its leases and jobs end."""
        del self.pools[pool.name]
        if self._busy(pool):
            self.retiring[pool.name] = pool
            logger.info("pool %s retiring (%s); dropped once its leases end", pool.name, why)
            return
        self._retired(pool, why)

    def sweep(self, now: float) -> None:
        """Drop retiring pools that became idle, and retire idle, empty pools (at most once
        per :data:`SWEEP_INTERVAL_S`)."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        for pool in list(self.retiring.values()):
            if not self._busy(pool):
                del self.retiring[pool.name]
                self._retired(pool, "its leases ended")
        for pool in list(self.pools.values()):
            if pool.last_used < now - IDLE_S and not any(pool.tables) and not self._busy(pool):
                del self.pools[pool.name]
                self._retired(pool, f"empty and unused for {IDLE_S:.0f} s")

    def _retired(self, pool: Pool, why: str) -> None:
        self._drop(pool)
        self._counters.add("pools_retired_total")
        logger.info("pool %s retired: %s", pool.name, why)
