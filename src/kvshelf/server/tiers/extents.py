"""The arena's extents: which pools hold them, how a pool grows by one and how one is taken back.

A pool's pages come in extents, runs of pages that the allocator
(:class:`~kvshelf.server.tiers.shared_memory.ExtentAllocator`) hands out. Owns taking them
(a new extent, or one of an adopted arena), the fair share a pool may grow to on a full arena,
reclaiming an extent from another pool (:mod:`kvshelf.server.tiers.reclaim` says which
pools) and giving a retired pool's extents back. What happens to a page in an extent (its
state, its key, its eviction) is the arena tier's (:mod:`kvshelf.server.tiers.arena`), which
owns this: must not import it (nor torch or vLLM).
"""

from __future__ import annotations

from collections.abc import Callable

from kvshelf.metric_types import Counters
from kvshelf.server.pool import EntryState, Page, Pool
from kvshelf.server.tiers import reclaim
from kvshelf.server.tiers.base import Tier
from kvshelf.server.tiers.page_records import PageRecords
from kvshelf.server.tiers.shared_memory import ExtentAllocator

# A pool grows by extents of about this size, so the arena is shared out in coarse steps
# rather than one page at a time.
DEFAULT_EXTENT_BYTES = 64 * 1024 * 1024
# Page bookkeeping is one Python object per page: cap an extent's page count so a pool of tiny
# pages cannot make one request allocate millions of them.
MAX_PAGES_PER_EXTENT = 4096


class Extents:
    """The extents of every pool in the arena, single-threaded on the socket loop.

    Args:
        allocator: where pools take their extents from.
        extent_bytes: the size a pool grows by.
        tier: the arena tier, the tier of every page.
        records: the page records of the arena's page table.
        counters: the server's counters.
        set_policy: gives a pool taking its first extent the tier's eviction policy.
        forget: evicts COMMITTED pages already out of their pool's policy (those of an extent
            taken back).
    """

    def __init__(
        self,
        allocator: ExtentAllocator,
        extent_bytes: int,
        tier: Tier,
        records: PageRecords,
        counters: Counters,
        set_policy: Callable[[Pool], None],
        forget: Callable[[Pool, list[Page]], None],
    ) -> None:
        self._allocator = allocator
        self._extent_bytes = extent_bytes
        self._tier = tier
        self._records = records
        self._counters = counters
        self._set_policy = set_policy
        self._forget = forget
        # Pools holding extents, which another pool may reclaim from (tiers/reclaim.py).
        self._holders: dict[int, Pool] = {}
        # Pages unlocked, committed or freed since a reclaim last found nothing: until then,
        # trying again would find nothing again.
        self._changes = 0
        self._reclaim_failed_at = -1
        # The last below_fair_share question and its answer.
        self._fair_memo: tuple[Pool, int, int, int] | None = None
        self._fair_below = False

    def changed(self) -> None:
        """Pages were unlocked, committed or freed: a reclaim may find an extent again, and a
        fair share may differ."""
        self._changes += 1

    def extent_pages(self, pool: Pool) -> int:
        """The pages in an extent of ``pool``: about ``extent_bytes``, at least one."""
        return max(1, min(self._extent_bytes // pool.page_bytes, MAX_PAGES_PER_EXTENT))

    def grow(self, pool: Pool) -> None:
        """Give ``pool`` a new extent of FREE pages, when the allocator has one."""
        extent = self._allocator.allocate(pool.page_bytes, self.extent_pages(pool))
        if not extent:
            return
        self._set_policy(pool)
        pages = [Page(self._tier, index) for index in extent]
        self._records.place(pool, pages)
        self.add(pool, extent, pages)
        # Pop order is ascending page index, which keeps a pool's writes roughly sequential.
        pool.free.extend(reversed(pages))

    def claim(self, pool: Pool, extent: range) -> None:
        """Take ``extent`` (page indices) of an adopted arena for ``pool``; its pages follow
        with :meth:`add`."""
        self._allocator.claim(extent.start * pool.page_bytes, extent.stop * pool.page_bytes)

    def add(self, pool: Pool, extent: range, pages: list[Page]) -> None:
        """Make ``pages``, the pages of ``extent``, ``pool``'s."""
        pool.extents.append((extent, pages))
        pool.num_pages += len(pages)
        self._holders[id(pool)] = pool

    def drop(self, pool: Pool) -> None:
        """Give every extent of a retired pool back, with its page records."""
        for extent, pages in pool.extents:
            self._records.release(pages)
            self._allocator.release(extent, pool.page_bytes)
        pool.extents.clear()
        pool.free.clear()
        pool.num_pages = 0
        self._holders.pop(id(pool), None)

    def below_fair_share(self, pool: Pool) -> bool:
        """Whether other pools hold extents and ``pool`` holds less than its fair share.

        Asked for every page a store takes on a full arena: the answer is kept until the
        pool's size or the set of holders changes, or the next store or unlock.
        """
        holders = self._holders
        if len(holders) == 1 and id(pool) in holders:
            return False  # the only pool with extents: the common case, kept cheap
        memo = (pool, pool.num_pages, len(holders), self._changes)
        if memo != self._fair_memo:
            self._fair_memo = memo
            others = len(self._holders) - (id(pool) in self._holders)
            self._fair_below = others > 0 and reclaim.below_fair_share(
                self._holders.values(),
                pool,
                self._allocator.capacity_bytes,
                self.extent_pages(pool) * pool.page_bytes,
            )
        return self._fair_below

    def reclaim_for(self, pool: Pool) -> bool:
        """Take one extent back from another pool (idle ones first) for ``pool`` to grow into.

        An extent is reclaimable when none of its pages is reserved, being filled or locked:
        its committed pages are evicted, its free pages dropped, and the extent returned to the
        allocator.

        Returns:
            Whether an extent was returned.
        """
        if self._reclaim_failed_at == self._changes:
            return False
        capacity = self._allocator.capacity_bytes
        extent_bytes = self.extent_pages(pool) * pool.page_bytes
        for victim in reclaim.reclaim_order(self._holders.values(), pool, capacity, extent_bytes):
            for index, (_, pages) in enumerate(victim.extents):
                if all(_reclaimable(page) for page in pages):
                    self._release_extent(victim, index)
                    return True
        self._reclaim_failed_at = self._changes
        return False

    def _release_extent(self, pool: Pool, index: int) -> None:
        extent, pages = pool.extents.pop(index)
        evicted = [page for page in pages if page.state is EntryState.COMMITTED]
        for page in evicted:
            pool.policy.remove(page)
        self._counters.add("evicted_objects_total", len(evicted))
        self._forget(pool, evicted)
        dropped = {id(page) for page in pages}
        pool.free[:] = [page for page in pool.free if id(page) not in dropped]
        self._records.release(pages)
        pool.num_pages -= len(pages)
        if not pool.extents:
            del self._holders[id(pool)]
        self._allocator.release(extent, pool.page_bytes)
        self._counters.add("reclaimed_extents_total")


def _reclaimable(page: Page) -> bool:
    # lock_count also keeps quarantined pages (FREE but out of use) in their extent.
    return page.lock_count == 0 and page.state in (EntryState.FREE, EntryState.COMMITTED)
