"""What each pool's readable contents became, as a bounded, sequence-numbered log per pool.

KV-aware routers learn from vLLM's KV events stream what an engine can load; the connector
(``kvshelf.roles.events``) publishes kvshelf's part of it from this log. A block enters the
log as STORED once it is COMMITTED in L1 for every rank of its pool (a lookup would hit it),
as DEMOTED when it stops being so but every rank still holds it (some only below L1), and as
REMOVED when some rank no longer holds it at all (eviction without a copy below, a tier's drop,
``kvshelf clear``), whoever stored it. Readers ask for the entries after the last sequence
number they saw, so a removal is never missed: when the entries they need were dropped (the
log holds at most ``capacity_bytes`` per pool, counted by :func:`entry_bytes`) the read says
so (``overflowed``), and the reader starts again from the pool's current contents, which
:func:`probed` tells for the hashes it knows. ``kvshelf clear`` resets the pool's log the same
way rather than logging every page it drops.

Bounds: a pool's log holds at most :data:`~kvshelf.server.limits.EVENT_LOG_BYTES_PER_POOL`
(counted in :mod:`kvshelf.server.limits`' worst case); a read returns at most
:data:`MAX_READ_BYTES` of entries, so its reply stays under the protocol's frame limit whatever
the hashes' size; a probe checks each distinct hash once, for every rank, at most
:func:`~kvshelf.protocol.max_request_keys` distinct hashes per request.

Medium codes (:data:`ABSENT`, :data:`IN_L1`, :data:`BELOW_L1`) say where a probed block is:
readable from L1 for every rank, held for every rank with some rank only below L1 (disk,
Redis: loadable after a fetch), or not whole on this server.

Runs on the socket loop's thread only. Must not import torch or vLLM.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Iterable, Sequence

from kvshelf.protocol import MAX_FRAME_BYTES
from kvshelf.server.limits import EVENT_LOG_BYTES_PER_POOL
from kvshelf.server.pool import EntryState, Pool
from kvshelf.server.request_cost import check_objects

# The most entries one read returns, and the most bytes they take in its reply (each entry:
# its hash, the hash's MessagePack header and its kind, REPLY_BYTES_PER_ENTRY besides the
# hash). Half the frame limit leaves room for the reply's other fields: a probe's answers
# (one byte per probed hash, at most 64 KiB) and a few hundred bytes of header.
MAX_READ = 16384
MAX_READ_BYTES = MAX_FRAME_BYTES // 2
REPLY_BYTES_PER_ENTRY = 4
# What an entry of a pool's log costs besides its hash's bytes: the hash object's header and
# allocator rounding, and a slot in each of the log's two deques (measured with tracemalloc:
# 50 bytes, plus up to 15 of rounding).
ENTRY_OVERHEAD_BYTES = 72

# Where a probed block is (EventsReply.present).
ABSENT = 0
IN_L1 = 1
BELOW_L1 = 2


class EventKind(enum.IntEnum):
    """The kind of a log entry (EventsReply.kinds). Append-only."""

    STORED = 1  # committed in L1 for every rank
    REMOVED = 2  # some rank no longer holds it, in L1 or below: not whole on this server
    DEMOTED = 3  # no longer in L1 for every rank; every rank still holds it, some below L1


def entry_bytes(block_hash: bytes) -> int:
    """What one log entry of ``block_hash`` is counted as against the log's bound."""
    return len(block_hash) + ENTRY_OVERHEAD_BYTES


class PoolLog:
    """One pool's log: entry ``i`` (``kinds[i]``, ``hashes[i]``) has sequence number
    ``first_seq + i``; the oldest entries are dropped while the entries' :func:`entry_bytes`
    sum to more than ``capacity_bytes``."""

    __slots__ = ("capacity_bytes", "first_seq", "hashes", "kinds", "num_bytes")

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.kinds: deque[int] = deque()
        self.hashes: deque[bytes] = deque()
        self.first_seq = 0
        self.num_bytes = 0

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self.hashes)

    def append(self, kind: EventKind, block_hash: bytes) -> None:
        self.kinds.append(kind)
        self.hashes.append(block_hash)
        self.num_bytes += entry_bytes(block_hash)
        while self.num_bytes > self.capacity_bytes:
            self.kinds.popleft()
            self.num_bytes -= entry_bytes(self.hashes.popleft())
            self.first_seq += 1

    def reset(self) -> None:
        """Drop every entry: a reader at or behind this point reads as overflowed (one
        sequence number is skipped, so that a reader that was caught up is told too)."""
        self.first_seq = self.next_seq + 1
        self.kinds.clear()
        self.hashes.clear()
        self.num_bytes = 0


