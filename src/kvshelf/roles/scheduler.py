"""The scheduler-role half of the connector: lookups, per-step plans, store accounting.

No vLLM import: vLLM's ``Request`` and ``SchedulerOutput`` are read by attribute, so this
module can be driven by a real vLLM ``Scheduler`` in tests and by nothing else at runtime.
It owns every decision (what to load, what to store, when); workers only move bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvshelf.client import ServerError, ServerUnavailable
from kvshelf.lazy.offloader import LazyOffloader
from kvshelf.metadata import LoadRequest, StoreRequest

logger = logging.getLogger(__name__)


class SchedulerClient(Protocol):
    """The part of ``KVShelfClient`` the scheduler uses."""

    def lookup(self, pool: str, hashes: Sequence[bytes], *, world_size: int, lock: bool) -> Any: ...

    def release(self, lock_id: int, rank: int) -> None: ...


@dataclass(frozen=True)
class StepPlan:
    """What the workers do in one step. Travels inside the vLLM connector metadata.

    Attributes:
        loads: pages to copy into vLLM blocks before this step's forward pass.
        stores: vLLM blocks to copy into the cache after this step's forward pass.
        delayed_free: requests whose blocks vLLM keeps until every worker reports their
            stores finished (through ``finished_sending``).
        preempted: requests preempted this step; their blocks may be reused at once, so
            workers finish every store in flight before the forward pass.
    """

    loads: tuple[LoadRequest, ...] = ()
    stores: tuple[StoreRequest, ...] = ()
    delayed_free: frozenset[str] = frozenset()
    preempted: frozenset[str] = frozenset()


@dataclass
class _PendingLock:
    """A lookup's locked hit, held until the workers load it or vLLM declines it."""

    lock_id: int
    boot_id: str
    hit_blocks: int
    local_blocks: int
    pages: tuple[tuple[int, ...], ...]


@dataclass
class _RequestState:
    """The scheduler's view of one live request."""

    request: Any
    # Blocks [0, num_known_blocks) are stored in kvshelf or already handed to a store.
    num_known_blocks: int = 0
    lock: _PendingLock | None = None


@dataclass
class SchedulerCounters:
    """Cumulative scheduler-side counters (exposed through vLLM's connector stats)."""

    lookups: int = 0
    lookup_failures: int = 0
    lookup_hit_blocks: int = 0
    loads_planned: int = 0
    blocks_load_planned: int = 0
    stores_submitted: int = 0
    blocks_store_submitted: int = 0
    stores_completed: int = 0


@dataclass
class _InflightStores:
    """Store jobs of one request handed to the workers and not yet confirmed by all."""

    jobs: int = 0
    reports: int = 0


