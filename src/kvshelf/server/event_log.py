"""What each pool's readable contents became, as a bounded, sequence-numbered log per pool.

KV-aware routers learn from vLLM's KV events stream what an engine can load; the connector
(``kvshelf.roles.events``) publishes kvshelf's part of it from this log. A block enters the
log as STORED once it is COMMITTED in L1 for every rank of its pool (a lookup would hit it),
and as REMOVED when it stops being so (eviction, ``kvshelf clear``), whoever stored it.
Readers ask for the entries after the last sequence number they saw, so a removal is never
missed: when the entries they need were dropped (the log holds at most ``capacity`` per pool)
the read says so (``overflowed``), and the reader starts again from the pool's current
contents, which :meth:`EventLogs.present` tells for the hashes it knows. ``kvshelf clear``
resets the pool's log the same way rather than logging every page it drops.

Medium codes (:data:`ABSENT`, :data:`IN_L1`, :data:`BELOW_L1`) say where a probed block is:
readable from L1 for every rank, held for every rank with some rank only below L1 (disk,
Redis: loadable after a fetch), or not whole on this server. A REMOVED entry whose page was
demoted to a tier below L1 (its key stays, as that tier's entry) is a DEMOTED entry.

Runs on the socket loop's thread only. Must not import torch or vLLM.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Iterable, Sequence

from kvshelf.server.pool import EntryState, Pool

# Entries kept per pool: a reader polling every 0.1 s falls behind only if the pool changes
# by more than this in between (about 640k block changes per second).
DEFAULT_CAPACITY = 1 << 16
# The most entries one read returns (a 32-byte hash each: about 0.5 MiB of reply).
MAX_READ = 16384

# Where a probed block is (EventsReply.present).
ABSENT = 0
IN_L1 = 1
BELOW_L1 = 2


class EventKind(enum.IntEnum):
    """The kind of a log entry (EventsReply.kinds). Append-only."""

    STORED = 1  # committed in L1 for every rank
    REMOVED = 2  # no longer in L1 for every rank, and not below L1 either
    DEMOTED = 3  # no longer in L1 for every rank; a tier below L1 keeps the evicted page


class PoolLog:
    """One pool's log: entry ``i`` of ``entries`` has sequence number ``first_seq + i``."""

    __slots__ = ("entries", "first_seq")

    def __init__(self, capacity: int) -> None:
        self.entries: deque[tuple[int, bytes]] = deque(maxlen=capacity)
        self.first_seq = 0

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self.entries)

    def append(self, kind: EventKind, block_hash: bytes) -> None:
        if len(self.entries) == self.entries.maxlen:
            self.first_seq += 1
        self.entries.append((kind, block_hash))

    def reset(self) -> None:
        """Drop every entry: a reader behind this point reads as overflowed."""
        self.first_seq = self.next_seq
        self.entries.clear()


class EventLogs:
    """The logs of every pool, fed by the index's commits and the arena's evictions.

    Args:
        capacity: entries kept per pool.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        assert capacity > 0
        self._capacity = capacity
        self._logs: dict[str, PoolLog] = {}

    def _log(self, pool: Pool) -> PoolLog:
        log = self._logs.get(pool.name)
        if log is None:
            log = self._logs[pool.name] = PoolLog(self._capacity)
        return log

    def committed(self, pool: Pool, block_hashes: Iterable[bytes]) -> None:
        """Log STORED for each of ``block_hashes`` that is now committed in L1 for every rank
        (the caller just committed them for one rank)."""
        log = self._log(pool)
        for block_hash in block_hashes:
            if _in_l1(pool, block_hash):
                log.append(EventKind.STORED, block_hash)

    def forgotten(self, pool: Pool, rank: int, block_hash: bytes, demoted: bool) -> None:
        """An L1 page of ``(rank, block_hash)`` is evicted or dropped: log its block unless
        another rank's page was already missing (then it was not whole, and never logged)."""
        for other, table in enumerate(pool.tables):
            if other == rank:
                continue
            entry = table.get(block_hash)
            if entry is None or entry.state is not EntryState.COMMITTED:
                return
        self._log(pool).append(EventKind.DEMOTED if demoted else EventKind.REMOVED, block_hash)

    def dropped_below(self, pool: Pool, rank: int, block_hash: bytes) -> None:
        """A tier below L1 no longer holds ``(rank, block_hash)`` (its key is gone): log
        REMOVED unless another rank's key was already missing."""
        for other, table in enumerate(pool.tables):
            if other != rank and block_hash not in table:
                return
        self._log(pool).append(EventKind.REMOVED, block_hash)

    def reset(self, pool: Pool) -> None:
        """The pool's contents changed wholesale (``kvshelf clear``): readers start over."""
        self._log(pool).reset()

    def drop(self, pool: Pool) -> None:
        """Forget a retired pool's log (readers of its name find no pool)."""
        self._logs.pop(pool.name, None)

    def read(self, pool: Pool | None, after_seq: int) -> tuple[list[tuple[int, bytes]], int, bool]:
        """The entries from sequence number ``after_seq`` on (at most :data:`MAX_READ`).

        Returns:
            ``(entries, next_seq, overflowed)``: ``next_seq`` is what to ask for next;
            ``overflowed`` means entries from ``after_seq`` on were dropped, and none are
            returned (the reader starts over from the pool's contents).
        """
        if pool is None:  # not registered yet: nothing to tell
            return [], 0, after_seq > 0
        log = self._log(pool)
        if after_seq < log.first_seq or after_seq > log.next_seq:
            return [], log.next_seq, True
        start = after_seq - log.first_seq
        end = min(len(log.entries), start + MAX_READ)
        entries = list(itertools.islice(log.entries, start, end))
        return entries, log.first_seq + end, False


def present(pool: Pool | None, block_hashes: Sequence[bytes]) -> list[int]:
    """Where each block is: :data:`IN_L1`, :data:`BELOW_L1` or :data:`ABSENT`."""
    if pool is None:
        return [ABSENT] * len(block_hashes)
    return [_where(pool, block_hash) for block_hash in block_hashes]


def _in_l1(pool: Pool, block_hash: bytes) -> bool:
    for table in pool.tables:
        entry = table.get(block_hash)
        if entry is None or entry.state is not EntryState.COMMITTED:
            return False
    return True


def _where(pool: Pool, block_hash: bytes) -> int:
    where = IN_L1
    for table in pool.tables:
        entry = table.get(block_hash)
        if entry is None or entry.state is EntryState.RESERVED:
            return ABSENT
        if entry.state is not EntryState.COMMITTED:
            where = BELOW_L1
    return where