class EventLogs:
    """The logs of every pool, fed by the index's commits and the arena's evictions.

    Args:
        capacity_bytes: the bound on each pool's log, in :func:`entry_bytes`.
    """

    def __init__(self, capacity_bytes: int = EVENT_LOG_BYTES_PER_POOL) -> None:
        assert capacity_bytes > 0
        self._capacity_bytes = capacity_bytes
        self._logs: dict[str, PoolLog] = {}

    def _log(self, pool: Pool) -> PoolLog:
        log = self._logs.get(pool.name)
        if log is None:
            log = self._logs[pool.name] = PoolLog(self._capacity_bytes)
        return log

    def committed(self, pool: Pool, block_hashes: Iterable[bytes]) -> None:
        """Log STORED for each of ``block_hashes`` that is now committed in L1 for every rank
        (the caller just committed them for one rank)."""
        log = self._log(pool)
        for block_hash in block_hashes:
            if _in_l1(pool, block_hash):
                log.append(EventKind.STORED, block_hash)

    def forgotten(self, pool: Pool, rank: int, block_hash: bytes, demoted: bool) -> None:
        """An L1 page of ``(rank, block_hash)`` is evicted or dropped (``demoted``: a tier
        below L1 keeps its object, and the key).

        Logged only if every other rank held the block (in L1 or below; otherwise it was not
        whole, and its end was logged before): REMOVED when this rank's key is gone, DEMOTED
        when the block was in L1 for every rank and now is not. A demotion while another rank
        was already below L1 changes nothing a reader sees. O(1): the pool's block rank counts
        (:mod:`kvshelf.server.block_ranks`), which already count this change, tell.
        """
        ranks = pool.ranks
        if ranks is not None:
            counts = ranks.in_l1 if demoted else ranks.held
            if counts.get(block_hash, 0) < pool.world_size - 1:
                return
        kind = EventKind.DEMOTED if demoted else EventKind.REMOVED
        self._log(pool).append(kind, block_hash)

    def dropped_below(self, pool: Pool, rank: int, block_hash: bytes) -> None:
        """A tier below L1 no longer holds ``(rank, block_hash)`` (its key is gone): log
        REMOVED unless another rank did not hold the block already (the block rank counts,
        which already count this change, tell: O(1))."""
        ranks = pool.ranks
        if ranks is not None and ranks.held.get(block_hash, 0) < pool.world_size - 1:
            return
        self._log(pool).append(EventKind.REMOVED, block_hash)

    def reset(self, pool: Pool) -> None:
        """The pool's contents changed wholesale (``kvshelf clear``): readers start over."""
        self._log(pool).reset()

    def drop(self, pool: Pool) -> None:
        """Forget a retired pool's log (readers of its name find no pool)."""
        self._logs.pop(pool.name, None)

    def read(self, pool: Pool | None, after_seq: int) -> tuple[list[tuple[int, bytes]], int, bool]:
        """The entries from sequence number ``after_seq`` on: at most :data:`MAX_READ`, and
        at most :data:`MAX_READ_BYTES` of reply (always one, if there is one).

        Returns:
            ``(entries, next_seq, overflowed)``: ``next_seq`` is what to ask for next (the
            log's end, or the first entry not returned); ``overflowed`` means entries from
            ``after_seq`` on were dropped, and none are returned (the reader starts over from
            the pool's contents).
        """
        if pool is None:  # not registered yet: nothing to tell
            return [], 0, after_seq > 0
        log = self._log(pool)
        if after_seq < log.first_seq or after_seq > log.next_seq:
            return [], log.next_seq, True
        start = after_seq - log.first_seq
        end = min(len(log.hashes), start + MAX_READ)
        hashes: list[bytes] = []
        budget = MAX_READ_BYTES
        for block_hash in itertools.islice(log.hashes, start, end):
            budget -= len(block_hash) + REPLY_BYTES_PER_ENTRY
            if budget < 0 and hashes:
                break
            hashes.append(block_hash)
        kinds = itertools.islice(log.kinds, start, start + len(hashes))
        return list(zip(kinds, hashes, strict=True)), after_seq + len(hashes), False


def present(pool: Pool | None, block_hashes: Sequence[bytes]) -> list[int]:
    """Where each block is: :data:`IN_L1`, :data:`BELOW_L1` or :data:`ABSENT`."""
    if pool is None:
        return [ABSENT] * len(block_hashes)
    return [_where(pool, block_hash) for block_hash in block_hashes]


def probed(pool: Pool | None, block_hashes: Sequence[bytes]) -> list[int]:
    """:func:`present` for an ``Events`` request's ``probe``: each distinct hash is checked
    once (in every rank's key table), at most :func:`~kvshelf.protocol.max_request_keys` of
    them for the pool's world size.

    Raises:
        RequestRejected: INVALID_ARGUMENT, naming ``probe``, over that budget.
    """
    if pool is None or not block_hashes:
        return [ABSENT] * len(block_hashes)
    distinct = dict.fromkeys(block_hashes, ABSENT)
    check_objects("probe", len(distinct), pool.world_size)
    for block_hash in distinct:
        distinct[block_hash] = _where(pool, block_hash)
    return [distinct[block_hash] for block_hash in block_hashes]


def _in_l1(pool: Pool, block_hash: bytes) -> bool:
    """Whether every rank holds ``block_hash`` COMMITTED in L1; O(1)."""
    if pool.ranks is not None:
        return pool.ranks.in_l1.get(block_hash, 0) == pool.world_size
    entry = pool.tables[0].get(block_hash)
    return entry is not None and entry.state is EntryState.COMMITTED


def _where(pool: Pool, block_hash: bytes) -> int:
    where = IN_L1
    for table in pool.tables:
        entry = table.get(block_hash)
        if entry is None or entry.state is EntryState.RESERVED:
            return ABSENT
        if entry.state is not EntryState.COMMITTED:
            where = BELOW_L1
    return where
