"""The worker's queue of store jobs, taken by its store thread in batches.

Each job travels with what its batch needs to know about the step that made it: the model
identity's epoch (a batch never mixes epochs: each goes to its own pool) and the step's forward
fence (the batch's copy waits on its last job's fence). No vLLM import, no engine.
"""

from __future__ import annotations

import queue
from typing import NamedTuple

from kvshelf.plan import StoreJob

STORE_BATCH_BYTES = 64 * 1024 * 1024
"""Store jobs queued together are reserved, copied and committed as one batch of at most about
this many bytes (at least one job): one round trip and one copy call per layer for them all,
while a reservation never holds much more of the arena than one batch."""


class StoreItem(NamedTuple):
    """A queued store job and its step's epoch and forward fence."""

    job: StoreJob
    epoch: str
    """The model identity's epoch of the step (``StepPlan.identity_epoch``)."""
    fence: object | None
    """The step's forward fence (``TransferEngine.forward_fence``), None without an engine.
    Fences are recorded in step order on one stream, so a later one covers every earlier one."""


class StoreQueue:
    """Store jobs in FIFO order, and None to stop the store thread.

    :meth:`task_done` and :meth:`join` count jobs as :class:`queue.Queue` does: ``join``
    returns once every item put was marked done.
    """

    def __init__(self) -> None:
        self._items: queue.Queue[StoreItem | None] = queue.Queue()
        # A job of a new epoch taken while batching, returned first by the next get.
        self._held: StoreItem | None = None

    def put(self, item: StoreItem | None) -> None:
        self._items.put(item)

    def get(self, timeout: float | None) -> StoreItem | None:
        """The next item, waiting up to ``timeout`` seconds (None: do not wait).

        Raises:
            queue.Empty: nothing came in time.
        """
        if self._held is not None:
            item, self._held = self._held, None
            return item
        if timeout is None:
            return self._items.get_nowait()
        return self._items.get(timeout=timeout)

    def take_batch(
        self, first: StoreItem | None, page_bytes: int, max_keys: int
    ) -> tuple[list[StoreItem], bool]:
        """``first`` and the jobs of the same identity epoch queued behind it, up to
        :data:`STORE_BATCH_BYTES` of pages of ``page_bytes`` and ``max_keys`` blocks (what one
        reserve may name: the server charges its end, keys x stored ranks, before it makes
        it). A job of another epoch or another tenant (one reserve names one) ends the batch
        and is held for the next one.

        Returns:
            The batch, and whether the stop sentinel (None) was taken.
        """
        if first is None:
            return [], True
        batch = [first]
        budget = min(STORE_BATCH_BYTES // page_bytes, max_keys) if page_bytes else 0
        budget -= first.job.num_blocks
        while budget > 0:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return batch, True
            if item.epoch != first.epoch or item.job.tenant != first.job.tenant:
                self._held = item
                break
            batch.append(item)
            budget -= item.job.num_blocks
        return batch, False

    def task_done(self) -> None:
        self._items.task_done()

    def join(self) -> None:
        self._items.join()
