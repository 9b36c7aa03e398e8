"""The scheduler role's lookups: which prefix of a request the server holds, asked without
making a scheduler step wait.

Owns each live request's lookup state machine (a client ticket while the reply is awaited,
then the answer and its lock until vLLM allocates the request) and every rule about asking,
refreshing and cancelling; the records themselves, and how an allocated hit becomes a
``LoadJob``, are :mod:`kvshelf.roles.lookup_answers`'. Store work and plans are the scheduler
role's (``kvshelf.roles.scheduler``). No vLLM import: vLLM's ``Request`` is read by attribute
(``request_id``, ``block_hashes``, ``num_tokens``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvshelf.client import ServerError, ServerTimeout, ServerUnavailable
from kvshelf.metric_types import Counters
from kvshelf.plan import LoadJob
from kvshelf.protocol import MAX_NAME_CHARS, MissReason, max_request_keys
from kvshelf.roles.groups import ONE_FULL_GROUP, KVGroups
from kvshelf.roles.lookup_answers import Answer, LookupState

logger = logging.getLogger(__name__)


# How long one scheduler step may wait, in all, for replies of first lookups. A server on the
# same host answers in about 0.1 ms, so a new request is usually answered in the step that
# asks (no step is spent waiting for it, and vLLM does not spin through empty steps); a slow
# or dead server costs each step at most this, and its requests are asked again later.
LOOKUP_WAIT_PER_STEP_S = 0.002

# The same budget after a step that ran nothing (vLLM had no request to compute): only requests
# waiting for their lookups are left, so a longer wait delays no computation, and vLLM spins
# through fewer empty steps. Measured on a 2-core machine during a disk tier's cold fetch:
# vLLM's worker process spent 0.5 to 1 core on empty steps, CPU the fetch needed. A reply
# ends the wait as soon as it arrives; a request that arrives meanwhile waits at most this.
IDLE_LOOKUP_WAIT_PER_STEP_S = 0.02

# The scheduler counter (kvshelf.metrics.SCHEDULER) of each reason the server gives for a miss.
_SERVER_MISS_COUNTERS = {
    MissReason.NEVER_STORED: "miss_never_stored",
    MissReason.EVICTED: "miss_evicted",
    MissReason.RANK_INCOMPLETE: "miss_rank_incomplete",
    MissReason.TIER_ERROR: "miss_tier_error",
}

# How long one request waits, in all, for the server to load its prefix from tiers below L1
# (disk, Redis). The server answers such a lookup "pending" when its loads take longer than
# its fetch deadline (0.25 s); the request is then asked again (vLLM schedules others
# meanwhile) until this wait is over, and after it the lookup takes what L1 holds: a slow
# tier makes the hit shorter, never a server that looks dead.
FETCH_WAIT_S = 2.0


def request_tenant(request: Any) -> str:
    """The tenant a request's lookups and stores name (``kvshelf.server.tenants``): its
    ``cache_salt``, else its LoRA adapter's name, else "" (none).

    The salt is in the block hashes already, so this only tells the server whose they are;
    one longer than a protocol name goes as its digest.
    """
    tenant = getattr(request, "cache_salt", None)
    if not tenant:
        lora = getattr(request, "lora_request", None)
        tenant = lora.lora_name if lora is not None else ""
    if len(tenant) > MAX_NAME_CHARS:
        tenant = hashlib.sha256(tenant.encode()).hexdigest()
    return tenant


class LookupClient(Protocol):
    """The part of ``KVShelfClient`` lookups use."""

    def submit_lookup(
        self,
        pool: str,
        hashes: Sequence[bytes],
        *,
        world_size: int,
        lock: bool,
        count_miss: bool = True,
        fetch: bool,
        block_keys: int = 1,
        ends: Sequence[Sequence[bytes]] = (),
        tenant: str = "",
    ) -> int: ...

    def poll_lookup(self, ticket: int, wait_s: float = 0.0) -> Any: ...

    def cancel_lookup(self, ticket: int) -> Any: ...

    def collect_abandoned(self) -> bool: ...

    def release_all_nowait(self, lock_id: int, world_size: int) -> None: ...


class Lookups:
    """Asynchronous, locked lookups of the requests vLLM schedules.

    Invariants:
        * A hit is never the whole prompt: at least the last token is computed by vLLM.
        * Every lock taken by a lookup is released exactly once: by the workers after a
          load (the ``LoadJob`` carries it), or here when vLLM does not load it, a refresh
          replaces it, or the request ends.

    Args:
        counters: the scheduler role's counters (the lookup ones are counted here).
        on_reply: called with (request, hit blocks, asked blocks) whenever a reply comes: the
            server holds the request's first hit blocks, and not the next ones up to the
            asked blocks (the blocks the lookup covered).
        client: the server client (lookups and lock releases).
        pool: the pool name of this model and layout (``kvshelf.protocol.pool_name``).
        block_size: vLLM's block size in tokens.
        world_size: the number of KV ranks; a hit must be stored for all of them.
        groups: the model's KV cache groups; a hit covers a block when every group holds it.
    """

    def __init__(
        self,
        counters: Counters,
        on_reply: Callable[[Any, int, int], None],
        client: LookupClient,
        pool: str,
        block_size: int,
        world_size: int,
        groups: KVGroups = ONE_FULL_GROUP,
    ) -> None:
        self._client = client
        self._groups = groups
        self._pool = pool
        self._block_size = block_size
        self._world_size = world_size
        self._counters = counters
        self._on_reply = on_reply
        self._lookups: dict[str, LookupState] = {}
        # Set when a lookup was cancelled before its reply came: its lock is released once
        # the reply is collected.
        self._abandoned = False
        # What is left of this step's LOOKUP_WAIT_PER_STEP_S.
        self._wait_budget_s = LOOKUP_WAIT_PER_STEP_S
        self._unavailable_since: float | None = None
        # Outages so far (StepPlan.server_outages): a lookup that waited a whole timeout for
        # the server in vain, the first since the server last answered one.
        self.outages = 0
        self._timed_out = False

    @property
    def has_abandoned_replies(self) -> bool:
        """Whether replies of cancelled lookups are still to be collected (and unlocked)."""
        return self._abandoned

    def begin_step(self, idle: bool = False) -> None:
        """Start a scheduler step: a fresh wait budget, and abandoned replies collected.

        Args:
            idle: the step before computed nothing (see ``IDLE_LOOKUP_WAIT_PER_STEP_S``).
        """
        self._wait_budget_s = (
            max(LOOKUP_WAIT_PER_STEP_S, IDLE_LOOKUP_WAIT_PER_STEP_S)
            if idle
            else LOOKUP_WAIT_PER_STEP_S
        )
        if self._abandoned:
            self._abandoned = self._client.collect_abandoned()

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
            The number of tokens to load (whole blocks, never the block of the prompt's last
            token); 0 on a miss or when the server cannot answer in time; None while the reply
            is awaited.
        """
        state = self._lookups.get(request.request_id)
        if state is None:
            state = LookupState()
            self._lookups[request.request_id] = state
        local_blocks = num_computed_tokens // self._block_size
        if state.answer is not None and not state.answer.reusable(request):
            self._cancel(state)
            self._drop_answer(state)
        if (
            state.ticket is None
            and state.answer is None
            and not self._submit(state, request, local_blocks)
        ):
            return 0
        if state.ticket is not None:
            arrived = self._take_reply(state, request, local_blocks)
            if not arrived and state.answer is None:
                self._counters.add("lookups_deferred")
                return None
        elif state.answer.due_refresh():
            self._submit(state, request, local_blocks)
        answer = state.answer
        if answer is None:
            return 0
        answer.local_blocks = local_blocks
        hit_tokens = min(answer.hit_blocks, self._max_hit_blocks(request)) * self._block_size
        if answer.lock_id == 0 or hit_tokens <= num_computed_tokens:
            self._unlock(answer)
            return 0
        return hit_tokens - num_computed_tokens

    def take_load(
        self, request_id: str, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> LoadJob | None:
        """Consume a request's answer once vLLM has allocated blocks for it.

        Args:
            request_id: the allocated request.
            block_ids: all of the request's block ids, per KV cache group.
            num_external_tokens: tokens vLLM will take from kvshelf; 0 declines the hit.

        Returns:
            The load of the hit, which carries its lock to the workers; None when there is
            nothing to load (no answer, a miss, or a declined hit, whose lock goes now).
        """
        state = self._lookups.get(request_id)
        if state is None or state.answer is None:
            return None
        # The request is allocated: if vLLM asks about it again (after a preemption), that is
        # a new lookup; a refresh still in flight is of no use.
        self._cancel(state)
        answer, state.answer = state.answer, None
        if answer.lock_id == 0:
            return None
        if num_external_tokens <= 0:
            self._unlock(answer)
            return None
        return answer.load_job(
            request_id, block_ids, num_external_tokens, self._block_size, self._groups
        )

    def switch_pool(self, pool: str) -> None:
        """Look up in ``pool`` from now on; answers from the old pool are dropped, unlocked."""
        self._pool = pool
        for state in self._lookups.values():
            self._cancel(state)
            self._drop_answer(state)

    def forget(self, request_id: str) -> None:
        """A request ended: cancel its lookup and release what its answer locked."""
        state = self._lookups.pop(request_id, None)
        if state is not None:
            self._cancel(state)
            self._drop_answer(state)

    def _max_hit_blocks(self, request: Any) -> int:
        """The full blocks of ``request`` a hit can cover: never the block of its last token.

        vLLM must compute at least the last token, to sample from it. A load is of whole
        blocks, and the block holding that token would be written twice in the same step:
        by the load and by vLLM's KV cache update of the recomputed token, unordered on a GPU
        in piecewise and eager steps (the update comes before the attention layer's wait),
        so the slot could end up with either value or a mix. A hit that covers the whole of a
        block-aligned prompt therefore ends a block earlier, and vLLM recomputes that block,
        as its own prefix cache does (``KVCacheManager.get_computed_blocks`` looks up at most
        ``num_tokens - 1`` tokens, in whole blocks). It is also what a state group needs: the
        state at a hit's end must be the state before the first token vLLM computes.
        """
        # One lookup names at most max_request_keys keys (a key per group per block); a
        # longer prompt looks up its first blocks rather than be refused.
        most = max_request_keys(self._world_size) // self._groups.num_groups
        return min(len(request.block_hashes), (request.num_tokens - 1) // self._block_size, most)

    def _submit(self, state: LookupState, request: Any, local_blocks: int) -> bool:
        """Send the lookup of a request's prefix.

        Returns:
            Whether it was sent: False when vLLM already has every full block locally or the
            server is unavailable.
        """
        max_blocks = self._max_hit_blocks(request)
        if max_blocks <= local_blocks:
            return False
        self._counters.add("lookups")
        now = time.monotonic()
        if state.fetch_until is None:
            state.fetch_until = now + FETCH_WAIT_S
        state.asked_blocks = max_blocks
        keys = self._groups.lookup_keys(request.block_hashes[:max_blocks])
        try:
            state.ticket = self._client.submit_lookup(
                self._pool,
                keys.hashes,
                world_size=self._world_size,
                lock=True,
                count_miss=not state.miss_decided,
                fetch=now < state.fetch_until,
                block_keys=keys.block_keys,
                ends=keys.ends,
                tenant=request_tenant(request),
            )
        except ServerUnavailable as exc:
            self._counters.add("lookup_failures")
            self._note_unavailable(exc)
            self._decide_miss(state, "miss_server_unavailable")
            return False
        return True

    def _take_reply(self, state: LookupState, request: Any, local_blocks: int) -> bool:
        """Collect the reply of a request's lookup into ``state.answer`` (replacing it).

        A failed lookup leaves the answer as it was (none for a first lookup: the request is
        computed, and asking again sends a new lookup, which fails fast while the server is
        away).

        Returns:
            False while the reply has not arrived yet.
        """
        assert state.ticket is not None
        # Only a request with no answer yet waits: others have one to go on with.
        wait_s = self._wait_budget_s if state.answer is None else 0.0
        started = time.monotonic()
        try:
            result = self._client.poll_lookup(state.ticket, wait_s)
        except (ServerUnavailable, ServerError) as exc:
            state.ticket = None
            self._counters.add("lookup_failures")
            self._note_unavailable(exc)
            timed_out = isinstance(exc, ServerTimeout)
            if timed_out and not self._timed_out:
                self._timed_out = True
                self.outages += 1
            self._decide_miss(
                state, "miss_lookup_too_late" if timed_out else "miss_server_unavailable"
            )
            return True
        finally:
            if wait_s > 0:
                self._wait_budget_s = max(0.0, wait_s - (time.monotonic() - started))
        if result is None:
            return False
        state.ticket = None
        self._note_available()
        if result.pending:
            # The server is still loading the prefix from a tier below L1: ask again (a kept
            # answer stays as it is meanwhile).
            return False
        self._decide_miss(state, _SERVER_MISS_COUNTERS.get(result.miss_reason))
        hit_blocks = min(self._hit_blocks(result), self._max_hit_blocks(request))
        self._counters.add("lookup_hit_blocks", hit_blocks)
        self._on_reply(request, hit_blocks, state.asked_blocks)
        self._drop_answer(state)
        state.answer = Answer(
            hit_blocks=hit_blocks,
            lock_id=result.lock_id,
            boot_id=result.boot_id,
            pages=tuple(tuple(rank_pages) for rank_pages in result.pages),
            local_blocks=local_blocks,
            num_tokens=request.num_tokens,
            answered_at=time.monotonic(),
        )
        return True

    def _hit_blocks(self, result: Any) -> int:
        """The whole blocks a lookup reply holds: those every attention group's object of
        is held, and with state groups, all of them up to the reply's end or none."""
        groups = self._groups
        if not groups.has_state:
            return result.num_hit_blocks // groups.block_keys
        end = result.end_block
        wanted = end * groups.block_keys + groups.num_groups - groups.block_keys
        return end if end > 0 and result.num_hit_blocks == wanted else 0

    def _cancel(self, state: LookupState) -> None:
        """Drop a request's unanswered lookup; a lock in a reply that already came is freed."""
        if state.ticket is None:
            return
        result = self._client.cancel_lookup(state.ticket)
        state.ticket = None
        if result is None:
            self._abandoned = True
            # The request is allocated or gone before its first lookup was answered.
            self._decide_miss(state, "miss_lookup_too_late")
        else:
            self._decide_miss(state, _SERVER_MISS_COUNTERS.get(result.miss_reason))
            self._release(result.lock_id)

    def _decide_miss(self, state: LookupState, counter: str | None) -> None:
        """A lookup of the request ended: the first to end settles its miss reason,
        ``counter`` (None: no miss)."""
        if not state.miss_decided:
            state.miss_decided = True
            if counter is not None:
                self._counters.add(counter)

    def _drop_answer(self, state: LookupState) -> None:
        if state.answer is not None:
            self._unlock(state.answer)
            state.answer = None

    def _unlock(self, answer: Answer) -> None:
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
        self._timed_out = False
        if self._unavailable_since is not None:
            logger.info(
                "kvshelf server reachable again after %.1f s",
                time.monotonic() - self._unavailable_since,
            )
            self._unavailable_since = None