class SchedulerConnector:
    """Scheduler-side connector logic.

    Invariants:
        * A hit is never the whole prompt: at least the last token is computed by vLLM.
        * Only full blocks are stored and loaded.
        * Every lock taken by a lookup is released exactly once: by the workers after a
          load, or here when vLLM does not load it or the request ends.
        * A request with store jobs in flight is kept (eager: vLLM's delayed free; lazy: the
          offloader's protected blocks) until all ``world_size`` workers report them.

    Args:
        client: the server client (lookups and lock releases).
        pool: the pool name of this model and layout (``kvshelf.protocol.pool_name``).
        block_size: vLLM's block size in tokens.
        world_size: the number of KV ranks; a hit must be stored for all of them.
        get_block_ids: returns a request's block ids (first KV cache group).
        lazy: the lazy offloader, or None in eager mode.
    """

    def __init__(
        self,
        client: SchedulerClient,
        pool: str,
        block_size: int,
        world_size: int,
        get_block_ids: Callable[[str], Sequence[int]],
        lazy: LazyOffloader | None = None,
    ) -> None:
        assert block_size > 0 and world_size > 0
        self._client = client
        self._pool = pool
        self._block_size = block_size
        self._world_size = world_size
        self._get_block_ids = get_block_ids
        self._lazy = lazy
        self._requests: dict[str, _RequestState] = {}
        self._inflight: dict[str, _InflightStores] = {}
        self._pending_loads: list[LoadRequest] = []
        self._delayed_free: set[str] = set()
        self.counters = SchedulerCounters()
        self._unavailable_since: float | None = None

    @property
    def lazy(self) -> LazyOffloader | None:
        return self._lazy

    def enable_lazy(self, lazy: LazyOffloader) -> None:
        """Switch to lazy offload (called once vLLM has bound its block pool)."""
        assert self._lazy is None and not self._inflight, "switch before the first step"
        self._lazy = lazy

    def snapshot(self) -> dict[str, int]:
        """All counters and gauges, by name (lazy offload's included when enabled)."""
        values = dataclasses.asdict(self.counters)
        values["inflight_store_requests"] = len(self._inflight)
        if self._lazy is not None:
            values.update(self._lazy.stats.as_dict())
        return values

    def lookup(self, request: Any, num_computed_tokens: int) -> int:
        """Find how many tokens beyond ``num_computed_tokens`` kvshelf can load.

        Args:
            request: the vLLM request (``request_id``, ``block_hashes``, ``num_tokens``).
            num_computed_tokens: block-aligned tokens vLLM already has locally.

        Returns:
            The number of tokens to load (whole blocks, or up to the prompt's last token), 0 on
            a miss or when the server cannot answer in time.
        """
        state = self._requests.get(request.request_id)
        if state is None:
            state = _RequestState(request)
            self._requests[request.request_id] = state
        else:
            # vLLM asks again when it could not allocate last time: drop the stale lock.
            state.request = request
            self._release_lock(state)

        local_blocks = num_computed_tokens // self._block_size
        max_blocks = min(len(request.block_hashes), request.num_tokens // self._block_size)
        if max_blocks <= local_blocks:
            return 0
        self.counters.lookups += 1
        try:
            result = self._client.lookup(
                self._pool,
                list(request.block_hashes[:max_blocks]),
                world_size=self._world_size,
                lock=True,
            )
        except (ServerUnavailable, ServerError) as exc:
            self.counters.lookup_failures += 1
            self._note_unavailable(exc)
            return 0
        self._note_available()
        hit_blocks = min(result.num_hit_blocks, max_blocks)
        self.counters.lookup_hit_blocks += hit_blocks
        if self._lazy is not None and hit_blocks > state.num_known_blocks:
            self._lazy.note_stored(
                [bytes(h) for h in request.block_hashes[state.num_known_blocks : hit_blocks]]
            )
        state.num_known_blocks = max(state.num_known_blocks, hit_blocks)
        if result.lock_id == 0:
            # Nothing was locked: a miss.
            return 0
        state.lock = _PendingLock(
            lock_id=result.lock_id,
            boot_id=result.boot_id,
            hit_blocks=hit_blocks,
            local_blocks=local_blocks,
            pages=tuple(tuple(rank_pages) for rank_pages in result.pages),
        )
        # vLLM must compute at least the last token to sample from it: a hit that reaches the
        # end of the prompt stops one token short (its last block is still loaded whole, and
        # vLLM recomputes that one slot).
        hit_tokens = min(hit_blocks * self._block_size, request.num_tokens - 1)
        if hit_tokens <= num_computed_tokens:
            self._release_lock(state)
            return 0
        return hit_tokens - num_computed_tokens

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Plan the load of a hit once vLLM has allocated blocks for it.

        Args:
            request: the vLLM request.
            block_ids: all of the request's block ids (first KV cache group).
            num_external_tokens: tokens vLLM will take from kvshelf; 0 declines the hit.
        """
        state = self._requests.get(request.request_id)
        if state is None or state.lock is None:
            return
        lock = state.lock
        if num_external_tokens <= 0:
            self._release_lock(state)
            return
        # A hit ending one token before the end of a block-aligned prompt loads that last
        # block whole.
        num_blocks = -(-num_external_tokens // self._block_size)
        start = lock.local_blocks
        assert start + num_blocks <= lock.hit_blocks <= len(block_ids)
        load = LoadRequest(
            request_id=request.request_id,
            block_ids=tuple(block_ids[start : start + num_blocks]),
            pages=tuple(rank_pages[start : start + num_blocks] for rank_pages in lock.pages),
            lock_id=lock.lock_id,
            boot_id=lock.boot_id,
        )
        # The workers release the lock once they have read the pages.
        state.lock = None
        self._pending_loads.append(load)
        self.counters.loads_planned += 1
        self.counters.blocks_load_planned += num_blocks

    def build_plan(self, scheduler_output: Any) -> StepPlan:
        """Collect this step's loads and stores.

        Args:
            scheduler_output: vLLM's ``SchedulerOutput`` for the step (not modified).

        Returns:
            The plan the workers execute this step.
        """
        stores: list[StoreRequest] = []
        lazy = self._lazy
        # A policy that captures store work at finish has nothing to do per scheduled request.
        if lazy is None or not lazy.capture_on_finish:
            for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
                new_store = self._next_store(request_id, num_tokens)
                if new_store is None:
                    continue
                if lazy is not None:
                    lazy.add(new_store)
                else:
                    stores.append(new_store)
        if self._lazy is not None:
            stores.extend(self._lazy.drain(scheduler_output.total_num_scheduled_tokens))
        for store in stores:
            inflight = self._inflight.setdefault(store.request_id, _InflightStores())
            inflight.jobs += 1
            self.counters.stores_submitted += 1
            self.counters.blocks_store_submitted += store.num_blocks

        plan = StepPlan(
            loads=tuple(self._pending_loads),
            stores=tuple(stores),
            delayed_free=frozenset(self._delayed_free),
            preempted=frozenset(scheduler_output.preempted_req_ids or ()),
        )
        self._pending_loads.clear()
        self._delayed_free.clear()
        return plan

    def _next_store(self, request_id: str, num_scheduled_tokens: int) -> StoreRequest | None:
        """The full blocks of a request that become computed this step and are not stored."""
        state = self._requests.get(request_id)
        if state is None or num_scheduled_tokens <= 0:
            return None
        request = state.request
        computed_after = request.num_computed_tokens + num_scheduled_tokens
        full_blocks = min(len(request.block_hashes), computed_after // self._block_size)
        start = state.num_known_blocks
        if full_blocks <= start:
            return None
        block_ids = self._get_block_ids(request_id)
        assert len(block_ids) >= full_blocks, "vLLM allocated every computed block"
        state.num_known_blocks = full_blocks
        return StoreRequest(
            request_id=request_id,
            block_ids=tuple(block_ids[start:full_blocks]),
            block_hashes=tuple(bytes(h) for h in request.block_hashes[start:full_blocks]),
            first_block=start,
        )

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> bool:
        """Handle the end of a request.

        Args:
            request: the finished vLLM request.
            block_ids: its blocks holding computed tokens, which vLLM frees unless told not to.

        Returns:
            True when vLLM must keep the request's blocks until the workers report its
            stores through ``finished_sending`` (eager mode with stores in flight).
        """
        request_id = request.request_id
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._release_lock(state)
        inflight = self._inflight.get(request_id)
        if self._lazy is not None:
            if self._lazy.capture_on_finish and state is not None:
                store = self._finished_store(state, block_ids)
                if store is not None:
                    self._lazy.add(store)
            self._lazy.request_finished(request_id)
            return False
        if inflight is None:
            return False
        self._delayed_free.add(request_id)
        return True

    def _finished_store(
        self, state: _RequestState, block_ids: Sequence[int]
    ) -> StoreRequest | None:
        """All computed full blocks of a finished request that kvshelf does not hold yet."""
        request = state.request
        full_blocks = min(
            len(request.block_hashes),
            request.num_computed_tokens // self._block_size,
            len(block_ids),
        )
        start = state.num_known_blocks
        if full_blocks <= start:
            return None
        return StoreRequest(
            request_id=request.request_id,
            block_ids=tuple(block_ids[start:full_blocks]),
            block_hashes=tuple(bytes(h) for h in request.block_hashes[start:full_blocks]),
            first_block=start,
        )

    def has_pending_work(self) -> bool:
        """Whether vLLM should keep stepping while idle (lazy stores to submit or confirm)."""
        return self._lazy is not None and self._lazy.has_pending_work()

    def stores_reported(self, completed: dict[str, int]) -> None:
        """Account store jobs that workers report finished (stored, skipped or dropped).

        Args:
            completed: request id -> number of store jobs finished, summed over workers.
        """
        for request_id, reports in completed.items():
            inflight = self._inflight.get(request_id)
            if inflight is None:
                logger.debug("store report for unknown request %s ignored", request_id)
                continue
            inflight.reports += reports
            assert inflight.reports <= inflight.jobs * self._world_size
            if inflight.reports < inflight.jobs * self._world_size:
                continue
            self.counters.stores_completed += inflight.jobs
            inflight.reports -= inflight.jobs * self._world_size
            inflight.jobs = 0
            del self._inflight[request_id]
            if self._lazy is not None:
                self._lazy.store_completed(request_id)

    def _release_lock(self, state: _RequestState) -> None:
        lock = state.lock
        if lock is None:
            return
        state.lock = None
        for rank in range(self._world_size):
            try:
                self._client.release(lock.lock_id, rank)
            except (ServerUnavailable, ServerError):
                # The lock's lease expires on the server by itself.
                return

    def _note_unavailable(self, exc: Exception) -> None:
        if self._unavailable_since is None:
            self._unavailable_since = time.monotonic()
            logger.warning(
                "kvshelf server unavailable (%s): lookups miss and vLLM recomputes until it is "
                "back",
                exc,
            )

    def _note_available(self) -> None:
        if self._unavailable_since is not None:
            logger.info(
                "kvshelf server reachable again after %.1f s",
                time.monotonic() - self._unavailable_since,
            )
            self._unavailable_since = None
