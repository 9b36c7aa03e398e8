"""The pending store: buffered store work, each block kept with the hash it held when buffered.

It never touches or frees blocks: the references lazy offload holds are the ledger's
(``kvshelf.lazy.protection``).
"""

from __future__ import annotations

from kvshelf.config_values import require_positive_int
from kvshelf.connector_config import LAZY_OFFLOAD_SELECT_COUNT
from kvshelf.lazy.block_pool_view import BlockPoolView
from kvshelf.lazy.policies.base import BufferedHashes, OffloadPolicy, PendingStoreItem
from kvshelf.plan import StoreJob


class LazyOffloadPendingStore:
    """Buffers StoreJobs with the block hashes they were made against.

    Lazy offload does not protect a request's blocks while its store waits, so vLLM may reuse
    them; the hash read here, at buffering time, is what the offloader later compares with to
    detect that.

    Args:
        policy: decides which finished requests to offload, and when.
        select_count: the most requests selected per trigger.
        block_pool: the GPU block pool the StoreJobs' block ids refer to.
    """

    def __init__(self, policy: OffloadPolicy, select_count: int, block_pool: BlockPoolView) -> None:
        self.policy = policy
        self.select_count = require_positive_int(LAZY_OFFLOAD_SELECT_COUNT, select_count)
        self.block_pool = block_pool

    def add(self, job: StoreJob, hashes: BufferedHashes | None = None) -> StoreJob | None:
        """Buffer one step's store work with each block's current hash.

        Args:
            job: the StoreJob the connector made this step.
            hashes: what to verify each block against later, when read earlier (captured
                window blocks: ``kvshelf.lazy.window_watch``); each block's hash now if None.

        Returns:
            What the policy buffered (see ``OffloadPolicy.add``).
        """
        if hashes is None:
            hashes = tuple(self.block_pool.block_hash(block_id) for block_id in job.block_ids)
        return self.policy.add(job, hashes)

    def mark_req_finished(self, request_id: str) -> bool:
        """See ``OffloadPolicy.mark_req_finished``."""
        return self.policy.mark_req_finished(request_id)

    def pop_items_for_offload(self) -> list[PendingStoreItem]:
        """Remove and return at most ``select_count`` finished items, if the policy triggers."""
        return self.policy.pop_items_for_offload(self.select_count)
