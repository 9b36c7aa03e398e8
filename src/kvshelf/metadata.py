"""Per-step work items the scheduler-role connector hands to the workers.

These types have no vLLM import so that the lazy offload logic and the worker-side transfer
code can be unit-tested alone. vLLM carries them from the scheduler to the workers inside the
connector metadata.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StoreRequest:
    """Store work for one request: full blocks whose KV is computed and not yet stored.

    Invariant: ``block_ids[i]`` holds the KV of the block whose chained hash is
    ``block_hashes[i]`` at the time this item was made. ``first_block`` is the index of
    ``block_ids[0]`` within the request, so that items of one request made in successive
    steps (chunked prefill) follow one another.
    """

    request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    first_block: int

    def __post_init__(self) -> None:
        assert len(self.block_ids) == len(self.block_hashes), "one hash per block"
        assert self.first_block >= 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class LoadRequest:
    """Load work for one request: cached pages to copy into the blocks vLLM allocated.

    ``pages[rank][i]`` is the arena page that holds block ``block_ids[i]`` for that rank;
    the pages stay locked under ``lock_id`` until each rank releases its share. Page numbers
    are only meaningful in the arena of the server boot ``boot_id``.
    """

    request_id: str
    block_ids: tuple[int, ...]
    pages: tuple[tuple[int, ...], ...]
    lock_id: int
    boot_id: str
