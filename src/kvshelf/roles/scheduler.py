"""The scheduler-role half of the connector: per-step plans and store accounting.

No vLLM import: vLLM's ``Request`` and ``SchedulerOutput`` are read by attribute, so this
module can be driven by a real vLLM ``Scheduler`` in tests and by nothing else at runtime.
It owns every decision (what to load, what to store, when); workers only move bytes. The
lookup state machine lives in ``kvshelf.roles.scheduler_lookups``; when store work is submitted is
decided by the offload mode (``kvshelf.roles.offload``), which the connector hands over: this
module names no mode but the default, eager one, and never imports ``kvshelf.lazy``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvshelf.metric_types import Counters
from kvshelf.metrics import SCHEDULER
from kvshelf.plan import LoadJob, StepPlan, StoreJob
from kvshelf.roles.events import EventTracker
from kvshelf.roles.groups import ONE_FULL_GROUP, KVGroups
from kvshelf.roles.offload import EagerOffload, OffloadMode
from kvshelf.roles.scheduler_lookups import LookupClient, Lookups, request_tenant

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    """The scheduler's view of one live request."""

    request: Any
    # Blocks [0, num_known_blocks) are stored in kvshelf or already handed to a store.
    num_known_blocks: int = 0


@dataclass
class _InflightStores:
    """Store jobs of one request handed to the workers and not yet confirmed by all."""

    jobs: int = 0
    reports: int = 0


