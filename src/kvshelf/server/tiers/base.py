"""The storage-tier seam: the :class:`Tier` interface and the jobs the index hands to tiers.

The index (:mod:`kvshelf.server.index`) maps every key to an entry ``(tier, location)`` and
moves objects between tiers only through the verbs below, so it never knows which tier it
talks to. The shared-memory arena (L1, :class:`~kvshelf.server.tiers.arena.ArenaTier`) is the
first tier: workers read and write its pages, and every load ends in L1 pages. Tiers below it
(a local disk, Redis) keep copies of committed pages and bring them back into L1 pages.

Threads: every verb runs on the socket loop's thread and must never wait on I/O there. A tier
below L1 does its I/O on threads of its own and ends each job it was given by calling the
job's ``finish`` exactly once, from any thread; the index then runs the matching ``complete_*``
verb on the loop. The arena never calls ``finish``: its jobs end when a client commits, aborts
or releases (or its lease ends).

Must not import torch or vLLM.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvshelf.protocol import PageLayout
from kvshelf.server.pool import Entry, Page, Pool


class TierLoad:
    """Make the objects of ``entries`` readable in the L1 pages ``pages`` (same order).

    For the arena the objects are in L1 already (``pages is entries``): the load pins those
    pages while clients read them. For a tier below, ``pages`` are FILLING pages that the tier
    copies the objects into through ``views``; the index takes the pages that landed.

    Args:
        pool: the pool of every entry.
        entries: the entries to load (of the tier the load is handed to).
        pages: the L1 pages to load them into.
        views: for a tier below, a writable view of each page's bytes.
        on_finish: called by :meth:`finish`; set by the server for tiers below.
    """

    __slots__ = ("_on_finish", "entries", "landed", "pages", "pool", "views")

    def __init__(
        self,
        pool: Pool,
        entries: Sequence[Entry],
        pages: Sequence[Page],
        views: Sequence[memoryview] = (),
        on_finish: Callable[[TierLoad], None] | None = None,
    ) -> None:
        self.pool = pool
        self.entries = entries
        self.pages = pages
        self.views = views
        # landed[i]: pages[i] holds the object of entries[i]; set by finish().
        self.landed: list[bool] = []
        self._on_finish = on_finish

    def finish(self, landed: Sequence[bool]) -> None:
        """Report the copy over; from any thread, exactly once, by a tier below L1.

        Args:
            landed: for each page, whether it now holds its entry's whole object. A page that
                did not land must not be written after this call.
        """
        assert len(landed) == len(self.pages) and self._on_finish is not None
        self.landed = list(landed)
        self._on_finish(self)


class TierStore:
    """Keep objects of one rank of a pool in a tier.

    For the arena, ``block_hashes`` come from a worker's reservation: the arena places each in
    a RESERVED page (``pages``, and ``locations`` in the order of ``block_hashes``) and the
    commit (``complete_store``) makes them readable. For a tier below, ``pages`` are L1 pages
    that were just committed (the commit hook): the tier copies their bytes (``views``) behind
    the commit; the pages stay pinned in L1 until it calls :meth:`finish`.

    Args:
        pool: the pool.
        rank: the rank of every key.
        block_hashes: the keys' block hashes.
        pages: for a tier below, the committed L1 pages to copy, in key order.
        views: for a tier below, a read-only view of each page's bytes.
        on_finish: called by :meth:`finish`; set by the server for tiers below.
    """

    __slots__ = (
        "_on_finish",
        "block_hashes",
        "locations",
        "pages",
        "pool",
        "rank",
        "tenant",
        "views",
    )

    def __init__(
        self,
        pool: Pool,
        rank: int,
        block_hashes: Sequence[bytes],
        pages: list[Page] | None = None,
        views: Sequence[memoryview] = (),
        on_finish: Callable[[TierStore], None] | None = None,
    ) -> None:
        self.pool = pool
        self.rank = rank
        self.block_hashes = block_hashes
        self.pages: list[Page] = [] if pages is None else pages
        self.views = views
        # The arena's answer to a reservation: locations[i] is the page index for
        # block_hashes[i], or None when that key is skipped.
        self.locations: list[int | None] = []
        self._on_finish = on_finish
        # Who stores (kvshelf.server.tenants); the arena's pages of a reservation are theirs.
        self.tenant = ""

    def finish(self) -> None:
        """Report the copy over (stored or dropped); from any thread, exactly once."""
        assert self._on_finish is not None
        self._on_finish(self)


class TierProbe:
    """Ask a tier which of ``keys`` of one pool it holds: keys the index has no entry for.

    A tier that other processes write too (a shared store such as Redis) may hold keys the
    index never heard of; before a lookup is answered, such a tier is asked about the keys
    after the prefix the index knows (:meth:`Tier.discovers`). The tier asks its store on its
    own threads and calls :meth:`finish`; the keys found become STORED entries of that tier.

    Args:
        pool: the pool of every key.
        keys: ``(rank, block_hash)`` pairs.
        on_finish: called by :meth:`finish`; set by the server.
    """

    __slots__ = ("_on_finish", "found", "keys", "pool")

    def __init__(
        self,
        pool: Pool,
        keys: Sequence[tuple[int, bytes]],
        on_finish: Callable[[TierProbe], None] | None = None,
    ) -> None:
        self.pool = pool
        self.keys = keys
        # found[i]: the location of keys[i] in the tier, or None; set by finish().
        self.found: list[Any | None] = []
        self._on_finish = on_finish

    def finish(self, found: Sequence[Any | None]) -> None:
        """Report the answer; from any thread, exactly once.

        Args:
            found: for each key, its location in the tier, or None when the tier lacks it
                (or could not tell).
        """
        assert len(found) == len(self.keys) and self._on_finish is not None
        self.found = list(found)
        self._on_finish(self)


class TierIndex(Protocol):
    """What a tier below L1 may ask of the index (:class:`~kvshelf.server.index.CacheIndex`),
    on the loop's thread: restore the pools and keys it holds at start, and forget keys whose
    objects it no longer holds."""

    def register(
        self, layout: PageLayout, retires: str = "", holder: int = 0, *, restoring: bool = False
    ) -> Pool: ...

    def add_stored(
        self, pool_name: str, rank: int, block_hash: bytes, tier: Tier, location: Any
    ) -> bool: ...

    def remove_stored(self, pool_name: str, rank: int, block_hash: bytes, tier: Tier) -> bool: ...


class Tier(ABC):
    """A storage backend of the server.

    Verbs (after vLLM's offloading manager, for a server that moves the bytes itself):

    - :meth:`lookup`: whether an entry's object can be loaded now, without I/O.
    - :meth:`prepare_load` / :meth:`complete_load`: make objects readable in L1 pages; then
      drop what the tier held for the load.
    - :meth:`prepare_store` / :meth:`complete_store`: start keeping objects; then hold them.

    Attributes:
        name: a short name for logs and stats, e.g. ``l1``, ``disk``, ``redis``.
    """

    name: str

    @abstractmethod
    def lookup(self, entry: Entry) -> bool:
        """Whether ``entry`` (one of this tier's) can be loaded now; must not do I/O."""

    @abstractmethod
    def prepare_load(self, load: TierLoad) -> None:
        """Start making ``load``'s objects readable in its pages.

        A tier below L1 starts its copies and returns; it calls ``load.finish`` when done.
        """

    @abstractmethod
    def complete_load(self, load: TierLoad) -> None:
        """The load is over: release whatever the tier held for it (pins, file handles)."""

    @abstractmethod
    def prepare_store(self, store: TierStore) -> None:
        """Start keeping ``store``'s objects.

        A tier below L1 queues its copy of ``store.views`` and returns at once (it may drop
        the store when it cannot keep up); it calls ``store.finish`` when done.
        """

    @abstractmethod
    def complete_store(self, store: TierStore) -> None:
        """The store is over: the objects that were kept are the tier's to serve."""

    def attach(self, index: TierIndex) -> None:  # noqa: B027 (optional: L1 needs nothing)
        """Called once by the index, on the loop's thread, before it serves anything.

        A tier below L1 that keeps objects across restarts registers their pools and adds
        their keys here (``add_stored``); it keeps ``index`` to ``remove_stored`` keys whose
        objects it drops later.
        """

    def holds(self, pool: Pool, rank: int, block_hash: bytes) -> Any | None:
        """The location of a copy of the key's object this tier keeps, else None.

        Asked when L1 evicts the key's page: a tier that answers a location keeps the key as
        one of its STORED entries, so eviction from L1 never loses an object a tier below
        holds. Must not do I/O.
        """
        return None

    def missed(self, block_hash: bytes) -> None:  # noqa: B027 (optional: a policy's feedback)
        """A lookup's prefix through L1 and the tiers below ended at ``block_hash``: the first
        block no tier could load (see :meth:`kvshelf.server.policy.EvictionPolicy.missed`)."""

    def discovers(self) -> bool:
        """Whether to ask this tier (:meth:`prepare_probe`) about keys the index does not know,
        now. A tier whose keys all come through the index (L1, a local disk) says False; a
        shared store says True while it is reachable. Must not do I/O."""
        return False

    def prepare_probe(self, probe: TierProbe) -> None:
        """Start finding which keys of ``probe`` the tier holds; ``probe.finish`` when known.

        Only asked of a tier whose :meth:`discovers` said True.
        """
        raise NotImplementedError(f"tier {self.name} does not discover keys")

    def complete_probe(self, probe: TierProbe) -> None:  # noqa: B027 (optional)
        """The probe's answer was taken in (on the loop): count what the tier counts."""

    def clear(self) -> int:
        """Drop every object of this node's own that no job uses (``kvshelf clear``); on the
        loop. A shared tier keeps its objects here (see :meth:`clear_shared`).

        Returns:
            How many objects were dropped.
        """
        return 0

    def drop_pool(self, pool: Pool) -> None:  # noqa: B027 (optional: a shared tier keeps its)
        """Forget every object of a retired pool (:mod:`kvshelf.server.pool_life`), on the
        loop; no job of the pool is in flight. A tier that restores pools at start must not
        restore this one again; a shared tier keeps its objects (other servers may use them)."""

    def clear_shared(self) -> bool:
        """Start dropping kvshelf's objects from a tier other nodes share, off the loop
        (``kvshelf clear --shared``); progress shows in :meth:`stats`.

        Returns:
            Whether a clear started: False for a local tier, or a shared one that is down.
        """
        return False

    def stats(self) -> dict[str, int]:
        """The tier's gauges and ``*_total`` counters, merged into the server's stats."""
        return {}

    def close(self) -> None:  # noqa: B027 (optional: a tier without threads has nothing to stop)
        """Stop the tier's threads; no job finishes after this returns."""
