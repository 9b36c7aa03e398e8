"""The server's data model: pools, their key tables, and the entries those tables map keys to.

A key is ``(pool, rank, block hash)``. Each pool keeps one table per rank mapping a block hash
to an :class:`Entry`: the tier that holds the key's object and its location there. An L1 entry
is a :class:`Page` of the shared-memory arena (location: the page index); an entry of a tier
below L1 (disk, Redis) is a plain :class:`Entry` in state ``STORED``.

Only behaviour-free records live here; the index (:mod:`kvshelf.server.index`) and the tiers
(:mod:`kvshelf.server.tiers`) change them, always on the socket loop's thread.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import msgspec

from kvshelf.server.block_ranks import BlockRanks
from kvshelf.server.policy import LruPolicy
from kvshelf.server.tenants import TenantPolicy

if TYPE_CHECKING:
    from kvshelf.protocol import PageLayout
    from kvshelf.server.tiers.base import Tier


class EntryState(enum.Enum):
    """Where an entry is in its life cycle (see :mod:`kvshelf.server.index`)."""

    FREE = 0  # an L1 page without a key, in its pool's free list
    RESERVED = 1  # an L1 page a worker is writing; keyed, invisible to lookups
    FILLING = 2  # an L1 page a lower tier is copying an object into; not keyed yet
    COMMITTED = 3  # an L1 page readable by lookups
    STORED = 4  # an object held by a tier below L1 only; loaded into L1 before it is read


class Entry(msgspec.Struct, gc=False, eq=False):
    """Where one key's object lives: ``location`` in ``tier``.

    There is one per key the server holds, so entries (and pages) are never tracked by Python's
    cyclic garbage collector (``gc=False``): a full collection walks every tracked object, and
    with an entry per key it held the socket loop for 150-200 ms at 300,000 keys. They can
    make no cycle of their own: an entry refers to its tier, its key and its location only.
    ``eq=False``: compared and hashed by identity, as any object.

    Args:
        tier: the tier holding the object.
        location: where in that tier; what it means is up to the tier.
        rank, block_hash: the key, within its pool.
        state: ``STORED`` for a tier below L1; a :class:`Page` manages its own.
    """

    tier: Tier
    location: Any
    rank: int = -1
    block_hash: bytes = b""
    state: EntryState = EntryState.STORED


class Page(Entry, gc=False, eq=False):
    """One page of a pool in the L1 arena; ``location`` is its page index.

    Pages are made once per extent and reused: eviction or an abort clears the key.
    """

    state: EntryState = EntryState.FREE
    # Its record in the arena's page table (kvshelf.server.page_table), -1: none.
    slot: int = -1
    # Readers of this page: lock shares, a lower tier writing it behind, a pending fetch's
    # prefix. > 0 keeps the page out of its pool's eviction policy.
    lock_count: int = 0
    # The eviction policy's own (kvshelf.server.policy.PolicyPage).
    stamp: int = 0
    # Whose page it is (kvshelf.server.tenants): the tenant whose store took it.
    tenant: str = ""

    def clear(self) -> None:
        """Forget the key; the page is FREE again."""
        assert self.lock_count == 0
        self.state = EntryState.FREE
        self.rank = -1
        self.block_hash = b""
        self.tenant = ""


class Pool:
    """The keys and L1 pages of one page layout (model, KV layout and world size).

    Args:
        name: the pool name, see :func:`kvshelf.protocol.pool_name`.
        page_bytes: size of every page (object) of the pool.
        world_size: number of stored ranks; keys are per stored rank.
        layout: the layout it was registered with (its rank is the first registrant's), which
            tiers that outlive the server keep to make the pool again at start.
        replicas: ranks that read each stored rank's objects (``PageLayout.replicas``): the
            workers' ranks ``r`` are stored rank ``r // replicas``.
    """

    def __init__(
        self,
        name: str,
        page_bytes: int,
        world_size: int,
        layout: PageLayout | None = None,
        replicas: int = 1,
    ) -> None:
        self.name = name
        self.page_bytes = page_bytes
        self.world_size = world_size
        self.replicas = replicas
        self.layout = layout
        # One table per rank (block hash -> entry), so a lookup needs no tuple keys.
        self.tables: list[dict[bytes, Entry]] = [{} for _ in range(world_size)]
        # How many ranks hold each block (kvshelf.server.block_ranks), so that whether a block
        # is whole never scans the tables; None for one stored rank, whose table tells.
        self.ranks: BlockRanks | None = BlockRanks() if world_size > 1 else None
        # L1 pages of the pool, owned by the arena tier.
        self.free: list[Page] = []
        # Unlocked COMMITTED pages and the order they are evicted in, per tenant; the arena
        # tier puts its configured policy here when the pool takes its first extent.
        self.policy = TenantPolicy(LruPolicy, page_bytes)
        self.num_pages = 0
        # COMMITTED L1 pages, kept by the arena tier (kvshelf stats' objects per pool).
        self.num_committed = 0
        # The arena extents the pool holds and their pages, oldest first.
        self.extents: list[tuple[range, list[Page]]] = []
        # When a lookup or a store last used the pool (the index's callers' clock).
        self.last_used = 0.0
        # Lease units of the pool's live reservations and locks (kvshelf.server.limits).
        self.lease_units = 0
        # The holder tokens of this server boot's registrations that have not let go of the
        # pool since (kvshelf.server.pool_life), at most MAX_HOLDERS_PER_POOL; once more came,
        # ``holders_capped``: it is never retired by its holders, only by the idle rules.
        self.holders: set[int] = set()
        self.holders_capped = False
        # Its record in the arena's pool table (kvshelf.server.page_table), -1: none.
        self.table_slot = -1

    @classmethod
    def of_layout(cls, layout: PageLayout) -> Pool:
        """The empty pool ``layout`` registers: one stored rank per ``layout.replicas`` ranks."""
        return cls(
            layout.pool,
            layout.page_bytes,
            layout.world_size // layout.replicas,
            layout,
            layout.replicas,
        )

    @property
    def readers(self) -> int:
        """The ranks that read the pool (a lock has a share for each): the layout's world
        size."""
        return self.world_size * self.replicas
