"""What a lookup leaves for one request: the server's answer, kept with its lock until vLLM
allocates the request, and the load it turns into.

Owns the per-request lookup records (:class:`LookupState`, :class:`Answer`), the rules for
reusing a kept answer, and turning an allocated hit into a ``LoadJob``. Asking the server,
waiting for replies and releasing locks are :mod:`kvshelf.roles.scheduler_lookups`'; this
module talks to no server and has no vLLM import.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvshelf.plan import LoadJob
from kvshelf.roles.groups import KVGroups

# How long a lookup's locked answer may be reused when vLLM asks again for the same request
# (after it could not allocate blocks for it), well inside the server's lock lease (30 s by
# default). Older answers are looked up again.
ANSWER_REUSE_S = 5.0


# A kept answer older than this is refreshed in the background when vLLM asks again: often
# enough to see blocks stored meanwhile, rarely enough that requests waiting for free blocks
# do not turn every (possibly empty, sub-millisecond) step into a lookup each.
ANSWER_REFRESH_S = 0.02


@dataclass
class Answer:
    """A lookup's answer for one request, kept until vLLM allocates the request.

    vLLM asks again when it could not allocate the request's blocks; a kept answer serves
    those asks without another round trip. Its lock, if any, is held until the workers load the
    hit or vLLM declines it.
    """

    hit_blocks: int
    # 0 when nothing is locked: a miss, or a hit no longer wanted.
    lock_id: int
    boot_id: str
    # pages[rank][k]: the page of the lookup's object k (KVGroups.lookup_keys' order).
    pages: tuple[tuple[int, ...], ...]
    # vLLM's local prefix hit, in blocks, as of the latest ask: the load starts there.
    local_blocks: int
    # The request's length and the time when the answer came, to know if it can be reused.
    num_tokens: int
    answered_at: float

    def reusable(self, request: Any) -> bool:
        """Whether this answer still describes ``request`` (not grown, not too old)."""
        return (
            self.num_tokens == request.num_tokens
            and time.monotonic() - self.answered_at < ANSWER_REUSE_S
        )

    def due_refresh(self) -> bool:
        """Whether a refresh should be sent (see ``ANSWER_REFRESH_S``)."""
        return time.monotonic() - self.answered_at >= ANSWER_REFRESH_S

    def load_job(
        self,
        request_id: str,
        block_ids: Sequence[Sequence[int]],
        num_external_tokens: int,
        block_size: int,
        groups: KVGroups,
    ) -> LoadJob:
        """The load of ``num_external_tokens`` of this locked hit into the blocks vLLM
        allocated for it (``block_ids`` per KV cache group).

        Whole blocks: a hit never covers the block of the prompt's last token
        (``Lookups._max_hit_blocks``). A window group's null blocks (outside the window that
        ends at the hit) are not loaded. The job carries the lock: the workers release it
        once they have read the pages.
        """
        num_blocks = -(-num_external_tokens // block_size)
        start = self.local_blocks
        assert start + num_blocks <= self.hit_blocks <= min(len(ids) for ids in block_ids)
        # A state group's state is the one at the hit's end: vLLM takes the hit whole or not.
        assert not groups.has_state or start + num_blocks == self.hit_blocks
        slots = groups.load_slots(block_ids, start, start + num_blocks)
        return LoadJob(
            request_id=request_id,
            block_ids=tuple(block_id for _, block_id in slots),
            pages=tuple(
                tuple(rank_pages[index] for index, _ in slots) for rank_pages in self.pages
            ),
            lock_id=self.lock_id,
            boot_id=self.boot_id,
        )


@dataclass
class LookupState:
    """One live request's lookup: a reply awaited, an answer kept, both, or neither."""

    # A lookup sent and not answered yet (its client ticket); vLLM is told to ask again.
    ticket: int | None = None
    # How many leading blocks of the request that lookup asks about.
    asked_blocks: int = 0
    answer: Answer | None = None
    # Whether the request's miss reason (or its full hit) is settled: by its first lookup
    # to end (the server counts the reason of that one only), so that asking again never
    # counts a request twice.
    miss_decided: bool = False
    # Until when its lookups let the server load blocks from tiers below L1 (FETCH_WAIT_S
    # after the first one was sent).
    fetch_until: float | None = None
