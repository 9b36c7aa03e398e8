"""Leases of the cache index: the reservations and locks a client holds for a while, and the
bound on how much of a pool they may hold at once.

Owns the lease records (:class:`Reservation`, :class:`Lock`), the error a refused request
raises (:class:`RequestRejected`) and the charging of lease units to a pool. What a lease does
to pages (pinning, freeing) is the index's and the arena's: this module never touches a tier
and must not import :mod:`kvshelf.server.index`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshelf.metric_types import Counters
from kvshelf.protocol import ErrorCode
from kvshelf.server.pool import Pool
from kvshelf.server.tiers.base import TierLoad, TierStore


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


class Reservation(TierStore):
    """A client's store into the arena, until its commit, abort or lease end."""

    __slots__ = ("deadline", "units")

    def __init__(
        self, pool: Pool, rank: int, hashes: Sequence[bytes], deadline: float, units: int
    ) -> None:
        super().__init__(pool, rank, hashes)
        self.deadline = deadline
        self.units = units


class Lock:
    """A lookup's lock: one share of pinned pages per rank, until every rank releases its share
    or the lease ends."""

    __slots__ = ("deadline", "pool", "remaining", "shares", "units")

    def __init__(
        self, pool: Pool, shares: list[TierLoad | None], deadline: float, units: int
    ) -> None:
        self.pool = pool
        # shares[rank] is the rank's load of its pages, or None once that rank released them.
        self.shares = shares
        self.remaining = len(shares)
        self.deadline = deadline
        self.units = units

    def take_share(self, rank: int) -> TierLoad:
        """Mark ``rank``'s share released and return it (the caller completes its load)."""
        share = self.shares[rank]
        assert share is not None
        self.shares[rank] = None
        self.remaining -= 1
        return share


def take_lease_units(pool: Pool, units: int, limit: int, counters: Counters) -> int:
    """Charge ``units`` to the pool's leases, or reject the request before any change.

    Args:
        pool: the pool the lease is in.
        units: what the lease costs (1 plus its pages, per rank for a lock).
        limit: the pool's bound (``IndexLimits.max_lease_units_per_pool``).
        counters: the server's counters (``rejected_over_limit_total``).

    Returns:
        ``units``, for the lease to give back when it ends.

    Raises:
        RequestRejected: LIMIT_EXCEEDED when the pool's leases would exceed ``limit``.
    """
    if pool.lease_units + units > limit:
        counters.add("rejected_over_limit_total")
        raise RequestRejected(
            ErrorCode.LIMIT_EXCEEDED,
            f"pool {pool.name} has {pool.lease_units} of its {limit} lease units in live "
            f"reservations and locks; this request needs {units}",
        )
    pool.lease_units += units
    return units
