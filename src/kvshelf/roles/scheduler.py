"""The scheduler-role half of the connector: lookups, per-step plans, store accounting.

No vLLM import: vLLM's ``Request`` and ``SchedulerOutput`` are read by attribute, so this
module can be driven by a real vLLM ``Scheduler`` in tests and by nothing else at runtime.
It owns every decision (what to load, what to store, when); workers only move bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvshelf.client import ServerError, ServerUnavailable
from kvshelf.lazy.offloader import LazyOffloader
from kvshelf.plan import LoadJob, StepPlan, StoreJob

logger = logging.getLogger(__name__)


# How long a lookup's locked answer may be reused when vLLM asks again for the same request
# (after it could not allocate blocks for it), well inside the server's lock lease (30 s by
# default). Older answers are looked up again.
ANSWER_REUSE_S = 5.0


# A kept answer older than this is refreshed in the background when vLLM asks again: often
# enough to see blocks stored meanwhile, rarely enough that requests waiting for free blocks
# do not turn every (possibly empty, sub-millisecond) step into a lookup each.
ANSWER_REFRESH_S = 0.02

# How long one scheduler step may wait, in all, for replies of first lookups. A server on the
# same host answers in about 0.1 ms, so a new request is usually answered in the step that
# asks (no step is spent waiting for it, and vLLM does not spin through empty steps); a slow
# or dead server costs each step at most this, and its requests are asked again later.
LOOKUP_WAIT_PER_STEP_S = 0.002


class SchedulerClient(Protocol):
    """The part of ``KVShelfClient`` the scheduler uses."""

    def submit_lookup(
        self, pool: str, hashes: Sequence[bytes], *, world_size: int, lock: bool
    ) -> int: ...

    def poll_lookup(self, ticket: int, wait_s: float = 0.0) -> Any: ...

    def cancel_lookup(self, ticket: int) -> Any: ...

    def collect_abandoned(self) -> bool: ...

    def release_all_nowait(self, lock_id: int, world_size: int) -> None: ...


@dataclass
class _Answer:
    """A lookup's answer for one request, kept until vLLM allocates the request.

    vLLM asks again when it could not allocate the request's blocks; a kept answer serves
    those asks without another round trip. Its lock, if any, is held until the workers load the
    hit or vLLM declines it.
    """

    hit_blocks: int
    # 0 when nothing is locked: a miss, or a hit no longer wanted.
    lock_id: int
    boot_id: str
    pages: tuple[tuple[int, ...], ...]
    # vLLM's local prefix hit, in blocks, as of the latest ask: the load starts there.
    local_blocks: int
    # The request's length and the time when the answer came, to know if it can be reused.
    num_tokens: int
    answered_at: float


@dataclass
class _RequestState:
    """The scheduler's view of one live request."""

    request: Any
    # Blocks [0, num_known_blocks) are stored in kvshelf or already handed to a store.
    num_known_blocks: int = 0
    # A lookup sent and not answered yet (its client ticket); vLLM is told to ask again.
    lookup_ticket: int | None = None
    answer: _Answer | None = None


