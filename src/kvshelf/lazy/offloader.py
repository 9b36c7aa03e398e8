"""The lazy offloader: the one object the scheduler-role connector calls in lazy mode.

It buffers store work, and on a trigger verifies that the selected requests' blocks still hold
the KV they held when buffered, protects them, and hands the verified StoreRequests back for
submission; it releases the protection when the stores complete or are abandoned.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvshelf.lazy import POLICIES, create_policy
from kvshelf.lazy.base import (
    LAZY_OFFLOAD_KEY,
    POLICY_KEY,
    SELECT_COUNT_KEY,
    THRESHOLD_KEY,
    BufferedHashes,
    PendingStoreItem,
    require_positive_int,
)
from kvshelf.lazy.pending_store import LazyOffloadPendingStore
from kvshelf.lazy.pool import BlockPoolView
from kvshelf.metadata import StoreRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LazyOffloadConfig:
    """Lazy offload settings, from ``kv_connector_extra_config``.

    ``enabled`` is the connector's switch (``lmcache.mp.lazy_offload``): the offloader is only
    built when it is set, and does not read it.
    """

    enabled: bool = False
    policy: str = "FIFO"
    threshold: int = 100
    select_count: int = 10

    def validate(self) -> None:
        """Raise ValueError, naming the offending key, for a setting lazy offload cannot use."""
        if not isinstance(self.enabled, bool):
            raise ValueError(f"{LAZY_OFFLOAD_KEY} must be true or false, got {self.enabled!r}")
        if not isinstance(self.policy, str):
            raise ValueError(f"{POLICY_KEY} must be a string, got {self.policy!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"Unknown offload policy: {self.policy}")
        require_positive_int(THRESHOLD_KEY, self.threshold)
        require_positive_int(SELECT_COUNT_KEY, self.select_count)


@dataclass
class LazyOffloadStats:
    """Lazy offload counters. Gauges describe now; the others count since construction."""

    buffered_requests: int = 0  # gauge: requests with buffered store work, finished or not
    ready_requests: int = 0  # gauge: finished buffered requests (the ready count)
    drains: int = 0  # triggers: drains that selected at least one request
    requests_submitted: int = 0  # selected requests with at least one store submitted
    requests_skipped_hash_mismatch: int = 0  # selected requests with stale store work dropped
    blocks_submitted: int = 0
    blocks_stored: int = 0  # blocks whose store every worker reported complete
    blocks_protected: int = 0  # gauge: blocks held for in-flight stores

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class LazyOffloader:
    """Buffers store work and submits verified batches of it after requests finish.

    Invariant: every block id returned by ``drain`` holds one extra reference, taken before
    its hash was checked, until ``store_completed`` or ``release`` drops it; no other block
    holds a reference taken here.

    Args:
        source: a ready pending store, or the configuration to build one from.
        block_pool: the scheduler's GPU block pool (``VllmBlockPoolView`` over vLLM's).
    """

    def __init__(
        self,
        source: LazyOffloadPendingStore | LazyOffloadConfig,
        block_pool: BlockPoolView,
    ) -> None:
        if isinstance(source, LazyOffloadConfig):
            source.validate()
            policy = create_policy(source.policy, source.threshold, block_pool=block_pool)
            source = LazyOffloadPendingStore(policy, source.select_count, block_pool)
        assert source.block_pool is block_pool, "buffered hashes must come from this pool"
        self._store = source
        self._pool = block_pool
        # Only the cumulative counters live here; the gauges are read when a snapshot is taken.
        self._counters = LazyOffloadStats()

    def add(self, request: StoreRequest) -> None:
        """Buffer one step's store work instead of submitting it.

        Args:
            request: the StoreRequest the connector made this step.
        """
        self._store.add(request)

    def request_finished(self, request_id: str) -> bool:
        """Note that vLLM finished a request; its blocks go back to vLLM right away.

        Returns:
            True if the request had buffered work and now counts as ready.
        """
        return self._store.mark_req_finished(request_id)

    def drain(self, num_scheduled_tokens: int) -> list[StoreRequest]:
        """Select finished requests if the policy triggers, and return their verified stores.

        Args:
            num_scheduled_tokens: the step's total scheduled tokens.

        Returns:
            The StoreRequests to submit this step, their blocks now protected.
        """
        # With no scheduled tokens vLLM's model runner takes the no-forward path, on which
        # submitted stores would be lost: keep everything buffered for a real step.
        if num_scheduled_tokens <= 0:
            return []
        items = self._store.pop_items_for_offload()
        if not items:
            return []
        self._counters.drains += 1
        submitted: list[StoreRequest] = []
        for item in items:
            submitted.extend(self._verify_and_protect(item))
        return submitted

    def store_completed(self, request_id: str) -> int:
        """Release a request's protected blocks once every worker has stored them.

        Args:
            request_id: the request whose stores all workers reported complete.

        Returns:
            The number of block references dropped; 0 for an unknown request.
        """
        num_freed = self._free_protected(request_id)
        self._counters.blocks_stored += num_freed
        return num_freed

    def release(self, request_ids: Iterable[str]) -> int:
        """Release protection for stores that will never complete (e.g. the server died).

        Args:
            request_ids: the requests whose stores are abandoned; unknown ones are ignored.

        Returns:
            The number of block references dropped.
        """
        return sum(self._free_protected(request_id) for request_id in request_ids)

    def release_all(self) -> int:
        """Release every protected block; see ``release``."""
        return self.release(self._store.protected_request_ids)

    @property
    def stats(self) -> LazyOffloadStats:
        """A snapshot of the counters."""
        return dataclasses.replace(
            self._counters,
            buffered_requests=self._store.policy.num_pending,
            ready_requests=self._store.policy.num_ready,
            blocks_protected=self._store.num_protected_blocks,
        )

    def log_stats(self) -> None:
        """Log the counters at DEBUG."""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("lazy offload stats: %s", self.stats.as_dict())

    def _verify_and_protect(self, item: PendingStoreItem) -> list[StoreRequest]:
        """Protect and verify one request's StoreRequests, in block order.

        Returns:
            The verified prefix of the item's StoreRequests.
        """
        accepted: list[StoreRequest] = []
        for request, buffered in item.entries:
            # Touch before re-reading: once protected the pool cannot evict the block, so the
            # hash read next stays true until the store completes.
            self._pool.touch(request.block_ids)
            current = [self._pool.block_hash(block_id) for block_id in request.block_ids]
            if not _hashes_match(buffered, current):
                logger.warning(
                    "Part block hashes mismatch for request %s, skip it", item.request_id
                )
                _free_in_eviction_order(self._pool, request.block_ids)
                self._counters.requests_skipped_hash_mismatch += 1
                # Later entries extend a prefix that is no longer stored: useless to a lookup.
                break
            self._store.add_protected(item.request_id, request.block_ids)
            accepted.append(request)
        if accepted:
            self._counters.requests_submitted += 1
            self._counters.blocks_submitted += sum(r.num_blocks for r in accepted)
        return accepted

    def _free_protected(self, request_id: str) -> int:
        block_ids = self._store.pop_protected(request_id)
        _free_in_eviction_order(self._pool, block_ids)
        return len(block_ids)


def _hashes_match(buffered: BufferedHashes, current: Sequence[object | None]) -> bool:
    """Whether every block still holds what it held when buffered.

    A block with no hash at buffering time cannot be verified, so it never matches.
    """
    return all(old is not None and old == new for old, new in zip(buffered, current, strict=True))


def _free_in_eviction_order(pool: BlockPoolView, block_ids: Sequence[int]) -> None:
    # A request's tail blocks are the least likely to be shared, so, as vLLM does, offer them
    # for eviction first and keep the prefix cached longest.
    if block_ids:
        pool.free(list(reversed(block_ids)))
