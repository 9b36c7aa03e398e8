"""The offload policy interface and the pending store item it holds.

A policy holds the buffered store work of each request and decides which finished requests
lazy offload submits, and when. It only moves work items around: reading block hashes,
protecting blocks and submitting stores is the offloader's job. Policies are built by name
through ``kvshelf.lazy.policies.registry``; this module imports no policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvshelf.config_values import require_positive_int
from kvshelf.connector_config import LAZY_OFFLOAD_THRESHOLD
from kvshelf.lazy.block_pool_view import BlockPoolView
from kvshelf.plan import StoreJob

# The block hashes read from the pool when a StoreJob was buffered, one per block (for a
# captured window block, its ``kvshelf.lazy.window_watch.Watched`` token instead). None means
# the block held no cached content then, so its store can never be verified.
BufferedHashes = tuple[object | None, ...]


@dataclass
class PendingStoreItem:
    """All buffered store work of one request.

    Chunked prefill (or ``max-num-batched-tokens``) schedules a long prompt over several steps,
    each producing a StoreJob for that step's blocks only; they all aggregate here.

    Invariant: ``entries`` is in arrival order, which is the request's block order, so a
    StoreJob whose blocks were reused breaks the prefix for every entry after it.
    """

    request_id: str
    entries: list[tuple[StoreJob, BufferedHashes]] = field(default_factory=list)
    finished: bool = False

    @property
    def num_blocks(self) -> int:
        return sum(job.num_blocks for job, _ in self.entries)


class OffloadPolicy(ABC):
    """Buffers store work per request and selects finished requests to offload.

    Only the scheduler-role connector creates and calls a policy. Worker processes never
    create or invoke policies.

    Args:
        threshold: the number of finished, pending requests needed to trigger an offload.
    """

    # The connector buffers a request's store work once, when it finishes, instead of every
    # step (a policy that only ever selects finished requests loses nothing by it).
    capture_on_finish: ClassVar[bool] = False
    # On a hash mismatch, still store the verified blocks before it (they are a valid prefix)
    # instead of skipping the whole StoreJob as the FIFO specification demands.
    trim_on_mismatch: ClassVar[bool] = False

    def __init__(self, threshold: int) -> None:
        self.threshold = require_positive_int(LAZY_OFFLOAD_THRESHOLD, threshold)

    @classmethod
    def create(
        cls, threshold: int, block_pool: BlockPoolView | None, **options: Any
    ) -> OffloadPolicy:
        """Build the policy from the configuration.

        A policy that inspects the GPU block pool (e.g. to prefer blocks about to be evicted)
        overrides this to take ``block_pool``; the default ignores it.

        Args:
            threshold: see the class docstring.
            block_pool: the scheduler's GPU block pool, when the caller has one.
            options: policy-specific settings; policies ignore those they do not know.

        Returns:
            The new policy.
        """
        return cls(threshold)

    @abstractmethod
    def add(self, job: StoreJob, hashes: Sequence[object | None]) -> StoreJob | None:
        """Buffer one step's store work, aggregated into its request's single item.

        Args:
            job: the StoreJob the connector made this step.
            hashes: the pool's hash of each of ``job.block_ids`` at buffering time (a
                captured window block's token: ``kvshelf.lazy.window_watch``).

        Returns:
            The store work actually buffered (a policy may drop blocks it knows are stored),
            or None when nothing was.
        """

    def protect_now(self, request_id: str) -> bool:
        """Whether the blocks just buffered for ``request_id`` must be protected at once.

        A policy that selects by eviction order answers True when vLLM would evict them before
        the next selection; the offloader then takes its reference right away.
        """
        return False

    @abstractmethod
    def mark_req_finished(self, request_id: str) -> bool:
        """Mark a request finished, making it count towards the ready count.

        A request with no buffered item (shorter than one block, or aborted before its first
        store) has nothing to offload: this is a no-op, never an error, and never creates a
        ready item.

        Args:
            request_id: the finished request.

        Returns:
            True if this call made a pending item ready.
        """

    @abstractmethod
    def pop_items_for_offload(self, count: int) -> list[PendingStoreItem]:
        """Remove and return at most ``count`` finished items to offload now.

        Args:
            count: the most items to return; nothing is returned when it is <= 0.

        Returns:
            The selected items; they no longer count as pending or ready.
        """

    @abstractmethod
    def take(self, request_ids: Sequence[str]) -> list[PendingStoreItem]:
        """Remove and return the finished items of ``request_ids``, whatever the trigger.

        Used by the bounded-delay flush; unknown or unfinished requests are ignored.

        Args:
            request_ids: the requests to take, in the order to return them.

        Returns:
            Their items; they no longer count as pending or ready.
        """

    def note_stored(self, hashes: Sequence[bytes]) -> None:  # noqa: B027 (optional hook)
        """Learn block hashes the server holds (a policy may then skip storing them)."""

    def note_missing(self, hashes: Sequence[bytes]) -> None:  # noqa: B027 (optional hook)
        """Learn block hashes the server does not hold: a policy that skips blocks it believes
        stored must forget these (the server restarted empty, evicted them, or their store was
        dropped)."""

    @property
    @abstractmethod
    def num_pending(self) -> int:
        """The number of buffered items, finished or not."""

    @property
    @abstractmethod
    def num_ready(self) -> int:
        """The ready count: the number of buffered items whose request has finished."""
