"""The lazy offloader: the scheduler role's ``OffloadMode`` when lazy offload is on.

It buffers store work, and on a trigger verifies that the selected requests' blocks still hold
the KV they held when buffered, protects them, and hands the verified StoreJobs back for
submission; it releases the protection when the stores complete or are abandoned. On a model
whose window groups free blocks early it captures their blocks as they are computed
(``kvshelf.lazy.window_watch``), so their deferred stores can be verified too.
Its settings come typed and validated from ``kvshelf.connector_config``; its policy from
``kvshelf.lazy.policies.registry``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvshelf.connector_config import LazyOffloadConfig
from kvshelf.lazy.block_pool_view import BlockPoolView
from kvshelf.lazy.pending_store import LazyOffloadPendingStore
from kvshelf.lazy.policies.base import BufferedHashes, PendingStoreItem
from kvshelf.lazy.policies.registry import create_policy
from kvshelf.lazy.protection import ProtectedBlocks
from kvshelf.lazy.window_watch import Watched, WindowBlockWatch
from kvshelf.metric_types import Counters
from kvshelf.metrics import LAZY
from kvshelf.plan import StoreJob
from kvshelf.roles.offload import OffloadMode

logger = logging.getLogger(__name__)


class LazyOffloader(OffloadMode):
    """Buffers store work and submits verified batches of it after requests finish.

    Invariant: every block id returned by ``drain`` holds one extra reference, taken before
    its hash was checked, until ``store_completed`` or ``release`` drops it; every reference
    taken here is listed in the ledger of protected blocks (``ProtectedBlocks``).

    Args:
        source: a ready pending store, or the configuration to build one from.
        block_pool: the scheduler's GPU block pool (``VllmBlockPoolView`` over vLLM's).
        frees_early: whether the model has window groups, whose blocks vLLM frees while their
            request runs (``KVGroups.frees_blocks_early``): store work is then made every
            step, and ``add`` is told which blocks to capture.
    """

    def __init__(
        self,
        source: LazyOffloadPendingStore | LazyOffloadConfig,
        block_pool: BlockPoolView,
        *,
        frees_early: bool = False,
    ) -> None:
        max_delay_ms = None
        if isinstance(source, LazyOffloadConfig):
            source.validate()
            max_delay_ms = source.max_delay_ms
            policy = create_policy(
                source.policy,
                source.threshold,
                block_pool=block_pool,
                eviction_window=source.eviction_window,
            )
            source = LazyOffloadPendingStore(policy, source.select_count, block_pool)
        assert source.block_pool is block_pool, "buffered hashes must come from this pool"
        self._store = source
        self._pool = block_pool
        self._protected = ProtectedBlocks(block_pool)
        self._max_delay_s = None if max_delay_ms is None else max_delay_ms / 1000.0
        # Finish time of each ready request, oldest first: what the bounded-delay flush reads.
        self._finished_at: OrderedDict[str, float] = OrderedDict()
        # Hashes of the submitted stores of each request, told to the policy once stored.
        self._submitted_hashes: dict[str, list[bytes]] = {}
        # Only the cumulative counters live here; the gauges are read when a snapshot is taken.
        self._counters = Counters(LAZY)
        self._watch = WindowBlockWatch(block_pool) if frees_early else None
        # With window groups, a policy that buffers at finish gets each request's work, made
        # step by step, when it finishes: request id -> (job, what to verify it against).
        self._staged: dict[str, list[tuple[StoreJob, BufferedHashes]]] = {}

    @property
    def capture_on_finish(self) -> bool:
        """Whether the connector buffers a request's store work once, when it finishes.

        Never with window groups: by then a window has given most of its blocks back, so the
        work is made every step and staged here until the request finishes.
        """
        return self._store.policy.capture_on_finish and self._watch is None

    def has_pending_work(self) -> bool:
        """Whether vLLM should keep stepping, idle or not, for this offloader's sake.

        True while blocks are protected (the completion of their stores frees them), while
        captured blocks of finished requests wait to be handed back to vLLM's free queue and,
        when the bounded-delay flush is on, while finished requests wait to be stored.
        """
        if self._protected.num_blocks:
            return True
        if self._watch is not None and self._watch.holds_finished:
            return True
        return self._max_delay_s is not None and bool(self._finished_at)

    def take_pending(self, request_ids: Sequence[str]) -> list[PendingStoreItem]:
        """Take the store work still buffered for ``request_ids`` out of the policy, unsubmitted.

        For benchmarks and tests that measure what a run left behind once it is over: the
        items leave the policy as if submitted, without being stored.
        """
        taken = self._store.policy.take(request_ids)
        if self._watch is not None:
            for item in taken:
                self._watch.forget(item.request_id)
        return taken

    def note_stored(self, block_hashes: Sequence[bytes]) -> None:
        """Tell the policy that the server holds these block hashes (e.g. a lookup hit)."""
        if block_hashes:
            self._store.policy.note_stored([bytes(h) for h in block_hashes])

    def note_missing(self, block_hashes: Sequence[bytes]) -> None:
        """Tell the policy that the server does not hold these block hashes (a lookup miss)."""
        if block_hashes:
            self._store.policy.note_missing([bytes(h) for h in block_hashes])

    def add(self, job: StoreJob, frees_early: Sequence[int] = ()) -> None:
        """Buffer one step's store work instead of submitting it.

        If the policy says the blocks would be evicted before it can select them, they are
        protected right away (while vLLM still holds them, at request_finished).

        Args:
            job: the StoreJob the connector made this step.
            frees_early: the job's blocks of window groups, computed this step: those vLLM
                did not hash are captured now (only with ``frees_early`` set at construction).
        """
        if self._watch is None:
            buffered = self._store.add(job)
            if buffered is not None and self._store.policy.protect_now(job.request_id):
                self._protected.hold(job.request_id, buffered.block_ids)
            return
        hashes = tuple(self._pool.block_hash(block_id) for block_id in job.block_ids)
        # A window block vLLM hashed stays in its prefix cache once freed (at the tail of the
        # free queue) and is verified by its hash; the others are captured.
        unhashed = {job.block_ids[i] for i, h in enumerate(hashes) if h is None}
        tokens = self._watch.capture(job.request_id, [b for b in frees_early if b in unhashed])
        if tokens:
            hashes = tuple(tokens.get(b, h) for b, h in zip(job.block_ids, hashes, strict=True))
        if self._store.policy.capture_on_finish:
            self._staged.setdefault(job.request_id, []).append((job, hashes))
        else:
            self._store.add(job, hashes)

    def _buffer_staged(self, request_id: str) -> None:
        """Hand a finished request's staged work to the policy (see ``_staged``)."""
        assert self._watch is not None
        buffered: list[int] = []
        for job, hashes in self._staged.pop(request_id, ()):
            kept = self._store.add(job, hashes)
            if kept is not None:
                buffered.extend(kept.block_ids)
        if not buffered:
            # Nothing to store (the server holds it all already): no verification will
            # release these captures.
            self._watch.forget(request_id)
        elif self._store.policy.protect_now(request_id):
            self._protected.hold(request_id, buffered)

    def request_finished(self, request_id: str) -> bool:
        """Note that vLLM finished a request; its blocks go back to vLLM right away.

        Returns:
            True if the request had buffered work and now counts as ready.
        """
        if self._watch is not None:
            self._watch.request_finished(request_id)
            if self._store.policy.capture_on_finish:
                self._buffer_staged(request_id)
        ready = self._store.mark_req_finished(request_id)
        if ready or self._store.policy.capture_on_finish:
            self._finished_at[request_id] = time.monotonic()
        return ready

    def finish(self, request_id: str, *, stores_in_flight: bool) -> bool:
        """See ``OffloadMode.finish``: vLLM never keeps the blocks, protection does."""
        self.request_finished(request_id)
        return False

    def drain(self, num_scheduled_tokens: int) -> list[StoreJob]:
        """Select finished requests if the policy triggers, and return their verified stores.

        With the bounded-delay flush on (``max_delay_ms``), requests finished longer ago than
        the delay are selected too, and on an idle step (no scheduled tokens) every finished
        request is, up to the select count: storing costs serving nothing then.

        Args:
            num_scheduled_tokens: the step's total scheduled tokens.

        Returns:
            The StoreJobs to submit this step, their blocks now protected.
        """
        idle = num_scheduled_tokens <= 0
        # vLLM scheduled this step (freeing what windows left) before asking for the plan.
        self.settle()
        # The specified behaviour: with no scheduled tokens vLLM's model runner takes the
        # no-forward path, so without the flush everything stays buffered for a real step.
        if idle and self._max_delay_s is None:
            return []
        items = [] if idle else self._store.pop_items_for_offload()
        if self._max_delay_s is not None:
            items += self._flush(self._store.select_count - len(items), idle)
        for item in items:
            self._finished_at.pop(item.request_id, None)
        if not items:
            return []
        self._counters.add("drains")
        submitted: list[StoreJob] = []
        for item in items:
            submitted.extend(self._verify_and_protect(item))
        return submitted

    def settle(self) -> None:
        """Hand captured window blocks vLLM has freed back to its free queue now (see
        ``kvshelf.lazy.window_watch``); ``drain`` does it too. Called where vLLM is about to
        allocate for waiting requests, and after it freed finished ones, so that it can
        reuse them as soon as it could without lazy offload."""
        if self._watch is not None:
            self._watch.settle()

    def _flush(self, room: int, idle: bool) -> list[PendingStoreItem]:
        """Take finished requests past the delay (all of them when idle), oldest first."""
        assert self._max_delay_s is not None
        if room <= 0 or not self._finished_at:
            return []
        deadline = time.monotonic() - self._max_delay_s
        due: list[str] = []
        for request_id, finished_at in self._finished_at.items():
            if len(due) == room or (not idle and finished_at > deadline):
                break
            due.append(request_id)
        taken = self._store.policy.take(due)
        # Requests the policy no longer holds (already selected) leave the flush queue too.
        for request_id in due:
            self._finished_at.pop(request_id, None)
        self._counters.add("requests_flushed", len(taken))
        return taken

    def store_completed(self, request_id: str) -> int:
        """Release a request's protected blocks once every worker has stored them.

        Args:
            request_id: the request whose stores all workers reported complete.

        Returns:
            The number of block references dropped; 0 for an unknown request.
        """
        num_freed = self._protected.drop_storing(request_id)
        self._counters.add("lazy_blocks_stored", num_freed)
        self._store.policy.note_stored(self._submitted_hashes.pop(request_id, []))
        return num_freed

    def release(self, request_ids: Iterable[str]) -> int:
        """Release protection for stores that will never complete (e.g. the server died).

        Args:
            request_ids: the requests whose stores are abandoned; unknown ones are ignored.

        Returns:
            The number of block references dropped.
        """
        freed = 0
        for request_id in request_ids:
            self._submitted_hashes.pop(request_id, None)
            freed += self._protected.drop_storing(request_id)
            freed += self._protected.drop_waiting(request_id)
        return freed

    def release_all(self) -> int:
        """Release every protected block; see ``release``."""
        return self.release(self._protected.request_ids)

    def snapshot(self) -> dict[str, int]:
        """The counters and gauges (``kvshelf.metrics.LAZY``), by name (``OffloadMode``)."""
        values = self._counters.snapshot()
        values["buffered_requests"] = self._store.policy.num_pending
        values["ready_requests"] = self._store.policy.num_ready
        values["blocks_protected"] = self._protected.num_blocks
        values["blocks_captured"] = 0 if self._watch is None else self._watch.num_held
        return values

    def log_stats(self) -> None:
        """Log the counters at DEBUG."""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("lazy offload stats: %s", self.snapshot())

    def _verify_and_protect(self, item: PendingStoreItem) -> list[StoreJob]:
        """Protect and verify one request's StoreJobs, in block order.

        Returns:
            The verified prefix of the item's StoreJobs (with a trimming policy, the last
            one may be cut short at its first stale block).
        """
        trim = self._store.policy.trim_on_mismatch
        request_id = item.request_id
        accepted: list[StoreJob] = []
        # Blocks protected when they were buffered already hold their reference.
        held_early = bool(self._protected.waiting(request_id))
        if held_early:
            assert self._protected.waiting(request_id) == [
                b for job, _ in item.entries for b in job.block_ids
            ]
        for job, buffered in item.entries:
            # Touch before re-reading: once protected the pool cannot evict the block, so the
            # hash read next stays true until the store completes.
            if not held_early:
                self._protected.hold(request_id, job.block_ids)
            valid = _matching_prefix(buffered, self._current(job.block_ids, buffered))
            if valid == job.num_blocks:
                self._accept(job, accepted)
                continue
            if trim and valid > 0:
                # The blocks before the first stale one still form a valid prefix: it is
                # submitted, the stale rest goes back to vLLM.
                prefix = StoreJob(
                    request_id=job.request_id,
                    block_ids=job.block_ids[:valid],
                    block_hashes=job.block_hashes[:valid],
                    first_block=job.first_block,
                    tenant=job.tenant,
                )
                self._accept(prefix, accepted)
                self._protected.drop_waiting(request_id, job.num_blocks - valid)
                self._counters.add("blocks_trimmed", job.num_blocks - valid)
            else:
                if trim:
                    logger.debug("blocks of request %s were reused before their store", request_id)
                else:
                    logger.warning("Part block hashes mismatch for request %s, skip it", request_id)
                self._protected.drop_waiting(request_id, job.num_blocks)
                self._counters.add("requests_skipped_hash_mismatch")
            # Later entries extend a prefix that is no longer stored: useless to a lookup.
            break
        # Blocks of entries after a mismatch, when protected early, are no use either.
        self._protected.drop_waiting(request_id)
        if self._watch is not None:
            # What is submitted is protected now; the captures have served.
            self._watch.forget(request_id)
        if accepted:
            self._counters.add("requests_submitted")
            self._counters.add("blocks_submitted", sum(job.num_blocks for job in accepted))
        return accepted

    def _current(self, block_ids: Sequence[int], buffered: BufferedHashes) -> list[object | None]:
        """What the blocks hold now, to compare with what they held when buffered: a captured
        window block's token while it is not reused, else the pool's hash."""
        watch = self._watch
        if watch is None:
            return [self._pool.block_hash(block_id) for block_id in block_ids]
        return [
            watch.current(block_id) if isinstance(old, Watched) else self._pool.block_hash(block_id)
            for block_id, old in zip(block_ids, buffered, strict=True)
        ]

    def _accept(self, job: StoreJob, accepted: list[StoreJob]) -> None:
        """Submit a verified job: its blocks, held while waiting, now protect its store."""
        self._protected.mark_storing(job.request_id, job.num_blocks)
        self._submitted_hashes.setdefault(job.request_id, []).extend(job.block_hashes)
        accepted.append(job)


def _matching_prefix(buffered: BufferedHashes, current: Sequence[object | None]) -> int:
    """How many leading blocks still hold what they held when buffered.

    A block with no hash at buffering time cannot be verified, so it never matches.
    """
    for index, (old, new) in enumerate(zip(buffered, current, strict=True)):
        if old is None or old != new:
            return index
    return len(buffered)
