"""The cache index's live locks: the pages a lookup pinned for its ranks to read, one share per
rank, until each rank releases its share or the lease ends.

Owns the locks by id (in deadline order) and the pins their shares hold on COMMITTED pages
(:meth:`ArenaTier.prepare_load` and ``complete_load``). Which pages a lookup locks, and the
lease units a lock costs, are the index's (:mod:`kvshelf.server.index`). Must not import
:mod:`kvshelf.server.index` (nor torch or vLLM).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvshelf.protocol import ErrorCode
from kvshelf.server.leases import Lock, RequestRejected
from kvshelf.server.pool import Page, Pool
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.base import TierLoad


class Locks:
    """The live locks of one index, single-threaded on the socket loop.

    Args:
        arena: the arena tier (L1), whose pages locks pin; its counters are counted in.
    """

    def __init__(self, arena: ArenaTier) -> None:
        self._arena = arena
        self.counters = arena.counters
        # Leases all have the same length, so insertion order is deadline order and expiry
        # only ever looks at the front.
        self._locks: OrderedDict[int, Lock] = OrderedDict()

    def __len__(self) -> int:
        return len(self._locks)

    def __contains__(self, lock_id: int) -> bool:
        return lock_id in self._locks

    def lock(
        self, lock_id: int, pool: Pool, readers: list[list[Page]], deadline: float, units: int
    ) -> None:
        """Pin ``readers[rank]``, the pages each reading rank will load, under the new, unused
        ``lock_id``, which gives ``units`` back to the pool when it ends."""
        shares: list[TierLoad | None] = []
        for share in readers:
            load = TierLoad(pool, share, share)
            self._arena.prepare_load(load)
            shares.append(load)
        self._locks[lock_id] = Lock(pool, shares, deadline, units)

    def release(self, lock_id: int, rank: int, copied: int = 0) -> None:
        """Release ``rank``'s share of a lock (:meth:`CacheIndex.release`).

        Raises:
            RequestRejected: as :meth:`CacheIndex.release`.
        """
        lock = self._locks.get(lock_id)
        if lock is None:
            raise RequestRejected(ErrorCode.UNKNOWN_LOCK, f"no live lock {lock_id}")
        if rank >= len(lock.shares):
            raise RequestRejected(
                ErrorCode.INVALID_ARGUMENT, f"rank {rank} >= world_size {len(lock.shares)}"
            )
        share = lock.shares[rank]
        if share is None:
            raise RequestRejected(
                ErrorCode.UNKNOWN_LOCK, f"rank {rank} already released lock {lock_id}"
            )
        if copied > len(share.pages):
            raise RequestRejected(
                ErrorCode.INVALID_ARGUMENT,
                f"copied {copied} > {len(share.pages)} pages in rank {rank}'s share",
            )
        self.counters.add("loaded_objects_total", copied)
        self._release_share(lock, rank)
        if lock.remaining == 0:
            del self._locks[lock_id]
            lock.pool.lease_units -= lock.units

    def unlock(self, lock_id: int) -> None:
        """Release every share of a lock nobody will load (its lookup's client is gone)."""
        lock = self._locks.pop(lock_id)
        lock.pool.lease_units -= lock.units
        for rank, share in enumerate(lock.shares):
            if share is not None:
                self._release_share(lock, rank)

    def expire(self, now: float) -> int:
        """Unlock the locks whose lease ended at or before ``now``.

        Returns:
            How many expired.
        """
        expired_locks = 0
        while self._locks:
            lock_id, lock = next(iter(self._locks.items()))
            if lock.deadline > now:
                break
            self.unlock(lock_id)
            expired_locks += 1
        self.counters.add("expired_locks_total", expired_locks)
        return expired_locks

    def pinned(self) -> list[Sequence[Page]]:
        """The pages of every share not released yet; asserts each lock counts its shares."""
        shares: list[Sequence[Page]] = []
        for lock in self._locks.values():
            live = [share for share in lock.shares if share is not None]
            assert len(live) == lock.remaining > 0
            shares.extend(share.pages for share in live)
        return shares

    def _release_share(self, lock: Lock, rank: int) -> None:
        self._arena.complete_load(lock.take_share(rank))
