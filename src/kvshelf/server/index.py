"""The cache index: pools, keys, page states, LRU eviction, locks and reservations with leases.

Page life cycle (per pool)::

    FREE --reserve--> RESERVED --commit--> COMMITTED --evict--> FREE
                          |                    ^  |
                          +--abort/expire----> FREE (lock/release: lock_count up/down)

Invariants (checked by :meth:`CacheIndex.check_invariants`):

- a key ``(rank, block_hash)`` maps to at most one page, which is RESERVED or COMMITTED;
- a RESERVED page belongs to exactly one live reservation and is never locked or evicted;
- a COMMITTED page is in its pool's LRU iff no lock holds it; only LRU pages are evicted;
- a FREE page has no key and sits in its pool's free list.

Every public operation validates its arguments before it changes anything, so a rejected
request (:class:`RequestRejected`) leaves the index exactly as it was.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from collections.abc import Sequence

from kvshelf.protocol import ErrorCode, PageLayout, pool_name
from kvshelf.server.arena import ExtentAllocator

# A pool grows by extents of about this size, so the arena is shared out in coarse steps
# rather than one page at a time.
DEFAULT_EXTENT_BYTES = 64 * 1024 * 1024
# Page bookkeeping is one Python object per page: cap an extent's page count so a pool of tiny
# pages cannot make one request allocate millions of them.
MAX_PAGES_PER_EXTENT = 4096


class RequestRejected(Exception):
    """A request the index refuses; it changed nothing.

    Args:
        code: the error code to answer with.
        message: a short reason.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class PageState(enum.Enum):
    FREE = 0
    RESERVED = 1
    COMMITTED = 2


class Page:
    """One page of a pool: a slot of ``page_bytes`` in the arena, named by its page index."""

    __slots__ = ("block_hash", "index", "lock_count", "rank", "state")

    def __init__(self, index: int) -> None:
        self.index = index
        self.state = PageState.FREE
        self.rank = -1
        self.block_hash = b""
        # Number of live lock shares reading this page; > 0 keeps it out of the LRU.
        self.lock_count = 0

    def clear(self) -> None:
        """Forget the key; the page is FREE again."""
        assert self.lock_count == 0
        self.state = PageState.FREE
        self.rank = -1
        self.block_hash = b""


class Pool:
    """The pages and keys of one page layout (model, KV layout and world size).

    Args:
        name: the pool name, see :func:`kvshelf.protocol.pool_name`.
        page_bytes: size of every page of the pool.
        world_size: number of ranks; keys are per rank.
    """

    def __init__(self, name: str, page_bytes: int, world_size: int) -> None:
        self.name = name
        self.page_bytes = page_bytes
        self.world_size = world_size
        # One table per rank (block hash -> RESERVED or COMMITTED page), so a lookup needs no
        # tuple keys.
        self.tables: list[dict[bytes, Page]] = [{} for _ in range(world_size)]
        self.free: list[Page] = []
        # Unlocked COMMITTED pages, least recently used first.
        self.lru: OrderedDict[int, Page] = OrderedDict()
        self.num_pages = 0
        self.num_committed = 0


class _Reservation:
    __slots__ = ("deadline", "pages", "pool", "rank")

    def __init__(self, pool: Pool, rank: int, pages: list[Page], deadline: float) -> None:
        self.pool = pool
        self.rank = rank
        self.pages = pages
        self.deadline = deadline


class _Lock:
    __slots__ = ("deadline", "pool", "remaining", "shares")

    def __init__(self, pool: Pool, shares: list[list[Page] | None], deadline: float) -> None:
        self.pool = pool
        # shares[rank] is the rank's locked pages, or None once that rank released them.
        self.shares = shares
        self.remaining = len(shares)
        self.deadline = deadline


