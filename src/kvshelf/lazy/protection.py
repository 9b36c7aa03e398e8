"""The ledger of protected blocks: every reference lazy offload holds on vLLM's GPU blocks.

A reference keeps vLLM from evicting or reusing a block, so that the block still holds the KV
its buffered hash promises until the workers have read it. This module is the only one in
``kvshelf.lazy`` that takes (``touch``) or drops (``free``) such a reference.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshelf.lazy.block_pool_view import BlockPoolView


class ProtectedBlocks:
    """Which blocks lazy offload holds a reference on, for which request, and why.

    A request's blocks are held for one of two reasons, each a list in block order:

    * *waiting*: its store work is still buffered (a policy asked to protect it at once,
      ``OffloadPolicy.protect_now``) or is being verified before submission;
    * *storing*: its verified stores are in flight, until every worker reports them.

    Invariant (``check``): lazy offload holds exactly one reference on a block per listing of
    its id here, under either reason; ``num_blocks`` is the number of listings; no list is
    empty. Freed blocks go back to vLLM tail first, as vLLM frees a request's blocks: its
    tail is the least likely to be shared, so the prefix stays cached longest.

    Args:
        pool: the GPU block pool the block ids refer to.
    """

    def __init__(self, pool: BlockPoolView) -> None:
        self._pool = pool
        self._waiting: dict[str, list[int]] = {}
        self._storing: dict[str, list[int]] = {}
        self._num_blocks = 0

    @property
    def num_blocks(self) -> int:
        """The number of references held, over every request and reason."""
        return self._num_blocks

    @property
    def request_ids(self) -> list[str]:
        """The requests holding protected blocks now, waiting ones first."""
        return list(dict.fromkeys([*self._waiting, *self._storing]))

    def waiting(self, request_id: str) -> list[int]:
        """The blocks held for ``request_id``'s buffered or unverified store work, in order."""
        return list(self._waiting.get(request_id, ()))

    def hold(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Take one reference on each block, listed as waiting for ``request_id``."""
        if not block_ids:
            return
        self._pool.touch(block_ids)
        self._waiting.setdefault(request_id, []).extend(block_ids)
        self._num_blocks += len(block_ids)

    def mark_storing(self, request_id: str, count: int) -> None:
        """Move the first ``count`` waiting blocks of ``request_id`` to storing (verified)."""
        if count <= 0:
            return
        waiting = self._waiting[request_id]
        assert count <= len(waiting)
        self._storing.setdefault(request_id, []).extend(waiting[:count])
        self._pop_front(self._waiting, request_id, count)

    def drop_waiting(self, request_id: str, count: int | None = None) -> int:
        """Free the first ``count`` (default: all) waiting blocks of ``request_id``.

        Returns:
            The number of references dropped; 0 for a request with none waiting.
        """
        waiting = self._waiting.get(request_id)
        if waiting is None:
            return 0
        count = len(waiting) if count is None else count
        assert count <= len(waiting)
        self._free(waiting[:count])
        self._pop_front(self._waiting, request_id, count)
        return count

    def drop_storing(self, request_id: str) -> int:
        """Free every block held for ``request_id``'s stores in flight.

        Returns:
            The number of references dropped; 0 for a request with none.
        """
        block_ids = self._storing.pop(request_id, [])
        self._free(block_ids)
        return len(block_ids)

    def check(self) -> None:
        """Assert the invariant's bookkeeping part (the pool's counts are not visible here)."""
        lists = [*self._waiting.values(), *self._storing.values()]
        assert all(lists), "no empty list"
        assert self._num_blocks == sum(len(block_ids) for block_ids in lists)

    @staticmethod
    def _pop_front(table: dict[str, list[int]], request_id: str, count: int) -> None:
        """Unlist a request's first ``count`` blocks (no reference changes here)."""
        block_ids = table[request_id]
        del block_ids[:count]
        if not block_ids:
            del table[request_id]

    def _free(self, block_ids: list[int]) -> None:
        if block_ids:
            self._pool.free(list(reversed(block_ids)))
            self._num_blocks -= len(block_ids)
            assert self._num_blocks >= 0
