"""Per-step work: the jobs the scheduler-role connector hands to the workers, and the plan
that carries them.

Words: a *job* is one request's store or load work for one step (``StoreJob``, ``LoadJob``);
a *plan* is everything the workers do in one step (``StepPlan``). A vLLM *request* is the
user's request these jobs belong to; a wire *message* is a ``kvshelf.protocol`` struct.

No vLLM import, so that the lazy offload logic and the worker-side transfer code can be
unit-tested alone. vLLM carries the plan from the scheduler to the workers inside the
connector metadata.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StoreJob:
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
    # Whose blocks (kvshelf.roles.scheduler_lookups.request_tenant): the reserve names it.
    tenant: str = ""

    def __post_init__(self) -> None:
        assert len(self.block_ids) == len(self.block_hashes), "one hash per block"
        assert self.first_block >= 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class LoadJob:
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

    @property
    def num_pages(self) -> int:
        """The distinct pages each rank reads (a state-space state is loaded from one page
        into two blocks, see :meth:`kvshelf.roles.groups.KVGroups.load_slots`)."""
        return len(set(self.pages[0])) if self.pages else 0


@dataclass(frozen=True)
class StepPlan:
    """What the workers do in one step. Travels inside the vLLM connector metadata.

    Attributes:
        loads: pages to copy into vLLM blocks before this step's forward pass.
        stores: vLLM blocks to copy into the cache after this step's forward pass.
        delayed_free: requests whose blocks vLLM keeps until every worker reports their
            stores finished (through ``finished_sending``).
        preempted: requests preempted this step (vLLM frees their blocks at once).
        new_blocks: the blocks vLLM allocated to requests this step, in every group. The
            worker may zero them, copy into them, load into them or write them in this step's
            forward pass, and some may have been freed under a store still queued (a window
            slid past them, a preemption): the worker makes that store's copy come first.
        identity_epoch: the model identity's epoch (``kvshelf.roles.fingerprint``): "" until
            vLLM resets the connector's cache, then a fresh random nonce each time. Workers
            store this step's stores into the pool of this epoch.
        server_outages: how many times so far the scheduler waited a whole request timeout
            for the server in vain. A worker that sees it grow stops waiting for the server
            at once (``KVShelfClient.assume_unavailable``) rather than after a timeout of its
            own, so a stalled server costs a request one timeout, not one per process.
    """

    loads: tuple[LoadJob, ...] = ()
    stores: tuple[StoreJob, ...] = ()
    delayed_free: frozenset[str] = frozenset()
    preempted: frozenset[str] = frozenset()
    new_blocks: frozenset[int] = frozenset()
    identity_epoch: str = ""
    server_outages: int = 0