class CacheIndex:
    """All cache state of the server; single-threaded, driven by the socket loop.

    Args:
        allocator: where pools take their extents from.
        lease_timeout_s: lifetime of a reservation or a lock before the index reclaims it.
        eviction_watermark: in (0, 1]; once reserved plus committed bytes would exceed this
            fraction of the arena, a reserve evicts LRU pages of its pool instead of using free
            space, keeping headroom for pools that still need to grow.
        extent_bytes: the size a pool grows by.
    """

    def __init__(
        self,
        allocator: ExtentAllocator,
        *,
        lease_timeout_s: float,
        eviction_watermark: float,
        extent_bytes: int = DEFAULT_EXTENT_BYTES,
    ) -> None:
        assert lease_timeout_s > 0 and 0 < eviction_watermark <= 1 and extent_bytes > 0
        self._allocator = allocator
        self._lease_timeout_s = lease_timeout_s
        self._watermark_bytes = eviction_watermark * allocator.capacity_bytes
        self._extent_bytes = extent_bytes
        self._pools: dict[str, Pool] = {}
        # Leases all have the same length, so insertion order is deadline order and expiry
        # only ever looks at the front.
        self._reservations: OrderedDict[int, _Reservation] = OrderedDict()
        self._locks: OrderedDict[int, _Lock] = OrderedDict()
        self._next_id = itertools.count(1)
        # Bytes of RESERVED plus COMMITTED pages over all pools.
        self._occupied_bytes = 0
        self._resident_bytes = 0
        self._reserved_objects = 0
        self._locked_objects = 0
        self._counters = dict.fromkeys(
            (
                "committed_objects_total",
                "reserved_objects_total",
                "reserve_skipped_objects_total",
                "reserve_no_space_objects_total",
                "aborted_objects_total",
                "expired_reservations_total",
                "expired_locks_total",
                "lookup_requests_total",
                "lookup_hit_objects_total",
                "loaded_objects_total",
                "evicted_objects_total",
            ),
            0,
        )

    # Requests.

    def register(self, layout: PageLayout) -> Pool:
        """Create the pool for ``layout`` or join the existing one.

        Args:
            layout: the registering worker's layout.

        Returns:
            The pool.

        Raises:
            RequestRejected: LAYOUT_MISMATCH if the pool exists with another page size, or
                INVALID_ARGUMENT if a page does not fit in the arena.
        """
        name = pool_name(layout.model_fingerprint, layout.layout_fingerprint, layout.world_size)
        pool = self._pools.get(name)
        if pool is not None:
            if pool.page_bytes != layout.page_bytes or pool.world_size != layout.world_size:
                raise RequestRejected(
                    ErrorCode.LAYOUT_MISMATCH,
                    f"pool {name} has page_bytes {pool.page_bytes}, "
                    f"world_size {pool.world_size}; got {layout.page_bytes}, {layout.world_size}",
                )
            return pool
        if layout.page_bytes > self._allocator.capacity_bytes:
            raise RequestRejected(
                ErrorCode.INVALID_ARGUMENT,
                f"page_bytes {layout.page_bytes} > arena size {self._allocator.capacity_bytes}",
            )
        pool = Pool(name, layout.page_bytes, layout.world_size)
        self._pools[name] = pool
        return pool

    def lookup(
        self, pool_name: str, hashes: Sequence[bytes], world_size: int, lock: bool, now: float
    ) -> tuple[int, int, list[list[int]]]:
        """Find the longest prefix of ``hashes`` committed for every rank of the pool.

        Args:
            pool_name: the pool; an unknown pool is simply no hit.
            hashes: a request's chained block hashes, in order.
            world_size: the caller's world size; must match the pool's.
            lock: lock the hit pages until every rank releases its share (or the lease ends).
            now: the current monotonic time.

        Returns:
            ``(num_hit_blocks, lock_id, pages)``: ``lock_id`` is 0 and ``pages`` empty unless a
            lock was taken; then ``pages[rank][i]`` is the page of block ``i`` for ``rank``.

        Raises:
            RequestRejected: INVALID_ARGUMENT when ``world_size`` differs from the pool's.
        """
        pool = self._pools.get(pool_name)
        if pool is not None and pool.world_size != world_size:
            raise RequestRejected(
                ErrorCode.INVALID_ARGUMENT,
                f"world_size {world_size} != pool's {pool.world_size}",
            )
        self._counters["lookup_requests_total"] += 1
        if pool is None:
            return 0, 0, []
        num_hits = 0
        for block_hash in hashes:
            for table in pool.tables:
                page = table.get(block_hash)
                if page is None or page.state is not PageState.COMMITTED:
                    break
            else:
                num_hits += 1
                continue
            break
        if num_hits == 0:
            return 0, 0, []
        self._counters["lookup_hit_objects_total"] += num_hits * world_size
        hit_hashes = hashes[:num_hits]
        shares = [[table[h] for h in hit_hashes] for table in pool.tables]
        for share in shares:
            self._touch(pool, share)
        if not lock:
            return num_hits, 0, []
        for share in shares:
            for page in share:
                if page.lock_count == 0:
                    del pool.lru[page.index]
                    self._locked_objects += 1
                page.lock_count += 1
        lock_id = next(self._next_id)
        self._locks[lock_id] = _Lock(pool, list(shares), now + self._lease_timeout_s)
        return num_hits, lock_id, [[page.index for page in share] for share in shares]

    def reserve(
        self, pool_name: str, rank: int, hashes: Sequence[bytes], now: float
    ) -> tuple[int, list[int | None]]:
        """Reserve pages to write the blocks ``hashes`` of ``rank``.

        Keys already committed, or being written by a reservation (this one included, for a
        repeated hash), come back as None: skip them. Pages come from the pool's free list, else
        a new extent, else LRU eviction; when none is left the rest of the keys are None too.

        Args:
            pool_name: a registered pool.
            rank: the writing rank.
            hashes: block hashes to write.
            now: the current monotonic time.

        Returns:
            ``(reservation_id, pages)`` with ``pages[i]`` the page index for ``hashes[i]`` or
            None. A reservation is made even when every key is skipped, so the caller can
            commit or abort uniformly.

        Raises:
            RequestRejected: UNKNOWN_POOL, or INVALID_ARGUMENT for a rank out of range.
        """
        pool = self._registered_pool(pool_name)
        if rank >= pool.world_size:
            raise RequestRejected(
                ErrorCode.INVALID_ARGUMENT, f"rank {rank} >= world_size {pool.world_size}"
            )
        table = pool.tables[rank]
        result: list[int | None] = []
        reserved: list[Page] = []
        out_of_space = False
        for block_hash in hashes:
            page = table.get(block_hash)
            if page is not None:
                # Present or being written; a committed hit is still a sign of use.
                if page.state is PageState.COMMITTED and page.lock_count == 0:
                    pool.lru.move_to_end(page.index)
                self._counters["reserve_skipped_objects_total"] += 1
                result.append(None)
                continue
            page = None if out_of_space else self._take_page(pool)
            if page is None:
                out_of_space = True
                self._counters["reserve_no_space_objects_total"] += 1
                result.append(None)
                continue
            page.state = PageState.RESERVED
            page.rank = rank
            page.block_hash = block_hash
            table[block_hash] = page
            self._occupied_bytes += pool.page_bytes
            reserved.append(page)
            result.append(page.index)
        self._reserved_objects += len(reserved)
        self._counters["reserved_objects_total"] += len(reserved)
        reservation_id = next(self._next_id)
        self._reservations[reservation_id] = _Reservation(
            pool, rank, reserved, now + self._lease_timeout_s
        )
        return reservation_id, result

    def commit(self, reservation_id: int) -> None:
        """Make a reservation's pages visible to lookups and evictable.

        Raises:
            RequestRejected: UNKNOWN_RESERVATION (never made, finished or expired).
        """
        reservation = self._pop_reservation(reservation_id)
        pool = reservation.pool
        # Newest at the end; the first block of a chain goes last so that it is evicted after
        # the blocks that depend on it.
        for page in reversed(reservation.pages):
            assert page.state is PageState.RESERVED and page.lock_count == 0
            page.state = PageState.COMMITTED
            pool.lru[page.index] = page
        count = len(reservation.pages)
        pool.num_committed += count
        self._reserved_objects -= count
        self._resident_bytes += count * pool.page_bytes
        self._counters["committed_objects_total"] += count

    def abort(self, reservation_id: int) -> None:
        """Drop a reservation; its pages become free.

        Raises:
            RequestRejected: UNKNOWN_RESERVATION (never made, finished or expired).
        """
        reservation = self._pop_reservation(reservation_id)
        self._counters["aborted_objects_total"] += len(reservation.pages)
        self._drop_reservation(reservation)

    def release(self, lock_id: int, rank: int) -> None:
        """Release ``rank``'s share of a lock: that rank has finished reading its pages.

        Raises:
            RequestRejected: UNKNOWN_LOCK for a lock that is not live or a share already
                released, INVALID_ARGUMENT for a rank out of range.
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
        self._counters["loaded_objects_total"] += len(share)
        self._release_share(lock, rank)
        if lock.remaining == 0:
            del self._locks[lock_id]

    def expire(self, now: float) -> int:
        """Reclaim reservations and locks whose lease ended at or before ``now``.

        Returns:
            How many leases expired.
        """
        expired = 0
        while self._reservations:
            reservation_id, reservation = next(iter(self._reservations.items()))
            if reservation.deadline > now:
                break
            del self._reservations[reservation_id]
            self._drop_reservation(reservation)
            expired += 1
        self._counters["expired_reservations_total"] += expired
        expired_locks = 0
        while self._locks:
            lock_id, lock = next(iter(self._locks.items()))
            if lock.deadline > now:
                break
            del self._locks[lock_id]
            for rank, share in enumerate(lock.shares):
                if share is not None:
                    self._release_share(lock, rank)
            expired_locks += 1
        self._counters["expired_locks_total"] += expired_locks
        return expired + expired_locks

    def stats(self) -> dict[str, int]:
        """Gauges and monotonic counters (``*_total``) of the index."""
        return {
            "resident_objects": sum(pool.num_committed for pool in self._pools.values()),
            "resident_bytes": self._resident_bytes,
            "reserved_objects": self._reserved_objects,
            "locked_objects": self._locked_objects,
            "capacity_bytes": self._allocator.capacity_bytes,
            "allocated_bytes": self._allocator.used_bytes,
            "pools": len(self._pools),
            "active_reservations": len(self._reservations),
            "active_locks": len(self._locks),
            **self._counters,
        }

    def check_invariants(self) -> None:
        """Assert the invariants in the module docstring; O(pages), for tests and debugging."""
        reserved = {id(p) for r in self._reservations.values() for p in r.pages}
        lock_counts: dict[int, int] = {}
        for lock in self._locks.values():
            live = [share for share in lock.shares if share is not None]
            assert len(live) == lock.remaining > 0
            for share in live:
                for page in share:
                    lock_counts[id(page)] = lock_counts.get(id(page), 0) + 1
        occupied = resident = 0
        for pool in self._pools.values():
            free = {id(p) for p in pool.free}
            assert len(free) == len(pool.free)
            keyed = 0
            for rank, table in enumerate(pool.tables):
                for block_hash, page in table.items():
                    assert page.rank == rank and page.block_hash == block_hash
                    assert id(page) not in free
                    assert page.lock_count == lock_counts.get(id(page), 0)
                    if page.state is PageState.RESERVED:
                        assert id(page) in reserved and page.lock_count == 0
                    else:
                        assert page.state is PageState.COMMITTED
                        assert (page.index in pool.lru) == (page.lock_count == 0)
                        resident += pool.page_bytes
                    keyed += 1
                    occupied += pool.page_bytes
            assert all(p.state is PageState.FREE and p.lock_count == 0 for p in pool.free)
            assert keyed + len(free) == pool.num_pages
            assert all(p.state is PageState.COMMITTED for p in pool.lru.values())
        assert occupied == self._occupied_bytes and resident == self._resident_bytes
        assert len(reserved) == self._reserved_objects
        assert len(lock_counts) == self._locked_objects

    # Internals.

    def _registered_pool(self, name: str) -> Pool:
        pool = self._pools.get(name)
        if pool is None:
            raise RequestRejected(ErrorCode.UNKNOWN_POOL, f"pool {name} is not registered")
        return pool

    def _pop_reservation(self, reservation_id: int) -> _Reservation:
        reservation = self._reservations.pop(reservation_id, None)
        if reservation is None:
            raise RequestRejected(
                ErrorCode.UNKNOWN_RESERVATION, f"no live reservation {reservation_id}"
            )
        return reservation

    def _drop_reservation(self, reservation: _Reservation) -> None:
        pool = reservation.pool
        table = pool.tables[reservation.rank]
        for page in reservation.pages:
            assert page.state is PageState.RESERVED
            del table[page.block_hash]
            page.clear()
            pool.free.append(page)
        self._reserved_objects -= len(reservation.pages)
        self._occupied_bytes -= len(reservation.pages) * pool.page_bytes

    def _release_share(self, lock: _Lock, rank: int) -> None:
        share = lock.shares[rank]
        assert share is not None
        lock.shares[rank] = None
        lock.remaining -= 1
        pool = lock.pool
        for page in reversed(share):
            assert page.state is PageState.COMMITTED and page.lock_count > 0
            page.lock_count -= 1
            if page.lock_count == 0:
                pool.lru[page.index] = page
                self._locked_objects -= 1

    def _touch(self, pool: Pool, pages: list[Page]) -> None:
        # Reversed, so a chain's first block ends up most recently used: eviction then takes
        # the tails of chains first, which keeps the remaining prefixes useful.
        lru = pool.lru
        for page in reversed(pages):
            if page.lock_count == 0:
                lru.move_to_end(page.index)

    def _take_page(self, pool: Pool) -> Page | None:
        """A FREE page for ``pool`` (removed from its free list), or None when none is left."""
        over_watermark = self._occupied_bytes + pool.page_bytes > self._watermark_bytes
        if over_watermark and pool.lru:
            return self._evict(pool)
        if not pool.free:
            self._grow(pool)
        if pool.free:
            return pool.free.pop()
        if pool.lru:
            return self._evict(pool)
        return None

    def _grow(self, pool: Pool) -> None:
        wanted = max(1, min(self._extent_bytes // pool.page_bytes, MAX_PAGES_PER_EXTENT))
        extent = self._allocator.allocate(pool.page_bytes, wanted)
        # Pop order is ascending page index, which keeps a pool's writes roughly sequential.
        pool.free.extend(Page(index) for index in reversed(extent))
        pool.num_pages += len(extent)

    def _evict(self, pool: Pool) -> Page:
        _, page = pool.lru.popitem(last=False)
        assert page.state is PageState.COMMITTED and page.lock_count == 0
        del pool.tables[page.rank][page.block_hash]
        pool.num_committed -= 1
        self._resident_bytes -= pool.page_bytes
        self._occupied_bytes -= pool.page_bytes
        self._counters["evicted_objects_total"] += 1
        page.clear()
        return page