@dataclass
class SchedulerCounters:
    """Cumulative scheduler-side counters (exposed through vLLM's connector stats)."""

    lookups: int = 0
    # Times vLLM was told to ask again because a lookup's reply had not arrived.
    lookups_deferred: int = 0
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
        self._pending_loads: list[LoadJob] = []
        self._delayed_free: set[str] = set()
        # Set when a lookup was cancelled before its reply came: its lock is released once
        # the reply is collected.
        self._abandoned_lookups = False
        # What is left of this step's LOOKUP_WAIT_PER_STEP_S.
        self._wait_budget_s = LOOKUP_WAIT_PER_STEP_S
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
        # Flat ints: vars() copies them far cheaper than dataclasses.asdict (called per step).
        values = dict(vars(self.counters))
        values["inflight_store_requests"] = len(self._inflight)
        if self._lazy is not None:
            values.update(self._lazy.stats.as_dict())
        return values

    def lookup(self, request: Any, num_computed_tokens: int) -> int | None:
        """Find how many tokens beyond ``num_computed_tokens`` kvshelf can load.

        The lookup is asynchronous, so that no scheduler step waits long for the server: the
        first ask sends it and waits for the reply within what is left of the step's
        ``LOOKUP_WAIT_PER_STEP_S``; without a reply by then it answers None (vLLM skips the
        request this step and asks again) and a later ask takes the reply. The answer is
        kept, with its lock, until vLLM allocates the request. vLLM asks again while it
        cannot allocate the request; those asks are answered from the kept answer at once,
        and one of them every ``ANSWER_REFRESH_S`` sends a refresh in the background (the
        server may hold more of the prompt by then, e.g. blocks lazy offload stored
        meanwhile), which replaces the answer when its reply has come.

        Args:
            request: the vLLM request (``request_id``, ``block_hashes``, ``num_tokens``).
            num_computed_tokens: block-aligned tokens vLLM already has locally.

        Returns:
            The number of tokens to load (whole blocks, or up to the prompt's last token); 0 on
            a miss or when the server cannot answer in time; None while the reply is awaited.
        """
        state = self._requests.get(request.request_id)
        if state is None:
            state = _RequestState(request)
            self._requests[request.request_id] = state
        state.request = request
        local_blocks = num_computed_tokens // self._block_size
        if state.answer is not None and not self._reusable(state.answer, request):
            self._cancel_lookup(state)
            self._drop_answer(state)
        if (
            state.lookup_ticket is None
            and state.answer is None
            and not self._submit_lookup(state, local_blocks)
        ):
            return 0
        if state.lookup_ticket is not None:
            arrived = self._take_reply(state, local_blocks)
            if not arrived and state.answer is None:
                self.counters.lookups_deferred += 1
                return None
        elif time.monotonic() - state.answer.answered_at >= ANSWER_REFRESH_S:
            self._submit_lookup(state, local_blocks)
        answer = state.answer
        if answer is None:
            return 0
        answer.local_blocks = local_blocks
        # vLLM must compute at least the last token to sample from it: a hit that reaches the
        # end of the prompt stops one token short (its last block is still loaded whole, and
        # vLLM recomputes that one slot).
        hit_tokens = min(answer.hit_blocks * self._block_size, request.num_tokens - 1)
        if answer.lock_id == 0 or hit_tokens <= num_computed_tokens:
            self._unlock(answer)
            return 0
        return hit_tokens - num_computed_tokens

    @staticmethod
    def _reusable(answer: _Answer, request: Any) -> bool:
        """Whether a kept answer still describes ``request`` (not grown, not too old)."""
        return (
            answer.num_tokens == request.num_tokens
            and time.monotonic() - answer.answered_at < ANSWER_REUSE_S
        )

    def _max_lookup_blocks(self, request: Any) -> int:
        """The full blocks of ``request`` a hit can cover (the last may be a whole prompt's)."""
        return min(len(request.block_hashes), request.num_tokens // self._block_size)

    def _submit_lookup(self, state: _RequestState, local_blocks: int) -> bool:
        """Send the lookup of a request's prefix.

        Returns:
            Whether it was sent: False when vLLM already has every full block locally or the
            server is unavailable.
        """
        request = state.request
        max_blocks = self._max_lookup_blocks(request)
        if max_blocks <= local_blocks:
            return False
        self.counters.lookups += 1
        try:
            state.lookup_ticket = self._client.submit_lookup(
                self._pool,
                list(request.block_hashes[:max_blocks]),
                world_size=self._world_size,
                lock=True,
            )
        except ServerUnavailable as exc:
            self.counters.lookup_failures += 1
            self._note_unavailable(exc)
            return False
        return True

    def _take_reply(self, state: _RequestState, local_blocks: int) -> bool:
        """Collect the reply of a request's lookup into ``state.answer`` (replacing it).

        A failed lookup leaves the answer as it was (none for a first lookup: the request is
        computed, and asking again sends a new lookup, which fails fast while the server is
        away).

        Returns:
            False while the reply has not arrived yet.
        """
        assert state.lookup_ticket is not None
        # Only a request with no answer yet waits: others have one to go on with.
        wait_s = self._wait_budget_s if state.answer is None else 0.0
        started = time.monotonic()
        try:
            result = self._client.poll_lookup(state.lookup_ticket, wait_s)
        except (ServerUnavailable, ServerError) as exc:
            state.lookup_ticket = None
            self.counters.lookup_failures += 1
            self._note_unavailable(exc)
            return True
        finally:
            if wait_s > 0:
                self._wait_budget_s = max(0.0, wait_s - (time.monotonic() - started))
        if result is None:
            return False
        state.lookup_ticket = None
        self._note_available()
        request = state.request
        hit_blocks = min(result.num_hit_blocks, self._max_lookup_blocks(request))
        self.counters.lookup_hit_blocks += hit_blocks
        if self._lazy is not None and hit_blocks > state.num_known_blocks:
            self._lazy.note_stored(
                [bytes(h) for h in request.block_hashes[state.num_known_blocks : hit_blocks]]
            )
        state.num_known_blocks = max(state.num_known_blocks, hit_blocks)
        self._drop_answer(state)
        state.answer = _Answer(
            hit_blocks=hit_blocks,
            lock_id=result.lock_id,
            boot_id=result.boot_id,
            pages=tuple(tuple(rank_pages) for rank_pages in result.pages),
            local_blocks=local_blocks,
            num_tokens=request.num_tokens,
            answered_at=time.monotonic(),
        )
        return True

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Plan the load of a hit once vLLM has allocated blocks for it.

        Args:
            request: the vLLM request.
            block_ids: all of the request's block ids (first KV cache group).
            num_external_tokens: tokens vLLM will take from kvshelf; 0 declines the hit.
        """
        state = self._requests.get(request.request_id)
        if state is None or state.answer is None:
            return
        # The request is allocated: if vLLM asks about it again (after a preemption), that is
        # a new lookup; a refresh still in flight is of no use.
        self._cancel_lookup(state)
        answer, state.answer = state.answer, None
        if answer.lock_id == 0:
            return
        if num_external_tokens <= 0:
            self._unlock(answer)
            return
        # A hit ending one token before the end of a block-aligned prompt loads that last
        # block whole.
        num_blocks = -(-num_external_tokens // self._block_size)
        start = answer.local_blocks
        assert start + num_blocks <= answer.hit_blocks <= len(block_ids)
        # The workers release the lock once they have read the pages.
        load = LoadJob(
            request_id=request.request_id,
            block_ids=tuple(block_ids[start : start + num_blocks]),
            pages=tuple(rank_pages[start : start + num_blocks] for rank_pages in answer.pages),
            lock_id=answer.lock_id,
            boot_id=answer.boot_id,
        )
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
        self._wait_budget_s = LOOKUP_WAIT_PER_STEP_S
        if self._abandoned_lookups:
            self._abandoned_lookups = self._client.collect_abandoned()
        stores: list[StoreJob] = []
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

    def _next_store(self, request_id: str, num_scheduled_tokens: int) -> StoreJob | None:
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
        return StoreJob(
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
            self._cancel_lookup(state)
            self._drop_answer(state)
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

    def _finished_store(self, state: _RequestState, block_ids: Sequence[int]) -> StoreJob | None:
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
        return StoreJob(
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

    def _cancel_lookup(self, state: _RequestState) -> None:
        """Drop a request's unanswered lookup; a lock in a reply that already came is freed."""
        if state.lookup_ticket is None:
            return
        result = self._client.cancel_lookup(state.lookup_ticket)
        state.lookup_ticket = None
        if result is None:
            self._abandoned_lookups = True
        else:
            self._release(result.lock_id)

    def _drop_answer(self, state: _RequestState) -> None:
        if state.answer is not None:
            self._unlock(state.answer)
            state.answer = None

    def _unlock(self, answer: _Answer) -> None:
        self._release(answer.lock_id)
        answer.lock_id = 0

    def _release(self, lock_id: int) -> None:
        """Release every rank's share of a lookup lock (0: none)."""
        if lock_id != 0:
            self._client.release_all_nowait(lock_id, self._world_size)

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
