"""The cache index's live reservations: made, then ended by their commit, abort or lease end.

Owns the reservations by id (in deadline order) and the rule for blocks that cannot become
whole (the index's docstring, :mod:`kvshelf.server.index`): a reservation that ends without
its commit frees, with its own pages, the other ranks' pages of the blocks its rank does not
hold, and RESERVED ones among them are freed at their commit instead of shown. What a page
goes through is the arena tier's; what a commit tells the event log and the tiers below L1 is
the index's. Must not import :mod:`kvshelf.server.index` (nor torch or vLLM).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import repeat

from kvshelf.protocol import MAX_OBJECTS_PER_REQUEST, ErrorCode
from kvshelf.server.leases import RequestRejected, Reservation
from kvshelf.server.pool import EntryState, Page, Pool
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.base import TierStore


class Reservations:
    """The live reservations of one index, single-threaded on the socket loop.

    Args:
        arena: the arena tier (L1), whose pages reservations take; its counters are counted in.
        lease_timeout_s: how long a reservation lives before :meth:`expire` ends it.
    """

    def __init__(self, arena: ArenaTier, lease_timeout_s: float) -> None:
        self._arena = arena
        self._lease_timeout_s = lease_timeout_s
        self.counters = arena.counters
        # Leases all have the same length, so insertion order is deadline order and expiry
        # only ever looks at the front.
        self._reservations: OrderedDict[int, Reservation] = OrderedDict()
        # RESERVED pages (by id) of blocks another rank's reservation ended without writing:
        # freed at their commit instead of shown (see _end_uncommitted).
        self._unwhole: dict[int, Page] = {}

    def __len__(self) -> int:
        return len(self._reservations)

    def __contains__(self, reservation_id: int) -> bool:
        return reservation_id in self._reservations

    def reserve(
        self,
        reservation_id: int,
        pool: Pool,
        rank: int,
        hashes: Sequence[bytes],
        now: float,
        tenant: str,
        units: int,
    ) -> Reservation:
        """Place ``hashes`` of ``rank`` in RESERVED pages (:meth:`ArenaTier.prepare_store`)
        under the new, unused ``reservation_id``, which gives ``units`` back to the pool when
        it ends."""
        # A rank of replicated KV writes its stored rank's objects, which its replicas read.
        stored_rank = rank // pool.replicas
        reservation = Reservation(pool, stored_rank, hashes, now + self._lease_timeout_s, units)
        reservation.tenant = tenant
        self._arena.prepare_store(reservation)
        self._reservations[reservation_id] = reservation
        self.counters.add("reservations_total")
        return reservation

    def commit(self, reservation_id: int) -> Reservation:
        """Make a reservation's pages COMMITTED (but those of blocks that cannot become whole,
        which are freed) and return it.

        Raises:
            RequestRejected: UNKNOWN_RESERVATION (never made, finished or expired).
        """
        reservation = self._pop_reservation(reservation_id)
        reservation.pool.lease_units -= reservation.units
        if self._unwhole:
            self._free_unwhole(reservation)
        self._arena.complete_store(reservation)
        self.counters.add("committed_objects_total", len(reservation.pages))
        return reservation

    def abort(self, reservation_id: int) -> None:
        """Drop a reservation (:meth:`_end_uncommitted`).

        Raises:
            RequestRejected: UNKNOWN_RESERVATION (never made, finished or expired).
        """
        reservation = self._pop_reservation(reservation_id)
        reservation.pool.lease_units -= reservation.units
        self.counters.add("aborted_objects_total", len(reservation.pages))
        self._end_uncommitted(reservation)

    def expire(self, now: float) -> int:
        """End the reservations whose lease ended at or before ``now`` as aborted, at most
        :data:`~kvshelf.protocol.MAX_OBJECTS_PER_REQUEST` objects' worth of them (their keys x
        stored ranks, what :meth:`_end_uncommitted` may look up; at least one): a request's
        bound on the loop. Call again (:attr:`lapsed`) for the rest.

        Returns:
            How many expired.
        """
        expired = 0
        budget = MAX_OBJECTS_PER_REQUEST
        while self._reservations:
            reservation_id, reservation = next(iter(self._reservations.items()))
            if reservation.deadline > now:
                break
            cost = _end_cost(reservation)
            if expired and cost > budget:
                break
            budget -= cost
            del self._reservations[reservation_id]
            reservation.pool.lease_units -= reservation.units
            self._end_uncommitted(reservation)
            expired += 1
        self.counters.add("expired_reservations_total", expired)
        return expired

    def lapsed(self, now: float) -> bool:
        """Whether a reservation's lease ended at or before ``now`` (:meth:`expire` left it)."""
        if not self._reservations:
            return False
        return next(iter(self._reservations.values())).deadline <= now

    def check_invariants(self) -> set[int]:
        """Assert that a page to be freed at its commit is RESERVED.

        Returns:
            The ``id`` of every page of a live reservation.
        """
        reserved = {id(p) for r in self._reservations.values() for p in r.pages}
        assert self._unwhole.keys() <= reserved
        return reserved

    def _pop_reservation(self, reservation_id: int) -> Reservation:
        reservation = self._reservations.pop(reservation_id, None)
        if reservation is None:
            raise RequestRejected(
                ErrorCode.UNKNOWN_RESERVATION, f"no live reservation {reservation_id}"
            )
        return reservation

    def _end_uncommitted(self, reservation: Reservation) -> None:
        """Free the pages of a reservation that ended without its commit (abort, lease end),
        and the other ranks' pages of each of its blocks its rank does not hold now (neither
        committed nor being written by another of its reservations): such a block cannot
        become whole from this store, and a block committed by some ranks only is a miss that
        holds memory (``miss_rank_incomplete_total``). Their committed pages nothing pins are
        freed now, their reserved ones at their commit; a page a tier below is copying stays.
        """
        for page in reservation.pages:
            self._unwhole.pop(id(page), None)
        self._arena.abort_store(reservation)
        pool = reservation.pool
        if pool.world_size == 1:
            return
        own = pool.tables[reservation.rank]
        tables = pool.tables
        committed: list[Page] = []
        for block_hash in dict.fromkeys(reservation.block_hashes):
            if block_hash in own:
                continue
            # Every stored rank's table asked at C speed (charged at the Reserve: keys x
            # stored ranks); only the entries found come back to Python.
            for page in filter(None, map(dict.get, tables, repeat(block_hash))):
                if not isinstance(page, Page):
                    continue  # an object of a tier below L1 only
                if page.state is EntryState.COMMITTED and page.lock_count == 0:
                    committed.append(page)
                elif page.state is EntryState.RESERVED:
                    self._unwhole[id(page)] = page
        if committed:
            self._arena.drop_unwhole(pool, committed)
            self.counters.add("unwhole_dropped_objects_total", len(committed))

    def _free_unwhole(self, reservation: Reservation) -> None:
        """Free, uncommitted, the pages of a reservation being committed whose blocks another
        rank's reservation ended without writing (:meth:`_end_uncommitted`)."""
        unwhole = [page for page in reservation.pages if self._unwhole.pop(id(page), None)]
        if not unwhole:
            return
        freed = {id(page) for page in unwhole}
        reservation.pages[:] = [page for page in reservation.pages if id(page) not in freed]
        self._arena.abort_store(TierStore(reservation.pool, reservation.rank, (), unwhole))
        self.counters.add("unwhole_dropped_objects_total", len(unwhole))


def _end_cost(reservation: Reservation) -> int:
    """The objects ending ``reservation`` without its commit may look up: its keys in every
    stored rank's table (charged when it was made, :meth:`CacheIndex.reserve`)."""
    return max(1, len(reservation.block_hashes)) * reservation.pool.world_size
