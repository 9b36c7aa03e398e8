"""Window-group blocks captured for deferred stores: how lazy offload knows they still hold
the KV they held when computed.

A sliding-window or chunked-local group (:mod:`kvshelf.roles.groups`) gives a running
request's blocks back to vLLM as soon as they leave the window, long before lazy offload
stores them. vLLM 0.32 hashes only the few window blocks a later hit can start from (its
``prefix_cache_retention_interval``, 0 by default, keeps the tail before the prompt's end), so
most of them carry no hash to re-verify, and vLLM puts a freed block without a hash at the
*front* of its free queue: it is handed out again at the next allocation.

So, in the step vLLM computes a window block it did not hash, lazy offload takes one
reference on it (a *capture*; a hashed one stays in vLLM's prefix cache once freed and is
verified by its hash). Once vLLM has dropped its own reference, the capture is handed back
through the pool's ``unpin`` (vLLM's ``BlockPool.unpin_blocks``): the block joins the *tail* of
the free queue, counts as free (vLLM's memory win of the window is kept), and the pool reports
when it hands the block out again. Until then the block is intact: its buffered "hash" is a
``Watched`` token, current while the block is not reused, and that is what verification
compares.

This module takes and drops only capture references; protection for a store in flight is the
ledger's (:mod:`kvshelf.lazy.protection`). No vLLM import.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvshelf.lazy.block_pool_view import BlockPoolView


@dataclass(frozen=True)
class Watched:
    """The content a captured block held when computed; equal only to itself while the block
    is not reused (``WindowBlockWatch.current``)."""

    generation: int


class WindowBlockWatch:
    """The captured window blocks of requests whose stores lazy offload has not submitted yet.

    A block is captured by one request at a time: a block vLLM did not hash cannot be in two
    requests' block tables (only a prefix-cache hit shares a block, and only a hashed one).

    Invariants:
        * lazy offload holds one reference on each block of ``_held``'s queues (each in the
          order its request computed them), and on no other captured block;
        * ``_owner[b]`` is the request that captured ``b``, and ``_tokens[b]`` the token of
          its content, until that request's captures are dropped or vLLM hands ``b`` out
          again.

    Args:
        pool: the GPU block pool the block ids refer to.
    """

    def __init__(self, pool: BlockPoolView) -> None:
        self._pool = pool
        self._generations = itertools.count()
        self._held: dict[str, deque[int]] = {}
        self._finished: set[str] = set()
        self._captured: dict[str, list[int]] = {}
        self._owner: dict[int, str] = {}
        self._tokens: dict[int, Watched] = {}

    @property
    def num_held(self) -> int:
        """The capture references held now."""
        return sum(len(queue) for queue in self._held.values())

    @property
    def holds_finished(self) -> bool:
        """Whether blocks of finished requests are still held: vLLM freed them, and the next
        ``settle`` hands them back, so vLLM must step once more even when idle."""
        return bool(self._finished)

    def capture(self, request_id: str, block_ids: Sequence[int]) -> dict[int, Watched]:
        """Take one reference on each block, computed for ``request_id`` this step.

        Returns:
            Each captured block's token, to buffer in place of its hash. A block another
            request captured already is left out: nothing can vouch for it (it cannot happen,
            see the class docstring, but a store of it is then never verified, not wrong).
        """
        new = [block_id for block_id in block_ids if block_id not in self._owner]
        if not new:
            return {}
        self._pool.touch(new)
        self._held.setdefault(request_id, deque()).extend(new)
        self._captured.setdefault(request_id, []).extend(new)
        tokens: dict[int, Watched] = {}
        for block_id in new:
            self._owner[block_id] = request_id
            tokens[block_id] = self._tokens[block_id] = Watched(next(self._generations))
        return tokens

    def current(self, block_id: int) -> Watched | None:
        """The token of a captured block that still holds what it held when captured; None
        once vLLM handed it out again (or it is not captured)."""
        return self._tokens.get(block_id)

    def request_finished(self, request_id: str) -> None:
        """vLLM finished the request and frees its blocks: hand them all back at ``settle``."""
        if request_id in self._held:
            self._finished.add(request_id)

    def settle(self) -> None:
        """Hand back the captured blocks vLLM no longer holds.

        A running request's window frees its blocks in the order it computed them, so only its
        leading held blocks are checked; a finished request's are all checked.
        """
        for request_id in list(self._held):
            queue = self._held[request_id]
            finished = request_id in self._finished
            kept: list[int] = []
            while queue:
                block_id = queue.popleft()
                if self._pool.ref_count(block_id) == 1:
                    # Only the capture holds it: vLLM (and any protection) let go.
                    self._pool.unpin([block_id], self._reused)
                elif finished:
                    kept.append(block_id)
                else:
                    queue.appendleft(block_id)
                    break
            queue.extendleft(reversed(kept))
            if not queue:
                del self._held[request_id]
                self._finished.discard(request_id)

    def forget(self, request_id: str) -> None:
        """Drop the captures of ``request_id``: its stores were verified or abandoned.

        Call it after protection took its own references on the blocks being stored.
        """
        held = self._held.pop(request_id, None)
        if held:
            self._pool.free(list(held))
        self._finished.discard(request_id)
        for block_id in self._captured.pop(request_id, ()):
            if self._owner.get(block_id) == request_id:
                del self._owner[block_id]
                self._tokens.pop(block_id, None)

    def _reused(self, block_id: int) -> None:
        """The pool handed ``block_id`` out again (or reset its cache): its content is gone,
        and the request it is handed to may capture it."""
        self._tokens.pop(block_id, None)
        self._owner.pop(block_id, None)
