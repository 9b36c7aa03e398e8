"""How many ranks of a pool hold each block, kept as the pool's tables change.

Whether a block is whole (every rank holds it) is asked on every eviction, drop and commit
(the event log, :mod:`kvshelf.server.event_log`). Asking each rank's table made every
evicted page cost the pool's world size: a `Reserve` that evicted 8,192 pages of a pool of
1,024 ranks held the loop 3.8 s (issue 49). :class:`BlockRanks` keeps the answer per block
instead, so each change and each question is O(1) whatever the world size.

Counted per block: ``held``, the ranks whose key is COMMITTED in L1 or STORED below it (a
RESERVED page is not held yet), and ``in_l1``, the ranks whose key is a COMMITTED page. A
block with no such rank has no record. Pools of one stored rank keep none (their one table
answers directly). The index and the arena tier call the ``on_*`` methods wherever a key
changes state (the arena's ``check_invariants`` compares the counts with the tables).

Bounds: one record per block held by some rank, at most one per page or STORED entry
(counted in :data:`~kvshelf.server.limits.BYTES_PER_PAGE`). Must not import torch or vLLM.
"""

from __future__ import annotations


class BlockRanks:
    """Per block hash, the ranks holding it (``held``) and those holding it in L1
    (``in_l1``); absent: none."""

    __slots__ = ("held", "in_l1")

    def __init__(self) -> None:
        self.held: dict[bytes, int] = {}
        self.in_l1: dict[bytes, int] = {}

    def on_committed(self, block_hash: bytes) -> None:
        """A rank's RESERVED page of the block was committed (or adopted committed)."""
        _add(self.held, block_hash)
        _add(self.in_l1, block_hash)

    def on_stored(self, block_hash: bytes) -> None:
        """A rank got a STORED entry of a tier below L1 for the block (its key was absent)."""
        _add(self.held, block_hash)

    def on_landed(self, block_hash: bytes) -> None:
        """A rank's STORED entry became a COMMITTED page (a fetch landed)."""
        _add(self.in_l1, block_hash)

    def on_demoted(self, block_hash: bytes) -> None:
        """A rank's COMMITTED page was evicted, a tier below keeping its key as STORED."""
        _remove(self.in_l1, block_hash)

    def on_dropped(self, block_hash: bytes, in_l1: bool) -> None:
        """A rank's key of the block is gone: a COMMITTED page (``in_l1``) or a STORED entry."""
        _remove(self.held, block_hash)
        if in_l1:
            _remove(self.in_l1, block_hash)

    def clear(self) -> None:
        """Forget every block (the pool is dropped)."""
        self.held.clear()
        self.in_l1.clear()


def _add(counts: dict[bytes, int], block_hash: bytes) -> None:
    counts[block_hash] = counts.get(block_hash, 0) + 1


def _remove(counts: dict[bytes, int], block_hash: bytes) -> None:
    left = counts[block_hash] - 1
    if left:
        counts[block_hash] = left
    else:
        del counts[block_hash]
