"""The pending store: buffered store work plus the blocks protected for submitted stores."""

from __future__ import annotations

from collections.abc import Sequence

from kvshelf.lazy.base import (
    SELECT_COUNT_KEY,
    OffloadPolicy,
    PendingStoreItem,
    require_positive_int,
)
from kvshelf.lazy.pool import BlockPoolView
from kvshelf.plan import StoreJob


class LazyOffloadPendingStore:
    """Buffers StoreRequests with the block hashes they were made against.

    Lazy offload does not protect a request's blocks while its store waits, so vLLM may reuse
    them; the hash read here, at buffering time, is what the offloader later compares with to
    detect that. This class also remembers which blocks the offloader protected for each
    submitted request, until the store completes or is abandoned. It never touches or frees
    blocks itself.

    Args:
        policy: decides which finished requests to offload, and when.
        select_count: the most requests selected per trigger.
        block_pool: the GPU block pool the StoreRequests' block ids refer to.
    """

    def __init__(self, policy: OffloadPolicy, select_count: int, block_pool: BlockPoolView) -> None:
        self.policy = policy
        self.select_count = require_positive_int(SELECT_COUNT_KEY, select_count)
        self.block_pool = block_pool
        # request id -> ids of the blocks protected (touched once each) for its submitted
        # stores, in block order. A block id appears once per touch, so freeing this list
        # drops exactly the references taken.
        self._protected: dict[str, list[int]] = {}
        # Invariant: the total length of the lists in self._protected.
        self._num_protected_blocks = 0

    def add(self, request: StoreJob) -> StoreJob | None:
        """Buffer one step's store work with each block's current hash.

        Args:
            request: the StoreJob the connector made this step.

        Returns:
            What the policy buffered (see ``OffloadPolicy.add``).
        """
        hashes = tuple(self.block_pool.block_hash(block_id) for block_id in request.block_ids)
        return self.policy.add(request, hashes)

    def mark_req_finished(self, request_id: str) -> bool:
        """See ``OffloadPolicy.mark_req_finished``."""
        return self.policy.mark_req_finished(request_id)

    def pop_items_for_offload(self) -> list[PendingStoreItem]:
        """Remove and return at most ``select_count`` finished items, if the policy triggers."""
        return self.policy.pop_items_for_offload(self.select_count)

    def add_protected(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Record blocks the offloader has just touched for ``request_id``'s store."""
        self._protected.setdefault(request_id, []).extend(block_ids)
        self._num_protected_blocks += len(block_ids)

    def pop_protected(self, request_id: str) -> list[int]:
        """Forget and return the blocks protected for ``request_id`` (empty if none).

        Returns:
            The block ids, in block order, for the caller to free.
        """
        block_ids = self._protected.pop(request_id, [])
        self._num_protected_blocks -= len(block_ids)
        assert self._num_protected_blocks >= 0
        return block_ids

    @property
    def protected_request_ids(self) -> list[str]:
        """The requests that hold protected blocks now."""
        return list(self._protected)

    @property
    def num_protected_blocks(self) -> int:
        return self._num_protected_blocks
