"""Eviction-aware offload policy: store a finished request's blocks just before vLLM evicts them.

FIFO waits for a backlog of finished requests and then stores the oldest, by which time vLLM has
often reused their blocks (the hash check then skips them, and the cache stays empty), while
blocks that vLLM still caches are stored needlessly early. This policy reads where each block
stands in vLLM's free queue instead: every step it looks at the few blocks that vLLM will evict
next and selects the finished requests that own them. Blocks far from eviction stay buffered:
vLLM's own prefix cache still serves them. Blocks the server is known to hold already are not
stored again, until a lookup answers that the server does not hold them (after a restart without
adoption, say).

Work per step is bounded by the scan window and by the select count; a backlog beyond the
threshold is drained oldest first, so buffered work cannot grow without bound.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar

from kvshelf.config_values import require_positive_int
from kvshelf.connector_config import LAZY_OFFLOAD_EVICTION_WINDOW
from kvshelf.lazy.block_pool_view import BlockPoolView
from kvshelf.lazy.policies.base import OffloadPolicy, PendingStoreItem
from kvshelf.plan import StoreJob

logger = logging.getLogger(__name__)

DEFAULT_EVICTION_WINDOW = 64
# How many block hashes the policy remembers as stored on the server.
KNOWN_STORED_CAPACITY = 1 << 20


class EvictionAwarePolicy(OffloadPolicy):
    """Selects finished requests whose blocks are next in vLLM's eviction order.

    Invariant: ``_owners[block_id]`` holds the ids of the buffered, finished requests whose
    store work includes ``block_id`` (a block shared by several requests through a prefix hit
    has several owners); every such request is in ``_items``.

    Args:
        threshold: the ready count beyond which the oldest finished requests are selected too,
            whatever the position of their blocks.
        block_pool: the GPU block pool whose free queue gives the eviction order.
        eviction_window: how many blocks at the head of the free queue are inspected per step.
    """

    capture_on_finish: ClassVar[bool] = True
    trim_on_mismatch: ClassVar[bool] = True

    def __init__(
        self,
        threshold: int,
        block_pool: BlockPoolView,
        eviction_window: int = DEFAULT_EVICTION_WINDOW,
    ) -> None:
        super().__init__(threshold)
        self._pool = block_pool
        self.eviction_window = require_positive_int(LAZY_OFFLOAD_EVICTION_WINDOW, eviction_window)
        # request id -> its item, oldest finish first. Items are made at finish time, so
        # every item here is finished.
        self._items: OrderedDict[str, PendingStoreItem] = OrderedDict()
        self._owners: dict[int, list[str]] = {}
        # Requests whose blocks the offloader protected when they finished, oldest first.
        self._urgent: OrderedDict[str, None] = OrderedDict()
        self._known_stored: OrderedDict[bytes, None] = OrderedDict()
        logger.info(
            "lazy offload enabled with EVICTION_AWARE policy, eviction window: %d blocks, "
            "backlog threshold: %d",
            self.eviction_window,
            threshold,
        )

    @classmethod
    def create(
        cls, threshold: int, block_pool: BlockPoolView | None, **options: Any
    ) -> OffloadPolicy:
        if block_pool is None:
            raise ValueError("the EVICTION_AWARE policy needs vLLM's block pool")
        window = options.get("eviction_window") or DEFAULT_EVICTION_WINDOW
        return cls(threshold, block_pool, window)

    def add(self, job: StoreJob, hashes: Sequence[object | None]) -> StoreJob | None:
        assert len(hashes) == job.num_blocks, "one buffered hash per block"
        # Blocks at the front that the server already holds need no store; later blocks
        # still extend that stored prefix.
        skip = 0
        while skip < job.num_blocks and job.block_hashes[skip] in self._known_stored:
            skip += 1
        if skip == job.num_blocks:
            return None
        if skip:
            job = StoreJob(
                request_id=job.request_id,
                block_ids=job.block_ids[skip:],
                block_hashes=job.block_hashes[skip:],
                first_block=job.first_block + skip,
                tenant=job.tenant,
            )
            hashes = hashes[skip:]
        item = self._items.get(job.request_id)
        if item is None:
            item = PendingStoreItem(job.request_id, finished=True)
            self._items[job.request_id] = item
        item.entries.append((job, tuple(hashes)))
        for block_id in job.block_ids:
            self._owners.setdefault(block_id, []).append(job.request_id)
        return job

    def protect_now(self, request_id: str) -> bool:
        # The freed blocks join the tail of vLLM's free queue. When that queue is shorter than
        # the window, the next step's allocations (made before the next selection) may evict
        # them: they need protecting now, and selecting first.
        if self._pool.num_free_blocks() >= self.eviction_window:
            return False
        self._urgent[request_id] = None
        return True

    def mark_req_finished(self, request_id: str) -> bool:
        # Items are only made when their request finishes: nothing changes here.
        return False

    def pop_items_for_offload(self, count: int) -> list[PendingStoreItem]:
        if count <= 0 or not self._items:
            return []
        selected: list[str] = list(itertools.islice(self._urgent, count))
        for block_id in self._pool.eviction_candidates(self.eviction_window):
            if len(selected) >= count:
                break
            for request_id in self._owners.get(block_id, ()):
                if request_id not in selected:
                    selected.append(request_id)
        del selected[count:]
        backlog = len(self._items) - len(selected) - self.threshold
        if backlog > 0 and len(selected) < count:
            for request_id in self._items:
                if len(selected) >= count or backlog <= 0:
                    break
                if request_id not in selected:
                    selected.append(request_id)
                    backlog -= 1
        return self.take(selected)

    def take(self, request_ids: Sequence[str]) -> list[PendingStoreItem]:
        taken: list[PendingStoreItem] = []
        for request_id in request_ids:
            item = self._items.pop(request_id, None)
            if item is None:
                continue
            self._urgent.pop(request_id, None)
            taken.append(item)
            for job, _ in item.entries:
                for block_id in job.block_ids:
                    owners = self._owners[block_id]
                    owners.remove(request_id)
                    if not owners:
                        del self._owners[block_id]
        return taken

    def note_stored(self, hashes: Sequence[bytes]) -> None:
        known = self._known_stored
        for block_hash in hashes:
            known[block_hash] = None
            known.move_to_end(block_hash)
        while len(known) > KNOWN_STORED_CAPACITY:
            known.popitem(last=False)

    def note_missing(self, hashes: Sequence[bytes]) -> None:
        # The belief above is only a cache of the server's contents: a lookup answer overrules
        # it, or blocks the server lost (a restart without adoption, an eviction, a store
        # dropped while the server was down) would never be stored again.
        for block_hash in hashes:
            self._known_stored.pop(block_hash, None)

    @property
    def num_pending(self) -> int:
        return len(self._items)

    @property
    def num_ready(self) -> int:
        return len(self._items)