class SchedulerConnector:
    """Scheduler-side connector logic.

    Invariants:
        * Only full blocks are stored and loaded.
        * A request with store jobs in flight is kept (by vLLM's delayed free or by the
          offload mode's protected blocks) until all ``world_size`` workers report them.
        * Lookups keep theirs (see ``Lookups``).

    Args:
        client: the server client (lookups and lock releases).
        pool: the pool name of this model and layout (``kvshelf.protocol.pool_name``).
        block_size: vLLM's block size in tokens.
        world_size: the number of KV ranks; a hit must be stored for all of them.
        get_block_ids: returns a request's block ids, per KV cache group.
        mode: when store work is submitted; eager when None.
        looks_up: whether requests are looked up (and loaded); False for vLLM's kv_producer.
        stores: whether computed blocks are stored; False for vLLM's kv_consumer.
        groups: the model's KV cache groups (:mod:`kvshelf.roles.groups`).
    """

    def __init__(
        self,
        client: LookupClient,
        pool: str,
        block_size: int,
        world_size: int,
        get_block_ids: Callable[[str], Sequence[Sequence[int]]],
        mode: OffloadMode | None = None,
        *,
        looks_up: bool = True,
        stores: bool = True,
        groups: KVGroups = ONE_FULL_GROUP,
    ) -> None:
        assert block_size > 0 and world_size > 0
        self._looks_up = looks_up
        self._stores = stores
        self._block_size = block_size
        self._groups = groups
        self._world_size = world_size
        self._get_block_ids = get_block_ids
        self._mode: OffloadMode = EagerOffload() if mode is None else mode
        self._requests: dict[str, _RequestState] = {}
        self._inflight: dict[str, _InflightStores] = {}
        self._pending_loads: list[LoadJob] = []
        self._delayed_free: set[str] = set()
        self._identity_epoch = ""
        # The KV events of what this engine can load from kvshelf; None while vLLM's are off.
        self._events: EventTracker | None = None
        # Cumulative counters, exposed through vLLM's connector stats (kvshelf.metrics.SCHEDULER).
        self.counters = Counters(SCHEDULER)
        self._lookups = Lookups(
            self.counters, self._server_answered, client, pool, block_size, world_size, groups
        )

    def reset_identity(self, pool: str, epoch: str) -> None:
        """Start a new identity epoch (vLLM reset the connector's cache, e.g. new weights).

        Lookups go to ``pool`` from now on, and the next plans tell the workers ``epoch``, so
        they store into that pool too. Lazy offload's buffered stores need nothing: vLLM's
        reset cleared its blocks' hashes, so their verification skips them.
        """
        self._identity_epoch = epoch
        self._lookups.switch_pool(pool)
        if self._events is not None:
            self._events.switch_pool(pool)

    def set_events(self, events: EventTracker) -> None:
        """Describe planned stores and found blocks to ``events`` (vLLM publishes KV events)."""
        self._events = events

    def set_mode(self, mode: OffloadMode) -> None:
        """Switch the offload mode (once vLLM has bound its block pool, before the first step)."""
        assert not self._inflight, "switch before the first step"
        self._mode = mode

    def snapshot(self) -> dict[str, int]:
        """All counters and gauges, by name (the offload mode's included)."""
        values = self.counters.snapshot()
        values["inflight_store_requests"] = len(self._inflight)
        values.update(self._mode.snapshot())
        return values

    def lookup(self, request: Any, num_computed_tokens: int) -> int | None:
        """Find how many tokens beyond ``num_computed_tokens`` kvshelf can load.

        See ``Lookups.lookup``: 0 on a miss, None while the reply is awaited; always 0 for an
        engine that does not look up (a producer), without asking the server.
        """
        state = self._requests.get(request.request_id)
        if state is None:
            state = _RequestState(request)
            self._requests[request.request_id] = state
        state.request = request
        local_blocks = num_computed_tokens // self._block_size
        if local_blocks >= min(len(request.block_hashes), request.num_tokens // self._block_size):
            # vLLM holds every full block of the prompt in its own prefix cache: the request
            # that computed them handed them to a store (or loaded them from kvshelf), so they
            # are neither looked up nor stored again. Storing them again cost this request a
            # reserve round trip whose answer is "skip" and vLLM kept its blocks until the
            # worker reported it. A prompt that extends past them is looked up, and a reply
            # showing the server lost some of them has them stored again.
            state.num_known_blocks = max(state.num_known_blocks, local_blocks)
        if not self._looks_up:
            return 0
        return self._lookups.lookup(request, num_computed_tokens)

    def _server_answered(self, request: Any, hit_blocks: int, asked_blocks: int) -> None:
        """A lookup reply: the server holds the first ``hit_blocks`` blocks of ``request``, and
        not the blocks after them up to ``asked_blocks``."""
        state = self._requests[request.request_id]
        # Whatever the mode believed stored (e.g. before a server restart or an eviction), the
        # server's answer is the truth about these blocks.
        if asked_blocks > hit_blocks:
            self._mode.note_missing(self._keys(request.block_hashes[hit_blocks:asked_blocks]))
        if self._events is not None:
            self._events.blocks_found(request, hit_blocks)
        if hit_blocks > state.num_known_blocks:
            self._mode.note_stored(
                self._keys(request.block_hashes[state.num_known_blocks : hit_blocks])
            )
            state.num_known_blocks = hit_blocks

    def _keys(self, block_hashes: Sequence[bytes]) -> Sequence[bytes]:
        """The server keys of these blocks in every attention group (their hashes with one
        group)."""
        if self._groups.num_groups == 1:
            return block_hashes
        return self._groups.lookup_keys(block_hashes).hashes

    def after_alloc(
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """Plan the load of a hit once vLLM has allocated blocks for it.

        Args:
            request: the vLLM request.
            block_ids: all of the request's block ids, per KV cache group.
            num_external_tokens: tokens vLLM will take from kvshelf; 0 declines the hit.
        """
        load = self._lookups.take_load(request.request_id, block_ids, num_external_tokens)
        if load is None:
            return
        self._pending_loads.append(load)
        self.counters.add("loads_planned")
        self.counters.add("hit_tokens", num_external_tokens)
        self.counters.add("blocks_load_planned", len(load.block_ids))

    def build_plan(self, scheduler_output: Any) -> StepPlan:
        """Collect this step's loads and stores.

        Args:
            scheduler_output: vLLM's ``SchedulerOutput`` for the step (not modified).

        Returns:
            The plan the workers execute this step.
        """
        self._lookups.begin_step(idle=scheduler_output.total_num_scheduled_tokens == 0)
        mode = self._mode
        # A mode that captures store work at finish has nothing to do per scheduled request.
        if self._stores and not mode.capture_on_finish:
            for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
                made = self._next_store(request_id, num_tokens)
                if made is not None:
                    mode.add(*made)
            for request_id, checkpoints in _state_checkpoints(scheduler_output).items():
                job = self._state_store(request_id, checkpoints)
                if job is not None:
                    mode.add(job)
        stores = mode.drain(scheduler_output.total_num_scheduled_tokens)
        for job in stores:
            inflight = self._inflight.setdefault(job.request_id, _InflightStores())
            inflight.jobs += 1
            self.counters.add("stores_submitted")
            self.counters.add("blocks_store_submitted", job.num_blocks)

        plan = StepPlan(
            loads=tuple(self._pending_loads),
            stores=tuple(stores),
            delayed_free=frozenset(self._delayed_free),
            preempted=frozenset(scheduler_output.preempted_req_ids or ()),
            new_blocks=_new_blocks(scheduler_output),
            identity_epoch=self._identity_epoch,
            server_outages=self._lookups.outages,
        )
        self._pending_loads.clear()
        self._delayed_free.clear()
        return plan

    def _next_store(
        self, request_id: str, num_scheduled_tokens: int
    ) -> tuple[StoreJob, tuple[int, ...]] | None:
        """The full blocks of a request that become computed this step and are not stored,
        and those of them in window groups (``OffloadMode.add``'s ``frees_early``)."""
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
        assert all(len(ids) >= full_blocks for ids in block_ids), "vLLM allocated them all"
        state.num_known_blocks = full_blocks
        if self._events is not None:
            self._events.blocks_planned(request, start, full_blocks)
        job = self._store_job(request, block_ids, start, full_blocks)
        if job is None:
            return None
        if not self._groups.frees_blocks_early:
            return job, ()
        return job, self._groups.window_block_ids(block_ids, start, full_blocks)

    def _store_job(
        self, request: Any, block_ids: Sequence[Sequence[int]], start: int, end: int
    ) -> StoreJob | None:
        """The store of blocks ``[start, end)`` of ``request``: each group's non-null block,
        under its group's key (:meth:`KVGroups.store_slots`)."""
        ids, keys = self._groups.store_slots(block_ids, request.block_hashes, start, end)
        if not ids:
            return None
        return StoreJob(
            request_id=request.request_id,
            block_ids=ids,
            block_hashes=keys,
            first_block=start,
            tenant=request_tenant(request),
        )

    def _state_store(
        self, request_id: str, checkpoints: Sequence[tuple[int, int, int]]
    ) -> StoreJob | None:
        """The store of the boundary states vLLM checkpointed for a request this step.

        vLLM offers them once, in the step whose forward pass writes them, and may reuse
        their blocks in a later step: the workers copy them before the next step's forward
        pass (a state group frees blocks early).
        """
        state = self._requests.get(request_id)
        if state is None:
            return None
        request = state.request
        ids, keys = self._groups.state_slots(checkpoints, request.block_hashes, self._block_size)
        if not ids:
            return None
        first_block = max(
            0, min(boundary for _, _, boundary in checkpoints) // self._block_size - 1
        )
        return StoreJob(
            request_id=request_id,
            block_ids=ids,
            block_hashes=keys,
            first_block=first_block,
            tenant=request_tenant(request),
        )

    def request_finished(self, request: Any, block_ids: Sequence[Sequence[int]]) -> bool:
        """Handle the end of a request.

        Args:
            request: the finished vLLM request.
            block_ids: its blocks holding computed tokens, per KV cache group, which vLLM
                frees unless told not to.

        Returns:
            True when vLLM must keep the request's blocks until the workers report its
            stores through ``finished_sending`` (the offload mode decides; eager: when
            stores are in flight).
        """
        request_id = request.request_id
        state = self._requests.pop(request_id, None)
        self._lookups.forget(request_id)
        if self._stores and self._mode.capture_on_finish and state is not None:
            job = self._finished_store(state, block_ids)
            if job is not None:
                self._mode.add(job)
        keep = self._mode.finish(request_id, stores_in_flight=request_id in self._inflight)
        if keep:
            self._delayed_free.add(request_id)
        return keep

    def _finished_store(
        self, state: _RequestState, block_ids: Sequence[Sequence[int]]
    ) -> StoreJob | None:
        """All computed full blocks of a finished request that kvshelf does not hold yet."""
        request = state.request
        full_blocks = min(
            len(request.block_hashes),
            request.num_computed_tokens // self._block_size,
            *(len(ids) for ids in block_ids),
        )
        start = state.num_known_blocks
        if full_blocks <= start:
            return None
        if self._events is not None:
            self._events.blocks_planned(request, start, full_blocks)
        return self._store_job(request, block_ids, start, full_blocks)

    def has_pending_work(self) -> bool:
        """Whether vLLM should keep stepping while idle (e.g. lazy stores to submit or confirm)."""
        return self._mode.has_pending_work()

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
            self.counters.add("stores_completed", inflight.jobs)
            inflight.reports -= inflight.jobs * self._world_size
            inflight.jobs = 0
            del self._inflight[request_id]
            self._mode.store_completed(request_id)


def _state_checkpoints(scheduler_output: Any) -> dict[str, list[tuple[int, int, int]]]:
    """vLLM's boundary states of this step (``(group, block id, boundary)`` per request), which
    a model with state-space groups in mamba cache mode ``align`` checkpoints; empty for
    others and for vLLM versions without them."""
    block_state = getattr(scheduler_output, "kv_connector_block_state", None)
    if block_state is None:
        return {}
    return block_state.boundary_state_offloads


def _new_blocks(scheduler_output: Any) -> frozenset[int]:
    """The blocks vLLM gave requests this step (``StepPlan.new_blocks``): every block of a new
    request (its prefix-cache hits too: a superset costs at most a needless wait) and the new
    blocks of running and resumed ones."""
    blocks: set[int] = set()
    for new in scheduler_output.scheduled_new_reqs:
        for group in new.block_ids:
            blocks.update(group)
    for added in scheduler_output.scheduled_cached_reqs.new_block_ids:
        for group in added or ():
            blocks.update(group)
    return frozenset(blocks)
