"""The cache index: pools, where each key lives, lookups, reservations and locks with leases
(their records and lease bound: :mod:`kvshelf.server.leases`; the live reservations and their
end: :mod:`kvshelf.server.reservations`; the live locks: :mod:`kvshelf.server.locks`).

Each key ``(rank, block_hash)`` of a pool maps to one entry ``(tier, location)``
(:mod:`kvshelf.server.pool`): an L1 page of the arena tier, or an object that only a tier
below L1 holds (STORED). The index drives the tiers through their verbs
(:mod:`kvshelf.server.tiers.base`) and never does I/O.

Page life cycle (L1 pages, per pool)::

    FREE --reserve--> RESERVED --commit--> COMMITTED --evict--> FREE
      |                   |                   ^
      |                   +--abort/expire-----|-----------------> FREE
      |                                       |
      +---fetch---> FILLING ---landed---------+
                       |
                       +--not landed----------------------------> FREE

A COMMITTED page is pinned (``lock_count`` up, then down) by lock shares, by a tier below L1
copying it behind its commit, and by a fetch of a lookup whose prefix it is part of.

A reservation that ends without its commit (abort, lease end) frees, with its own pages, the
other ranks' pages of the blocks its rank does not hold: those blocks cannot become whole from
it, so none stays committed by some ranks only (docs/safety.md, "Stopping an engine";
:mod:`kvshelf.server.reservations`).

A lookup answers the longest prefix of its hashes that is COMMITTED in L1 for every rank, at
once. Where that prefix goes on in STORED entries, and tiers below are configured, the lookup
is deferred instead (:class:`~kvshelf.server.lower_tiers.DeferredLookup`): those objects are
loaded into FILLING pages off the loop, committed when they land, and the lookup is answered
then. A commit hands the committed pages to the tiers below (store behind).

Invariants (checked by :meth:`CacheIndex.check_invariants`):

- a key maps to at most one entry: a RESERVED or COMMITTED page, or a STORED entry of a tier
  below L1;
- a RESERVED page belongs to exactly one live reservation and is never locked or evicted;
- a FILLING page belongs to exactly one fetch in flight, has no key and is never evicted;
- a COMMITTED page is in its pool's eviction policy iff nothing pins it (lock shares, stores
  behind, fetches); only pages in the policy are evicted;
- a FREE page has no key and sits in its pool's free list;
- a page to be freed at its commit (another rank gave up its block) is RESERVED.

Every public operation validates its arguments before it changes anything, so a rejected
request (:class:`RequestRejected`) leaves the index exactly as it was.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvshelf.metric_types import Kind
from kvshelf.metrics import SERVER
from kvshelf.protocol import ErrorCode, MissReason, PageLayout
from kvshelf.server.completions import Completions
from kvshelf.server.event_log import EventLogs, probed
from kvshelf.server.hit_ends import choose_end
from kvshelf.server.leases import RequestRejected, take_lease_units
from kvshelf.server.limits import CLEAR_PAGES_PER_REQUEST, UNLIMITED, IndexLimits
from kvshelf.server.locks import Locks
from kvshelf.server.lower_tiers import (
    FETCH_ANSWER_WITHIN_S,
    DeferredLookup,
    IndexHit,
    LowerTiers,
)
from kvshelf.server.misses import MISS_COUNTERS, miss_reason
from kvshelf.server.pool import Entry, EntryState, Pool
from kvshelf.server.pool_life import PoolLife
from kvshelf.server.request_cost import check_objects, held_prefix
from kvshelf.server.reservations import Reservations
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.base import Tier


class CacheIndex:
    """All cache state of the server; single-threaded, driven by the socket loop.

    Args:
        tiers: the arena tier (L1) first, then the tiers below it, fastest first.
        lease_timeout_s: lifetime of a reservation or a lock before the index reclaims it.
        completions: where tiers below L1 post their finished jobs; needed when there are any.
        clock: the clock of the callers' ``now``, for leases of lookups answered after a fetch.
        limits: the bounds on pages, pools and leases (:mod:`kvshelf.server.limits`); the
            server passes its configured ones.
        fetch_answer_within_s: the longest a lookup waits for tiers below L1 before it is
            answered "pending".
        pools: pools adopted from a dead server's arena (:mod:`kvshelf.server.adoption`),
            already in the arena tier; tiers below L1 attach after them.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        lease_timeout_s: float,
        completions: Completions | None = None,
        clock: Callable[[], float] = time.monotonic,
        limits: IndexLimits = UNLIMITED,
        fetch_answer_within_s: float = FETCH_ANSWER_WITHIN_S,
        pools: Sequence[Pool] = (),
    ) -> None:
        assert lease_timeout_s > 0 and isinstance(tiers[0], ArenaTier)
        self._fetch_answer_within_s = fetch_answer_within_s
        self._arena = tiers[0]
        self._limits = limits
        self._lease_timeout_s = lease_timeout_s
        self._clock = clock
        self._below: LowerTiers | None = None
        if len(tiers) > 1:
            assert completions is not None, "tiers below L1 need completions"
            self._below = LowerTiers(self._arena, tiers[1:], completions, self._fetched)
        self._pools: dict[str, Pool] = {pool.name: pool for pool in pools}
        # Registration and retirement of pools (kvshelf.server.pool_life).
        self._life = PoolLife(
            self._pools, limits.max_pools, self._pool_busy, self._drop_pool, self._arena.counters
        )
        self._reservations = Reservations(self._arena, lease_timeout_s)
        self._locks = Locks(self._arena)
        # One set of counters per server: the arena tier's, which it counts in too.
        self.counters = self._arena.counters
        # What each pool's readable contents became (kvshelf.server.event_log), for routers.
        self.events = EventLogs()
        self._arena.forgotten = self.events.forgotten
        for tier in tiers[1:]:
            tier.attach(self)

    # Requests.

    def register(
        self, layout: PageLayout, retires: str = "", holder: int = 0, *, restoring: bool = False
    ) -> Pool:
        """Create the pool for ``layout`` or join the existing one (its life cycle:
        :mod:`kvshelf.server.pool_life`).

        Args:
            layout: the registering worker's layout.
            retires: the pool the registering rank used before (a new identity epoch replaced
                it): ``holder`` lets go of it, retired when it was the last holder.
            holder: the registrant's holder token (0: none, it holds nothing).
            restoring: a tier below L1 makes its pools again at start: at the limit the pool is
                refused, never another one retired for it.

        Returns:
            The pool.

        Raises:
            RequestRejected: LAYOUT_MISMATCH if the pool exists with another page size,
                INVALID_ARGUMENT if a page is under the minimum or does not fit in the arena,
                LIMIT_EXCEEDED when the server holds its maximum number of pools and none is
                idle.
        """
        name = layout.pool
        now = None if restoring else self._clock()
        pool = self._life.find(name)
        victim: Pool | None = None
        if pool is not None:
            if pool.page_bytes != layout.page_bytes or pool.readers != layout.world_size:
                raise RequestRejected(
                    ErrorCode.LAYOUT_MISMATCH,
                    f"pool {name} has page_bytes {pool.page_bytes}, "
                    f"world_size {pool.readers}; got {layout.page_bytes}, {layout.world_size}",
                )
        else:
            if layout.page_bytes < self._limits.min_page_bytes:
                raise RequestRejected(
                    ErrorCode.INVALID_ARGUMENT,
                    f"page_bytes {layout.page_bytes} < the minimum {self._limits.min_page_bytes}",
                )
            if layout.page_bytes > self._arena.capacity_bytes:
                raise RequestRejected(
                    ErrorCode.INVALID_ARGUMENT,
                    f"page_bytes {layout.page_bytes} > arena size {self._arena.capacity_bytes}",
                )
            victim = self._life.victim(retires, holder, now)
            pool = Pool.of_layout(layout)
        # Accepted: nothing above changed the index.
        self._life.admit(pool, retires, holder, victim, now)
        return pool

    def lookup(
        self,
        pool_name: str,
        hashes: Sequence[bytes],
        world_size: int,
        lock: bool,
        now: float,
        fetch: bool = True,
    ) -> IndexHit | DeferredLookup:
        """Find the longest prefix of ``hashes`` committed for every rank of the pool.

        Args:
            pool_name: the pool; an unknown pool is simply no hit.
            hashes: a request's chained block hashes, in order.
            world_size: the caller's world size; must match the pool's.
            lock: lock the hit pages until every rank releases its share (or the lease ends).
            now: the current monotonic time.
            fetch: load blocks held by tiers below L1 into L1 first; False answers from L1
                at once.

        Returns:
            ``(num_hit_blocks, lock_id, pages)``: ``lock_id`` is 0 and ``pages`` empty unless a
            lock was taken; then ``pages[rank][i]`` is the page of block ``i`` for ``rank``.
            Or, when tiers below L1 hold the blocks after the L1 prefix, a pending lookup whose
            ``answer`` the caller sets: it gets that result once they are loaded into L1, or
            None ("pending": ask again) after ``FETCH_ANSWER_WITHIN_S``.

        Raises:
            RequestRejected: INVALID_ARGUMENT when ``world_size`` differs from the pool's or
                the lookup names more objects than one request may
                (:func:`~kvshelf.server.request_cost.check_objects`).
        """
        pool = self._lookup_pool(pool_name, world_size, "hashes", len(hashes))
        self.counters.add("lookup_requests_total")
        stored_ranks = world_size if pool is None else pool.world_size
        self.counters.add("lookup_requested_objects_total", len(hashes) * stored_ranks)
        if pool is None:
            return 0, 0, []
        pool.last_used = now
        num_hits = held_prefix(pool, hashes)
        if num_hits < len(hashes):
            pool.policy.missed(hashes[num_hits])
        if fetch and num_hits < len(hashes) and self._below is not None:
            deadline = now + self._fetch_answer_within_s
            pending = self._below.fetch(pool, hashes, num_hits, lock, deadline)
            if pending is not None:
                return pending
        return self._hit(pool, hashes, num_hits, lock, now)

    def choose_end(
        self,
        pool_name: str,
        world_size: int,
        hashes: Sequence[bytes],
        block_keys: int,
        ends: Sequence[Sequence[bytes]],
        fetch: bool = True,
    ) -> tuple[list[bytes], int]:
        """Where the hit of a lookup with ``ends`` would end, in the pool ``pool_name``
        (:func:`kvshelf.server.hit_ends.choose_end`).

        Raises:
            RequestRejected: INVALID_ARGUMENT as for :meth:`lookup`, ``hashes`` and ``ends``
                counted together.
        """
        num_keys = len(hashes) + sum(len(keys) for keys in ends)
        pool = self._lookup_pool(pool_name, world_size, "hashes and ends", num_keys)
        return choose_end(pool, hashes, block_keys, ends, fetch)

    def count_miss(self, pool_name: str, hashes: Sequence[bytes], num_hits: int) -> MissReason:
        """Count a lookup answered ``num_hits`` blocks under the reason of its first miss.

        Call it with the answer (a deferred lookup's once its fetch is over): the reason is the
        state of ``hashes[num_hits]`` now (:func:`~kvshelf.server.misses.miss_reason`).

        Returns:
            The reason (NONE, counting nothing, when every block hit).
        """
        if num_hits >= len(hashes):
            return MissReason.NONE
        reason = miss_reason(
            pool_name, self._pools.get(pool_name), hashes[num_hits], self._arena.evicted
        )
        self.counters.add(MISS_COUNTERS[reason])
        return reason

    def read_events(
        self, pool_name: str, after_seq: int, probe: Sequence[bytes]
    ) -> tuple[list[tuple[int, bytes]], int, bool, list[int]]:
        """The pool's event log from ``after_seq`` on (:meth:`EventLogs.read`), and where each
        ``probe`` hash is (:func:`kvshelf.server.event_log.probed`); an unknown pool is
        empty.

        Raises:
            RequestRejected: INVALID_ARGUMENT for a probe over its budget.
        """
        pool = self._pools.get(pool_name)
        where = probed(pool, probe)
        return (*self.events.read(pool, after_seq), where)

    def pool_objects(self) -> dict[str, int]:
        """Committed L1 objects per pool name; safe to call from another thread."""
        return {name: pool.num_committed for name, pool in dict(self._pools).items()}

    def reserve(
        self, pool_name: str, rank: int, hashes: Sequence[bytes], now: float, tenant: str = ""
    ) -> tuple[int, list[int | None]]:
        """Reserve pages to write the blocks ``hashes`` of ``rank``.

        Keys already present in any tier, or being written by a reservation (this one
        included, for a repeated hash), come back as None: skip them. Pages come from the
        pool's free list, else a new extent, else eviction; when none is left the rest of
        the keys are None too.

        Args:
            pool_name: a registered pool.
            rank: the writing rank.
            hashes: block hashes to write.
            now: the current monotonic time.
            tenant: who stores (:mod:`kvshelf.server.tenants`).

        Returns:
            ``(reservation_id, pages)`` with ``pages[i]`` the page index for ``hashes[i]`` or
            None. A reservation is made even when every key is skipped, so the caller can
            commit or abort uniformly.

        Raises:
            RequestRejected: UNKNOWN_POOL, INVALID_ARGUMENT for a rank out of range or for
                more keys than one request may name for the pool's stored ranks (ending the
                reservation without its commit looks each key up in every stored rank's
                table: charged now, as a lookup is), or LIMIT_EXCEEDED when the pool's leases
                would exceed their bound.
        """
        pool = self._registered_pool(pool_name, rank)
        check_objects("hashes", len(hashes), pool.world_size)
        units = self._take_lease_units(pool, 1 + len(hashes))
        pool.last_used = now
        reservation_id = self._new_id()
        reservation = self._reservations.reserve(
            reservation_id, pool, rank, hashes, now, tenant, units
        )
        return reservation_id, reservation.locations

    def commit(self, reservation_id: int) -> None:
        """Make a reservation's pages visible to lookups and evictable; store them behind.

        Raises:
            RequestRejected: UNKNOWN_RESERVATION (never made, finished or expired).
        """
        reservation = self._reservations.commit(reservation_id)
        self.events.committed(reservation.pool, [page.block_hash for page in reservation.pages])
        if self._below is not None and reservation.pages:
            self._below.store(reservation.pool, reservation.rank, reservation.pages)

    def abort(self, reservation_id: int) -> None:
        """Drop a reservation; its pages become free, and so do the other ranks' pages of the
        blocks its rank does not hold (:mod:`kvshelf.server.reservations`).

        Raises:
            RequestRejected: UNKNOWN_RESERVATION (never made, finished or expired).
        """
        self._reservations.abort(reservation_id)

    def release(self, lock_id: int, rank: int, copied: int = 0) -> None:
        """Release ``rank``'s share of a lock: that rank has finished reading its pages.

        Args:
            lock_id: the lock.
            rank: the releasing rank.
            copied: how many of the share's pages the rank copied (``loaded_objects_total``).

        Raises:
            RequestRejected: UNKNOWN_LOCK for a lock that is not live or a share already
                released, INVALID_ARGUMENT for a rank out of range or more pages copied than
                the share holds.
        """
        self._locks.release(lock_id, rank, copied)

    def unlock(self, lock_id: int) -> None:
        """Release every share of a lock nobody will load (its lookup's client is gone)."""
        self._locks.unlock(lock_id)

    def expire(self, now: float) -> int:
        """Reclaim reservations and locks whose lease ended at or before ``now``; answer
        "pending" the lookups waiting for tiers below L1 past their deadline.

        Returns:
            How many leases expired.
        """
        if self._below is not None:
            self._below.expire(now)
        self._arena.end_quarantine(now)
        expired = self._reservations.expire(now)
        expired_locks = self._locks.expire(now)
        self._life.sweep(now)
        return expired + expired_locks

    # Tiers below L1.

    def add_stored(
        self, pool_name: str, rank: int, block_hash: bytes, tier: Tier, location: Any
    ) -> bool:
        """Record that ``tier`` (below L1) holds the object of a key; on the loop's thread.

        Args:
            pool_name: a registered pool.
            rank, block_hash: the key.
            tier: one of the index's tiers below L1.
            location: where the tier holds the object.

        Returns:
            Whether it was recorded: False when the key already has an entry.

        Raises:
            RequestRejected: UNKNOWN_POOL, or INVALID_ARGUMENT for a rank out of range.
        """
        assert self._below is not None and tier in self._below.tiers
        pool = self._registered_pool(pool_name)
        if rank >= pool.world_size:
            raise RequestRejected(
                ErrorCode.INVALID_ARGUMENT, f"rank {rank} >= stored ranks {pool.world_size}"
            )
        table = pool.tables[rank]
        if block_hash in table:
            return False
        table[block_hash] = Entry(tier, location, rank, block_hash)
        if pool.ranks is not None:
            pool.ranks.on_stored(block_hash)
        return True

    def remove_stored(self, pool_name: str, rank: int, block_hash: bytes, tier: Tier) -> bool:
        """Forget a key's STORED entry of ``tier`` (the tier no longer holds its object).

        Returns:
            Whether there was such an entry.
        """
        pool = self._pools.get(pool_name)
        if pool is None or rank >= pool.world_size:
            return False
        table = pool.tables[rank]
        entry = table.get(block_hash)
        if entry is None or entry.tier is not tier or entry.state is not EntryState.STORED:
            return False
        del table[block_hash]
        if pool.ranks is not None:
            pool.ranks.on_dropped(block_hash, in_l1=False)
        self.events.dropped_below(pool, rank, block_hash)
        return True

    def clear(self, shared: bool = False) -> tuple[int, int, int, int, bool]:
        """Drop up to ``CLEAR_PAGES_PER_REQUEST`` committed L1 objects that no lock pins, and,
        once none is left, what the tiers below hold (:meth:`LowerTiers.clear`: a shared tier
        only when ``shared``). A caller with objects left asks again: one request never holds
        the loop for a whole arena.

        Pools, reservations and locks stay: workers keep their mappings, stores in flight
        commit, loads in flight read pages that stay until released.

        Returns:
            ``(L1 objects dropped, L1 objects left to drop, L1 objects kept because a lock
            pins them, objects dropped below L1, whether a shared tier started clearing)``.
        """
        budget = CLEAR_PAGES_PER_REQUEST
        cleared = 0
        touched = []
        for pool in self._pools.values():
            if budget == 0:
                break
            if pool.policy:
                dropped = self._arena.clear(pool, budget)
                touched.append(pool)
                cleared += dropped
                budget -= dropped
        self.counters.add("cleared_objects_total", cleared)
        left = sum(len(pool.policy) for pool in self._pools.values())
        locked = sum(pool.num_committed for pool in self._pools.values()) - left
        # The dropped pages were not logged one by one: their pools' readers start over. The
        # request that clears the tiers below does so for every pool, as their objects go too.
        for pool in touched if left else self._pools.values():
            self.events.reset(pool)
        if left or self._below is None:
            return cleared, left, locked, 0, False
        return cleared, left, locked, *self._below.clear(shared)

    @property
    def fetching(self) -> bool:
        """Whether lookups wait for tiers below L1 (see :meth:`expire`)."""
        return self._below is not None and self._below.fetching

    def lapsed(self, now: float) -> bool:
        """Whether reservations whose lease ended are left for the next :meth:`expire` (each
        call ends at most a request's bound of them)."""
        return self._reservations.lapsed(now)

    # Reports.

    def stats(self) -> dict[str, int]:
        """Gauges and monotonic counters (``*_total``) of the index and its tiers; the gauges
        of tiers not configured are 0."""
        return {
            **dict.fromkeys(SERVER.names(Kind.GAUGE), 0),
            **self._arena.stats(),
            "pools": len(self._life),
            "active_reservations": len(self._reservations),
            "active_locks": len(self._locks),
            **self.counters.snapshot(),
            **(self._below.stats() if self._below is not None else {}),
        }

    def check_invariants(self) -> None:
        """Assert the invariants in the module docstring; O(pages), for tests and debugging."""
        readers: dict[int, int] = {}
        shares = self._locks.pinned()
        if self._below is not None:
            shares.extend(self._below.pinned())
        for pages in shares:
            for page in pages:
                readers[id(page)] = readers.get(id(page), 0) + 1
        below = set(self._below.tiers) if self._below is not None else set()
        pools = self._life.held()
        for pool in pools:
            for rank, table in enumerate(pool.tables):
                for block_hash, entry in table.items():
                    assert entry.rank == rank and entry.block_hash == block_hash
                    assert entry.tier is self._arena or (
                        entry.tier in below and entry.state is EntryState.STORED
                    )
        reserved = self._reservations.check_invariants()
        filling = self._below.filling() if self._below is not None else []
        self._arena.check_invariants(pools, readers, reserved, filling)

    def close(self) -> None:
        """Close the tiers below L1 (their threads stop); the arena is closed by its owner."""
        if self._below is not None:
            self._below.close()

    # Internals.

    def _lookup_pool(self, name: str, world_size: int, field: str, num_keys: int) -> Pool | None:
        """The pool a lookup of ``num_keys`` keys (in ``field``) asks about, None when unknown;
        checked before any look-up: its cost, then its world size."""
        check_objects(field, num_keys, world_size)
        pool = self._pools.get(name)
        if pool is not None and pool.readers != world_size:
            raise RequestRejected(
                ErrorCode.INVALID_ARGUMENT,
                f"world_size {world_size} != pool's {pool.readers}",
            )
        return pool

    def _hit(
        self, pool: Pool, hashes: Sequence[bytes], num_hits: int, lock: bool, now: float
    ) -> IndexHit:
        """Count, touch and (when asked) lock the L1 prefix ``hashes[:num_hits]``."""
        if num_hits == 0:
            return 0, 0, []
        units = self._take_lease_units(pool, 1 + num_hits * pool.readers) if lock else 0
        self.counters.add("lookup_hit_objects_total", num_hits * pool.world_size)
        hit_hashes = hashes[:num_hits]
        if not lock:
            # Only marked as used: each distinct page once, one rank at a time.
            distinct = list(dict.fromkeys(hit_hashes))
            for table in pool.tables:
                self._arena.touch(pool, [table[h] for h in distinct])
            return num_hits, 0, []
        pages = [[table[h] for h in hit_hashes] for table in pool.tables]
        for share in pages:
            self._arena.touch(pool, share)
        # One share per reading rank: the replicas of a stored rank pin the same pages, each
        # until it released them (a rank that wrote none of them releases like any other).
        readers = [pages[rank // pool.replicas] for rank in range(pool.readers)]
        lock_id = self._new_id()
        self._locks.lock(lock_id, pool, readers, now + self._lease_timeout_s, units)
        self.counters.add("locked_objects_total", num_hits * pool.world_size)
        return num_hits, lock_id, [[page.location for page in share] for share in readers]

    def _fetched(self, pending: DeferredLookup) -> None:
        """A fetch is complete: answer its lookup from what is in L1 now."""
        num_hits = held_prefix(pending.pool, pending.hashes)
        try:
            result = self._hit(pending.pool, pending.hashes, num_hits, pending.lock, self._clock())
        except RequestRejected:
            # Over the pool's lease bound: answered as a miss, nothing locked.
            result = (0, 0, [])
        assert pending.answer is not None, "a pending lookup nobody waits for"
        pending.answer(result)

    def _new_id(self) -> int:
        """A reservation or lock id: random 63 bits, so that no client can guess another's
        (nor a request sent before a restart name this boot's); never 0 (none) nor live."""
        while True:
            lease_id = secrets.randbits(63)
            if lease_id and lease_id not in self._reservations and lease_id not in self._locks:
                return lease_id

    def _take_lease_units(self, pool: Pool, units: int) -> int:
        return take_lease_units(pool, units, self._limits.max_lease_units_per_pool, self.counters)

    def _registered_pool(self, name: str, rank: int = 0) -> Pool:
        pool = self._pools.get(name)
        if pool is None:
            raise RequestRejected(ErrorCode.UNKNOWN_POOL, f"pool {name} is not registered")
        if rank >= pool.readers:
            raise RequestRejected(
                ErrorCode.INVALID_ARGUMENT, f"rank {rank} >= world_size {pool.readers}"
            )
        return pool

    # Internals: retiring pools (kvshelf.server.pool_life).

    def _pool_busy(self, pool: Pool) -> bool:
        """Whether a lease (reserved or locked pages), the quarantine or a job of a tier below
        (a fetch's pinned and filling pages, a store behind) holds ``pool``; never O(pages)."""
        return (
            pool.lease_units > 0
            or self._arena.quarantine.holds(pool)
            or (self._below is not None and self._below.uses(pool))
        )

    def _drop_pool(self, pool: Pool) -> None:
        """Free a retired pool's pages and forget it in every tier and its event log."""
        self._arena.drop(pool)
        if self._below is not None:
            self._below.drop(pool)
        self.events.drop(pool)
