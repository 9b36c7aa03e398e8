"""The narrow view of vLLM's GPU block pool that lazy offload needs.

Lazy offload reads block hashes to detect reuse and takes or drops one reference on a block to
protect it from eviction while its store is in flight; a window group's captured blocks are
handed back with a watch on their reuse (``kvshelf.lazy.window_watch``). Nothing else of the
block pool is used, so the policy code depends on this Protocol only and never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol


class BlockPoolView(Protocol):
    """What lazy offload reads from, and does to, the GPU block pool."""

    def block_hash(self, block_id: int) -> object | None:
        """Return the hash the block holds now, or None when it holds no cached content."""
        ...

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one reference on each block, so the pool cannot evict or reuse it."""
        ...

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; the first one is the first to be evicted."""
        ...

    def eviction_candidates(self, limit: int) -> Iterator[int]:
        """Yield the ids of the next ``limit`` blocks the pool will evict, soonest first."""
        ...

    def num_free_blocks(self) -> int:
        """Return the length of the free queue (blocks that can be handed out now)."""
        ...

    def ref_count(self, block_id: int) -> int:
        """Return the number of references held on the block (vLLM's and lazy offload's)."""
        ...

    def unpin(self, block_ids: Sequence[int], on_reuse: Callable[[int], None]) -> None:
        """Drop one reference on each block; one that no one holds then joins the tail of the
        free queue (counted free, evicted last), and ``on_reuse(block_id)`` is called when the
        pool hands it out again."""
        ...


class VllmBlockPoolView:
    """Duck-typed adapter over ``vllm.v1.core.block_pool.BlockPool``.

    Only ``pool.blocks``, ``pool.touch``, ``pool.free_blocks``, ``pool.get_num_free_blocks``,
    ``pool.unpin_blocks`` and the free queue's linked list (``pool.free_block_queue``) are
    used, so this module has no vLLM import and works with any object that has them.

    Args:
        pool: vLLM's scheduler-side block pool (or an object with the same members).
    """

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def block_hash(self, block_id: int) -> object | None:
        return self._pool.blocks[block_id].block_hash

    def touch(self, block_ids: Sequence[int]) -> None:
        self._pool.touch([self._pool.blocks[i] for i in block_ids])

    def free(self, block_ids: Sequence[int]) -> None:
        self._pool.free_blocks([self._pool.blocks[i] for i in block_ids])

    def num_free_blocks(self) -> int:
        return self._pool.get_num_free_blocks()

    def ref_count(self, block_id: int) -> int:
        return self._pool.blocks[block_id].ref_cnt

    def unpin(self, block_ids: Sequence[int], on_reuse: Callable[[int], None]) -> None:
        self._pool.unpin_blocks(
            [self._pool.blocks[i] for i in block_ids], lambda block: on_reuse(block.block_id)
        )

    def eviction_candidates(self, limit: int) -> Iterator[int]:
        # vLLM's free queue is a linked list whose head is the next block get_new_blocks
        # hands out (evicting its cached content); walk only as far as the caller reads.
        queue = self._pool.free_block_queue
        tail = queue.fake_free_list_tail
        block = queue.fake_free_list_head.next_free_block
        for _ in range(limit):
            if block is None or block is tail:
                return
            yield block.block_id
            block = block.next_free_block
