"""The L1 tier: the pools' pages in the shared-memory arena, their states and eviction.

Workers write and read these pages directly; every object a client loads is in one of them.
The page life cycle is drawn in :mod:`kvshelf.server.index`, which drives this tier; here the
verbs of :class:`~kvshelf.server.tiers.base.Tier` mean:

- ``prepare_store``: place a reservation's keys in RESERVED pages (free list, a new extent, or
  eviction by the pool's policy, :mod:`kvshelf.server.policy`); ``complete_store`` (the
  commit) makes them COMMITTED; ``abort_store`` frees them.
- ``prepare_load``: pin COMMITTED pages while clients read them (out of eviction);
  ``complete_load`` unpins them.
- ``lookup``: an entry is loadable when it is a COMMITTED page.

A pool's pages come in extents, which :class:`~kvshelf.server.tiers.extents.Extents` hands out
and takes back (:mod:`kvshelf.server.tiers.extents`).

Must not import torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice

from kvshelf.metric_types import Counters
from kvshelf.metrics import SERVER
from kvshelf.server.evicted import RecentlyEvicted
from kvshelf.server.page_table import PageRecord, PageTable, SlotState
from kvshelf.server.policy import DEFAULT_POLICY, POLICIES, PolicyPage
from kvshelf.server.pool import Entry, EntryState, Page, Pool
from kvshelf.server.tenants import Tenants
from kvshelf.server.tiers.base import Tier, TierLoad, TierStore
from kvshelf.server.tiers.extents import DEFAULT_EXTENT_BYTES, Extents
from kvshelf.server.tiers.page_records import PageRecords
from kvshelf.server.tiers.quarantine import Quarantine
from kvshelf.server.tiers.shared_memory import ExtentAllocator, SharedMemoryArena


class ArenaTier(Tier):
    """The pages of every pool in the arena, single-threaded on the socket loop.

    Args:
        allocator: where pools take their extents from.
        eviction_watermark: in (0, 1]; once reserved plus committed bytes would exceed this
            fraction of the arena, a store evicts pages of its pool instead of using free
            space, keeping headroom for pools that still need to grow.
        eviction_policy: the name of the policy that picks a pool's victims
            (:data:`kvshelf.server.policy.POLICIES`).
        extent_bytes: the size a pool grows by.
        memory: the shared-memory object, for :meth:`view`; None where nothing reads pages
            (unit tests of the index).
        table: the page table in the arena's trailer, kept up to date with every page's
            state (:mod:`kvshelf.server.page_table`); None: not recorded.
        tenants: the per-tenant quota and metrics every pool's policy keeps.
    """

    name = "l1"

    def __init__(
        self,
        allocator: ExtentAllocator,
        *,
        eviction_watermark: float,
        extent_bytes: int = DEFAULT_EXTENT_BYTES,
        memory: SharedMemoryArena | None = None,
        counters: Counters | None = None,
        table: PageTable | None = None,
        eviction_policy: str = DEFAULT_POLICY,
        tenants: Tenants | None = None,
    ) -> None:
        assert 0 < eviction_watermark <= 1 and extent_bytes > 0
        self._policy_class = POLICIES[eviction_policy]
        self.tenants = Tenants() if tenants is None else tenants
        self._allocator = allocator
        self._watermark_bytes = eviction_watermark * allocator.capacity_bytes
        self._memory = memory
        # Bytes of RESERVED, FILLING and COMMITTED pages over all pools.
        self._occupied_bytes = 0
        self._resident_bytes = 0
        self._resident_objects = 0
        self._reserved_objects = 0
        self._locked_objects = 0
        # The server's counters (kvshelf.metrics.SERVER), shared with the index and handler.
        self.counters = Counters(SERVER) if counters is None else counters
        # Keys evicted lately, so that a miss on one can be told from a miss on a new key.
        self.evicted = RecentlyEvicted()
        # The eviction hook, set by the tiers below L1: the entry of a tier below that keeps
        # an evicted page's object (the key then stays, as that entry), or None.
        self.demote: Callable[[Pool, Page], Entry | None] | None = None
        # The removal hook, set by the index: called with (pool, rank, block hash, demoted) for
        # each COMMITTED page evicted or dropped, once its table shows what is left of its key.
        self.forgotten: Callable[[Pool, int, bytes, bool], None] | None = None
        self.records = PageRecords(table)
        self._extents = Extents(
            allocator,
            extent_bytes,
            self,
            self.records,
            self.counters,
            self._set_policy,
            self._forget,
        )
        # Pages adopted from a dead server's arena, out of use until its leases are over.
        self.quarantine = Quarantine()

    @property
    def capacity_bytes(self) -> int:
        """The arena's size."""
        return self._allocator.capacity_bytes

    # Tier verbs.

    def lookup(self, entry: Entry) -> bool:
        return entry.state is EntryState.COMMITTED

    def prepare_load(self, load: TierLoad) -> None:
        policy = load.pool.policy
        for page in load.pages:
            if page.lock_count == 0:
                policy.pin(page)
                self._locked_objects += 1
            page.lock_count += 1

    def complete_load(self, load: TierLoad) -> None:
        self._extents.changed()
        policy = load.pool.policy
        # Reversed, so a chain's first block goes back as the most recently used.
        for page in reversed(load.pages):
            assert page.state is EntryState.COMMITTED and page.lock_count > 0
            page.lock_count -= 1
            if page.lock_count == 0:
                policy.unpin(page)
                self._locked_objects -= 1

    def prepare_store(self, store: TierStore) -> None:
        """Place ``store.block_hashes`` in RESERVED pages.

        Keys already present in any tier, or being written by a reservation (this one
        included, for a repeated hash), get no page (None in ``store.locations``): skip them.
        Pages come from the pool's free list, else a new extent (one reclaimed from another
        pool when the arena is full and this pool holds less than its fair share), else
        eviction by the pool's policy; when none is left the rest of the keys get None too.
        """
        self._extents.changed()
        pool = store.pool
        rank = store.rank
        table = pool.tables[rank]
        self._set_policy(pool)  # before its first extent too: the store's tenant is counted
        policy = pool.policy
        committed = EntryState.COMMITTED
        # This runs on the socket loop for every store, and its time is the writer's wait
        # before it can copy: a few dict operations per key, and the pages taken in one go.
        # Hits first: a committed hit is a sign of use, so it moves away from eviction's end
        # before any page is taken.
        new_keys: set[bytes] = set()
        for block_hash in store.block_hashes:
            entry = table.get(block_hash)
            if entry is None:
                new_keys.add(block_hash)
            elif entry.state is committed and entry.lock_count == 0:
                policy.touch(entry)
        # A tenant at its cap makes room from its own pages (kvshelf.server.tenants).
        own, allowed = policy.quota_room(store.tenant, len(new_keys))
        pages = self._evict(pool, own, policy.victims_of(store.tenant)) if own else []
        pages += self._take_pages(pool, allowed - own)
        policy.hold(store.tenant, pages)
        locations = store.locations
        reserved_state = EntryState.RESERVED
        taken = skipped = no_space = 0
        for block_hash in store.block_hashes:
            if block_hash in table:
                skipped += 1
                locations.append(None)
                continue
            if taken == len(pages):
                no_space += 1
                locations.append(None)
                continue
            page = pages[taken]
            taken += 1
            page.state = reserved_state
            page.rank = rank
            page.block_hash = block_hash
            table[block_hash] = page
            locations.append(page.location)
        # Every page is taken: a key seen new twice is placed once (and is then present), and
        # a hit this store evicted is new now too.
        store.pages.extend(pages)
        counters = self.counters
        if skipped:
            counters.add("reserve_skipped_objects_total", skipped)
        if no_space:
            counters.add("reserve_no_space_objects_total", no_space)
            if allowed < len(new_keys):
                counters.add("reserve_over_quota_objects_total", len(new_keys) - allowed)
        self._reserved_objects += taken
        counters.add("reserved_objects_total", taken)
        # Keyed and RESERVED in the table before the reply hands the pages out.
        self.records.key(pages, SlotState.RESERVED)

    def complete_store(self, store: TierStore) -> None:
        """Commit: make the store's RESERVED pages readable and evictable."""
        policy = store.pool.policy
        ranks = store.pool.ranks
        committed = EntryState.COMMITTED
        # Newest at the end; the first block of a chain goes last so that it is evicted after
        # the blocks that depend on it.
        for page in reversed(store.pages):
            assert page.state is EntryState.RESERVED and page.lock_count == 0
            page.state = committed
            policy.add(page)
            if ranks is not None:
                ranks.on_committed(page.block_hash)
        self.records.mark(store.pages, SlotState.COMMITTED)
        count = len(store.pages)
        store.pool.num_committed += count
        self._reserved_objects -= count
        self._resident_objects += count
        self._resident_bytes += count * store.pool.page_bytes

    # L1 only.

    def abort_store(self, store: TierStore) -> None:
        """Drop a reservation: its pages lose their keys and become free."""
        pool = store.pool
        table = pool.tables[store.rank]
        pool.policy.release(store.pages)
        for page in store.pages:
            assert page.state is EntryState.RESERVED
            del table[page.block_hash]
            page.clear()
            pool.free.append(page)
        self.records.mark(store.pages, SlotState.FREE)
        self._reserved_objects -= len(store.pages)
        self._occupied_bytes -= len(store.pages) * pool.page_bytes

    def drop_unwhole(self, pool: Pool, pages: list[Page]) -> None:
        """Free COMMITTED pages nothing pins whose blocks can never be whole (the index's
        rule, :meth:`CacheIndex.abort`): not kept below L1, not counted as evicted."""
        self._extents.changed()
        for page in pages:
            pool.policy.remove(page)
        self._forget(pool, pages, keep=False)
        pool.free.extend(pages)

    def touch(self, pool: Pool, pages: list[Page]) -> None:
        """Mark committed pages as just used."""
        # Reversed, so a chain's first block ends up most recently used: eviction then takes
        # the tails of chains first, which keeps the remaining prefixes useful.
        policy = pool.policy
        for page in reversed(pages):
            if page.lock_count == 0:
                policy.touch(page)

    def take_page(self, pool: Pool) -> Page | None:
        """A FREE page for ``pool`` (removed from its free list, counted as occupied).

        Returns:
            The page, or None when the pool can neither grow nor evict.
        """
        if not self._evicts(pool):
            extents = self._extents
            if not pool.free:
                extents.grow(pool)
            if not pool.free and extents.below_fair_share(pool) and extents.reclaim_for(pool):
                extents.grow(pool)
            if pool.free:
                self._occupied_bytes += pool.page_bytes
                return pool.free.pop()
        # None when nothing is evictable or the soft share refuses (kvshelf.server.tenants).
        evicted = self._evict(pool, 1)
        return evicted[0] if evicted else None

    def _evicts(self, pool: Pool) -> bool:
        """Whether the next page ``pool`` takes comes from evicting one of its own."""
        over_watermark = self._occupied_bytes + pool.page_bytes > self._watermark_bytes
        return over_watermark and bool(pool.policy) and not self._extents.below_fair_share(pool)

    def _take_pages(self, pool: Pool, count: int) -> list[Page]:
        """Up to ``count`` pages as :meth:`take_page` gives them; once ``pool`` evicts, it
        goes on evicting (each eviction frees what the next page takes), so the rest come from
        one eviction of as many pages."""
        pages: list[Page] = []
        while len(pages) < count:
            if self._evicts(pool):
                evicted = self._evict(pool, count - len(pages))
                if not evicted:
                    break  # the soft share refuses the rest (kvshelf.server.tenants)
                pages += evicted
            elif (page := self.take_page(pool)) is not None:
                pages.append(page)
            else:
                break
        return pages

    def fill(self, page: Page) -> None:
        """Hand a page from :meth:`take_page` to a tier below, which copies an object into it."""
        assert page.state is EntryState.FREE
        page.state = EntryState.FILLING
        self.records.mark((page,), SlotState.FILLING)

    def land(self, pool: Pool, page: Page, rank: int, block_hash: bytes) -> None:
        """A FILLING page now holds the object of ``(rank, block_hash)``: commit it.

        The caller puts the page in the pool's table.
        """
        assert page.state is EntryState.FILLING and page.lock_count == 0
        page.state = EntryState.COMMITTED
        page.rank = rank
        page.block_hash = block_hash
        self.records.key((page,), SlotState.COMMITTED)
        pool.policy.hold("", (page,))
        pool.policy.add(page)
        if pool.ranks is not None:
            pool.ranks.on_landed(block_hash)
        pool.num_committed += 1
        self._resident_objects += 1
        self._resident_bytes += pool.page_bytes

    def free(self, pool: Pool, page: Page) -> None:
        """Return a FILLING page whose object did not land."""
        assert page.state is EntryState.FILLING
        page.clear()
        pool.free.append(page)
        self.records.mark((page,), SlotState.FREE)
        self._occupied_bytes -= pool.page_bytes

    def clear(self, pool: Pool, limit: int) -> int:
        """Drop up to ``limit`` COMMITTED pages of ``pool`` that no lock pins (``kvshelf
        clear``); ``len(pool.policy)`` are left.

        Locked pages are being read and stay; reserved pages become visible when committed.
        The removal hook is not called: the caller resets the pool's event log instead.

        Returns:
            The number of pages dropped.
        """
        policy = pool.policy
        if len(policy) <= limit:
            pages = list(policy.pages())
            policy.clear()
        else:
            pages = list(islice(policy.pages(), limit))
            for page in pages:
                policy.remove(page)
        self._forget(pool, pages, logged=False)
        pool.free.extend(pages)
        return len(pages)

    def drop(self, pool: Pool) -> None:
        """Give back every page of a retired pool (:mod:`kvshelf.server.pool_life`), which
        nothing pins: its committed pages go without being kept below L1 (the tiers below drop
        the pool too), its extents and page records return to the allocator and the table."""
        assert all(
            page.lock_count == 0 and page.state in (EntryState.FREE, EntryState.COMMITTED)
            for _, pages in pool.extents
            for page in pages
        ), f"pool {pool.name} dropped with pages in use"
        pages = list(pool.policy.pages())
        committed = len(pages)
        for page in pages:
            page.clear()
        pool.policy.clear()
        if pool.ranks is not None:
            pool.ranks.clear()
        pool.num_committed = 0
        self._resident_objects -= committed
        self._resident_bytes -= committed * pool.page_bytes
        self._occupied_bytes -= committed * pool.page_bytes
        self._extents.drop(pool)
        self.records.drop_pool(pool)
        self._extents.changed()

    def view(self, pool: Pool, page: Page) -> memoryview:
        """A writable view of a page's bytes."""
        assert self._memory is not None, "no shared memory behind this arena tier"
        return self._memory.view(page.location * pool.page_bytes, pool.page_bytes)

    def stats(self) -> dict[str, int]:
        return {
            "resident_objects": self._resident_objects,
            "resident_bytes": self._resident_bytes,
            "reserved_objects": self._reserved_objects,
            "locked_objects": self._locked_objects,
            "capacity_bytes": self._allocator.capacity_bytes,
            "allocated_bytes": self._allocator.used_bytes,
            **self._byte_sum(),
            "quarantined_pages": len(self.quarantine),
        }

    def _byte_sum(self) -> dict[str, int]:
        """The arena's bytes by use; with ``resident_bytes`` they add up to the capacity."""
        allocator = self._allocator
        out = self.quarantine.out_bytes
        return {
            "l1_free_bytes": allocator.free_bytes + allocator.extent_bytes - self._occupied_bytes,
            "l1_reserved_bytes": self._occupied_bytes - self._resident_bytes - out,
            "l1_quarantined_bytes": out,
            "l1_gap_bytes": allocator.gap_bytes,
        }

    def check_invariants(
        self,
        pools: Iterable[Pool],
        readers: dict[int, int],
        reserved: set[int],
        filling: Sequence[Page],
    ) -> None:
        """Assert the page invariants of :mod:`kvshelf.server.index`; O(pages).

        Args:
            pools: every pool.
            readers: ``id(page)`` -> how many pins the index holds on it (lock shares, stores
                behind, fetches); pages not in it must have none.
            reserved: ``id`` of every page of a live reservation.
            filling: every page a fetch is filling.
        """
        assert all(p.state is EntryState.FILLING and p.lock_count == 0 for p in filling)
        held = {id(page) for _, page in self.quarantine.held}
        out = {id(page) for _, page in self.quarantine.out}
        occupied = resident = unkeyed = extents = free_bytes = reserved_bytes = filling_bytes = 0
        for pool in pools:
            free = {id(p) for p in pool.free}
            assert len(free) == len(pool.free)
            keyed = committed = 0
            for table in pool.tables:
                for page in table.values():
                    if page.tier is not self:
                        continue
                    assert isinstance(page, Page) and id(page) not in free
                    assert page.lock_count == readers.get(id(page), 0) + (id(page) in held)
                    if page.state is EntryState.RESERVED:
                        assert id(page) in reserved and page.lock_count == 0
                        reserved_bytes += pool.page_bytes
                    else:
                        assert page.state is EntryState.COMMITTED
                        assert (page in pool.policy) == (page.lock_count == 0)
                        resident += pool.page_bytes
                        committed += 1
                    keyed += 1
            assert committed == pool.num_committed
            if pool.ranks is not None:
                _check_ranks(pool)
            assert sum(pool.policy.held.values()) == keyed, "tenants own every keyed page"
            assert all(p.state is EntryState.FREE and p.lock_count == 0 for p in pool.free)
            assert all(p.state is EntryState.COMMITTED for p in pool.policy.pages())
            # The pages neither keyed nor free are the ones being filled or quarantined out.
            unkeyed += pool.num_pages - keyed - len(free)
            occupied += (pool.num_pages - len(free)) * pool.page_bytes
            extents += pool.num_pages * pool.page_bytes
            free_bytes += len(free) * pool.page_bytes
            out_here = sum(1 for owner, _ in self.quarantine.out if owner is pool)
            filling_bytes += (pool.num_pages - keyed - len(free) - out_here) * pool.page_bytes
        assert unkeyed == len(filling) + len(out) == len({id(p) for p in filling}) + len(out)
        assert all(p.lock_count == 1 and p.state is EntryState.FREE for _, p in self.quarantine.out)
        assert occupied == self._occupied_bytes and resident == self._resident_bytes
        assert len(reserved) == self._reserved_objects
        assert len(readers.keys() - held) == self._locked_objects
        # The byte invariant: every byte of the arena is in exactly one of these.
        allocator = self._allocator
        assert extents == allocator.extent_bytes
        sums = {
            "l1_free_bytes": free_bytes + allocator.free_bytes,
            "l1_reserved_bytes": reserved_bytes + filling_bytes,
            "l1_quarantined_bytes": sum(pool.page_bytes for pool, _ in self.quarantine.out),
            "l1_gap_bytes": allocator.gap_bytes,
        }
        assert sums == self._byte_sum(), (sums, self._byte_sum())
        assert sum(sums.values()) + resident == allocator.capacity_bytes

    # Adoption (kvshelf.server.adoption) and its quarantine.

    def adopt_extent(self, pool: Pool, records: Sequence[PageRecord]) -> int:
        """Rebuild one extent of an adopted arena from its pages' records.

        Extents come in address order. COMMITTED pages become the pool's entries, held by the
        quarantine; RESERVED and FILLING ones go out of use until it ends; the rest are free.

        Returns:
            How many objects were adopted.
        """
        self._set_policy(pool)
        page_bytes = pool.page_bytes
        first = records[0].offset // page_bytes
        extent = range(first, first + len(records))
        self._extents.claim(pool, extent)
        pages: list[Page] = []
        free: list[Page] = []
        adopted = 0
        committed = EntryState.COMMITTED
        for record in records:
            page = Page(self, record.offset // page_bytes)
            page.slot = record.slot
            pages.append(page)
            table = pool.tables[record.rank] if record.rank >= 0 else {}
            if record.state is SlotState.COMMITTED and record.block_hash not in table:
                page.state, page.rank, page.block_hash = committed, record.rank, record.block_hash
                table[record.block_hash] = page
                if pool.ranks is not None:
                    pool.ranks.on_committed(record.block_hash)
                pool.num_committed += 1
                self._resident_objects += 1
                self._resident_bytes += page_bytes
                self.quarantine.held.append((pool, page))
                pool.policy.hold("", (page,))
                adopted += 1
            elif record.state in (SlotState.RESERVED, SlotState.FILLING):
                self.quarantine.out.append((pool, page))
                self.quarantine.out_bytes += page_bytes
            else:
                free.append(page)
                continue
            page.lock_count = 1  # the quarantine's pin
            self._occupied_bytes += page_bytes
        pool.free.extend(reversed(free))  # popped in ascending order, as Extents.grow's
        self._extents.add(pool, extent, pages)
        self.records.adopted(pool)
        return adopted

    def end_quarantine(self, now: float) -> None:
        """Once the quarantine's time is over, held pages become evictable (least recently
        used first) and out pages free."""
        quarantine = self.quarantine
        if not quarantine or now < quarantine.until:
            return
        self._extents.changed()
        for pool, page in quarantine.held:
            page.lock_count -= 1
            if page.lock_count == 0:
                pool.policy.add_oldest(page)
            else:
                self._locked_objects += 1  # a lock share reads it: counted as locked now
        for pool, page in quarantine.out:
            page.lock_count = 0
            pool.free.append(page)
            self._occupied_bytes -= pool.page_bytes
        self.records.mark((page for _, page in quarantine.out), SlotState.FREE)
        self.quarantine = Quarantine()

    # Internals.

    def _set_policy(self, pool: Pool) -> None:
        """Give a pool taking its first extent this tier's policy (it has no page yet)."""
        if pool.policy.ledger is not self.tenants.ledger:
            assert not pool.policy
            make, capacity = self._policy_class, self._allocator.capacity_bytes
            pool.policy = self.tenants.policy(make, pool.page_bytes, capacity, self.counters)

    def _evict(
        self, pool: Pool, count: int, take: Callable[[int], list[PolicyPage]] | None = None
    ) -> list[Page]:
        """Evict up to ``count`` of ``pool``'s pages, its policy's victims (fewer where the
        soft share refuses; ``take``'s: the victims of one tenant, given no more than it has),
        taken for its use (occupied, FREE, on no list)."""
        pages = (pool.policy.victims if take is None else take)(count)
        self.counters.add("evicted_objects_total", len(pages))
        self._forget(pool, pages)
        self._occupied_bytes += len(pages) * pool.page_bytes
        return pages

    def _forget(
        self, pool: Pool, pages: list[Page], keep: bool = True, logged: bool = True
    ) -> None:
        """Evict COMMITTED pages already out of the policy: they and their keys are gone (kept as
        a lower tier's entry where ``demote`` gives one, unless not ``keep``: then neither kept
        below nor remembered as evicted), each told to the removal hook unless not
        ``logged``."""
        tables = pool.tables
        ranks = pool.ranks
        demote = self.demote if keep else None
        evicted = self.evicted
        forgotten = self.forgotten if logged else None
        for page in pages:
            assert page.state is EntryState.COMMITTED and page.lock_count == 0
            table = tables[page.rank]
            below = demote(pool, page) if demote is not None else None
            if below is None:
                # The page was the key's only copy, so the key goes with it.
                del table[page.block_hash]
                if keep:
                    evicted.add(pool.name, page.block_hash)
                if ranks is not None:
                    ranks.on_dropped(page.block_hash, in_l1=True)
            else:
                table[page.block_hash] = below
                if ranks is not None:
                    ranks.on_demoted(page.block_hash)
            if forgotten is not None:
                forgotten(pool, page.rank, page.block_hash, below is not None)
            page.clear()
        count = len(pages)
        pool.num_committed -= count
        self._resident_objects -= count
        self._resident_bytes -= count * pool.page_bytes
        self._occupied_bytes -= count * pool.page_bytes
        # FREE before a page can get another key: never a new key under COMMITTED.
        self.records.mark(pages, SlotState.FREE)


def _check_ranks(pool: Pool) -> None:
    """Assert that the pool's block rank counts (:mod:`kvshelf.server.block_ranks`) are its
    tables'."""
    assert pool.ranks is not None
    held: dict[bytes, int] = {}
    in_l1: dict[bytes, int] = {}
    for table in pool.tables:
        for block_hash, entry in table.items():
            if entry.state is EntryState.RESERVED:
                continue
            held[block_hash] = held.get(block_hash, 0) + 1
            if entry.state is EntryState.COMMITTED:
                in_l1[block_hash] = in_l1.get(block_hash, 0) + 1
    assert held == pool.ranks.held and in_l1 == pool.ranks.in_l1, "block rank counts"
