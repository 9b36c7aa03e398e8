"""FIFO offload policy: finished requests are offloaded in the order they were first buffered."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from kvshelf.lazy.policies.base import OffloadPolicy, PendingStoreItem
from kvshelf.plan import StoreJob

logger = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 100


class FIFOOffloadPolicy(OffloadPolicy):
    """Selects finished requests in insertion order once enough of them are ready.

    Insertion order is the order of a request's first buffered StoreJob; an unfinished
    request ahead in the queue does not block finished ones behind it.

    Args:
        threshold: the ready count at or above which ``pop_items_for_offload`` selects items.
    """

    def __init__(self, threshold: int = DEFAULT_THRESHOLD) -> None:
        super().__init__(threshold)
        # request id -> its one pending item, in insertion order.
        self._items: OrderedDict[str, PendingStoreItem] = OrderedDict()
        # Invariant: the number of items in self._items with finished set.
        self._num_ready = 0
        logger.info("lazy offload enabled with FIFO policy, offload threshold: %d", threshold)

    def add(self, job: StoreJob, hashes: Sequence[object | None]) -> StoreJob:
        assert len(hashes) == job.num_blocks, "one buffered hash per block"
        item = self._items.get(job.request_id)
        if item is None:
            item = PendingStoreItem(job.request_id)
            self._items[job.request_id] = item
        item.entries.append((job, tuple(hashes)))
        return job

    def mark_req_finished(self, request_id: str) -> bool:
        item = self._items.get(request_id)
        # Unknown: the request never produced store work. Already finished: counting it again
        # would inflate the ready count beyond the items that can ever be popped.
        if item is None or item.finished:
            return False
        item.finished = True
        self._num_ready += 1
        return True

    def pop_items_for_offload(self, count: int) -> list[PendingStoreItem]:
        if count <= 0 or self._num_ready < self.threshold:
            return []
        selected: list[PendingStoreItem] = []
        for item in self._items.values():
            if len(selected) == count:
                break
            if item.finished:
                selected.append(item)
        for item in selected:
            del self._items[item.request_id]
        self._num_ready -= len(selected)
        assert 0 <= self._num_ready <= len(self._items)
        return selected

    def take(self, request_ids: Sequence[str]) -> list[PendingStoreItem]:
        taken: list[PendingStoreItem] = []
        for request_id in request_ids:
            item = self._items.get(request_id)
            if item is not None and item.finished:
                del self._items[request_id]
                taken.append(item)
        self._num_ready -= len(taken)
        assert 0 <= self._num_ready <= len(self._items)
        return taken

    @property
    def num_pending(self) -> int:
        return len(self._items)

    @property
    def num_ready(self) -> int:
        return self._num_ready
