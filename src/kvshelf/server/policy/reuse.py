"""``reuse``: blocks used again live longer than blocks used once, by a factor learnt from misses.

Designed on the Mooncake traces (docs/cache-policy.md, ``benchmarks.trace``). What they show
about prefix KV, and what the policy does about each:

- **Most blocks are never used again** (two thirds of the conversation trace's blocks are seen
  once). A page is on one of two LRU lists: *first* (its key has not been seen lately) or
  *reused* (a lookup or store met its key before, while it was resident or within the last
  ``HISTORY_FACTOR`` x capacity keys seen). A page in *reused* is kept until it is
  ``k`` times older (since its last use) than the oldest page in *first*: at small capacities
  the one-off blocks churn through *first* and leave the reused prefixes alone.
- **Conversations come back after minutes**: a block reused once was usually stored long ago,
  so "seen before" needs a memory of keys much longer than the cache (a fingerprint set in two
  generations, :class:`_History`). A key enters it when it is stored, when its page first
  becomes reused and when a reused page is evicted; a hit on a page already reused is only a
  list move (a lookup of a million resident objects touches no set).
- **No fixed k wins everywhere**: a large k is 1.5 x LRU's hit ratio at small capacities and
  below LRU once the cache holds most conversations. ``k`` adapts, ARC-like, from ghosts (the
  fingerprints of the last evictions of each list), but counts only the block that *ended* a
  lookup's prefix (:meth:`ReusePolicy.missed`): in prefix caching a ghost hit deeper in the
  chain would not have been a hit anyway, and counting those sends k the wrong way.
- **A block is worth nothing without its ancestors**: the arena hands a chain's pages over
  deepest first, so within each list the tails of chains go first.

Every operation is O(1): dict and ordered-dict operations, a comparison of two list heads.
Memory: one list entry per evictable page (as LRU's), plus up to ``2 x HISTORY_FACTOR``
fingerprints (Python ints in sets, about 70 bytes each) per page of the pool's peak size and
``2 / GHOST_DIVISOR`` ghost entries per page: about 1.1 KiB per page at worst, beyond the
index's ``BYTES_PER_PAGE`` (a direct-mapped table of 8-byte slots was tried and lost most of
the gain: forgetting by collision drops the returning conversations). The policies of one
pool's tenants (:meth:`ReusePolicy.maker`) share all of it but their two lists (the clock,
history, ghosts, k and the pool's peak, :class:`_Learnt`), so the history is the pool's, not
one per tenant: a tenant costs two empty ordered dicts, and tenants x pool size fingerprints
cannot pile up.

Must not import torch or vLLM.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvshelf.server.policy.base import EvictionPolicy, PolicyPage

# A key counts as seen before when it is among the last HISTORY_FACTOR x peak-pages keys used
# (up to twice that, the older generation included). 8: shorter histories lose the returning
# conversations at small capacities (docs/cache-policy.md).
HISTORY_FACTOR = 8
# Each ghost list remembers the last peak-pages / GHOST_DIVISOR evictions of its list.
GHOST_DIVISOR = 8
# k, how many times longer than a first-use page a reused page may sit unused; its start,
# bounds and the factor one ghost hit moves it by.
K_START = 16.0
K_MIN = 1.0
K_MAX = 128.0
K_STEP = 0.05


class _History:
    """The fingerprints of the last ``size`` to ``2 x size`` keys used, in two generations."""

    def __init__(self) -> None:
        self._new: set[int] = set()
        self._old: set[int] = set()

    def __contains__(self, fingerprint: int) -> bool:
        return fingerprint in self._new or fingerprint in self._old

    def add(self, fingerprint: int, size: int) -> None:
        self._new.add(fingerprint)
        if len(self._new) >= size:
            self._old = self._new
            self._new = set()

    def clear(self) -> None:
        self._new.clear()
        self._old.clear()


class _Ghosts:
    """The fingerprints of a list's last evictions, oldest first."""

    def __init__(self) -> None:
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, fingerprint: int) -> bool:
        return fingerprint in self._keys

    def add(self, fingerprint: int, size: int) -> None:
        self._keys[fingerprint] = None
        self._keys.move_to_end(fingerprint)
        while len(self._keys) > size:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()


class _Learnt:
    """What the reuse policies of one pool learn together: the clock of uses, the pages they
    know (evictable or pinned) and the most they knew at once, the key history, the ghosts
    and k."""

    def __init__(self) -> None:
        self.clock = itertools.count(1)
        self.now = 0
        self.known = 0
        # The most pages the policies have known at once: their measure of the pool's capacity.
        self.peak = 1
        self.history = _History()
        self.ghost_first = _Ghosts()
        self.ghost_reused = _Ghosts()
        self.k = K_START


class ReusePolicy(EvictionPolicy):
    """Two LRU lists, first use and reused; a reused page outlives a first-use one k times.

    Args:
        learnt: what it shares with the policies of the pool's other tenants; None: its own.
    """

    name = "reuse"
    # Measured with tracemalloc over 100k pages and 20 capacities of one-off keys: 1,263 B per
    # page after the churn, 1,644 B at its peak, against LRU's 243 and 348 B.
    extra_bytes_per_page = 1_400

    __slots__ = ("_first", "_learnt", "_reused")

    def __init__(self, learnt: _Learnt | None = None) -> None:
        # Page location -> page, least recently used first; page.stamp is its last use.
        self._first: OrderedDict[int, PolicyPage] = OrderedDict()
        self._reused: OrderedDict[int, PolicyPage] = OrderedDict()
        self._learnt = _Learnt() if learnt is None else learnt

    @classmethod
    def maker(cls) -> Callable[[], ReusePolicy]:
        learnt = _Learnt()
        return lambda: cls(learnt)

    @property
    def k(self) -> float:
        """How many times longer than a first-use page a reused page may sit unused."""
        return self._learnt.k

    @k.setter
    def k(self, value: float) -> None:
        self._learnt.k = value

    def __len__(self) -> int:
        return len(self._first) + len(self._reused)

    def __contains__(self, page: PolicyPage) -> bool:
        return page.location in self._first or page.location in self._reused

    def add(self, page: PolicyPage) -> None:
        learnt = self._learnt
        fingerprint = hash(page.block_hash)
        target = self._reused if fingerprint in learnt.history else self._first
        self._use(page, fingerprint)
        target[page.location] = page
        learnt.known += 1
        if learnt.known > learnt.peak:
            learnt.peak = learnt.known

    def touch(self, page: PolicyPage) -> None:
        location = page.location
        if location in self._reused:
            # Already reused: its key goes into the history when it is evicted (pop_victim),
            # not at every hit, which keeps a hit to a list move on the loop.
            self._reused.move_to_end(location)
            learnt = self._learnt
            learnt.now = page.stamp = next(learnt.clock)
            return
        del self._first[location]
        self._reused[location] = page
        self._use(page, hash(page.block_hash))

    def pin(self, page: PolicyPage) -> None:
        # Its stamp, while pinned, says which list it goes back to: a pin is no use of its
        # own (a tier below writing the page behind its commit pins it too); a lookup's hit
        # touched the page before pinning it.
        if self._first.pop(page.location, None) is not None:
            page.stamp = -1
        else:
            del self._reused[page.location]
            page.stamp = 1

    def unpin(self, page: PolicyPage) -> None:
        target = self._first if page.stamp < 0 else self._reused
        learnt = self._learnt
        learnt.now = page.stamp = next(learnt.clock)
        target[page.location] = page

    def add_oldest(self, page: PolicyPage) -> None:
        page.stamp = 0
        self._first[page.location] = page
        self._first.move_to_end(page.location, last=False)
        self._learnt.known += 1

    def remove(self, page: PolicyPage) -> None:
        if self._first.pop(page.location, None) is None:
            del self._reused[page.location]
        self._learnt.known -= 1

    def pop_victim(self) -> PolicyPage:
        first, reused, learnt = self._first, self._reused, self._learnt
        if first and reused:
            now = learnt.now
            oldest_first = next(iter(first.values())).stamp
            oldest_reused = next(iter(reused.values())).stamp
            from_reused = now - oldest_reused > learnt.k * (now - oldest_first)
        else:
            from_reused = not first
        if from_reused:
            page = reused.popitem(last=False)[1]
            ghosts = learnt.ghost_reused
        else:
            page = first.popitem(last=False)[1]
            ghosts = learnt.ghost_first
        learnt.known -= 1
        fingerprint = hash(page.block_hash)
        if from_reused:
            # Hits of a reused page skip the history (touch): remember its key from here, so
            # that it comes back as reused.
            learnt.history.add(fingerprint, HISTORY_FACTOR * learnt.peak)
        ghosts.add(fingerprint, max(1, learnt.peak // GHOST_DIVISOR))
        return page

    def missed(self, block_hash: bytes) -> None:
        learnt = self._learnt
        fingerprint = hash(block_hash)
        if fingerprint in learnt.ghost_first:
            # A first-use page evicted too early ended this hit: give first-use pages room.
            learnt.k = max(K_MIN, learnt.k * (1 - K_STEP))
        elif fingerprint in learnt.ghost_reused:
            learnt.k = min(K_MAX, learnt.k * (1 + K_STEP))

    def pages(self) -> Iterator[PolicyPage]:
        return itertools.chain(self._first.values(), self._reused.values())

    def clear(self) -> None:
        learnt = self._learnt
        learnt.known -= len(self)
        self._first.clear()
        self._reused.clear()
        learnt.history.clear()
        learnt.ghost_first.clear()
        learnt.ghost_reused.clear()

    def _use(self, page: PolicyPage, fingerprint: int) -> None:
        learnt = self._learnt
        learnt.now = page.stamp = next(learnt.clock)
        learnt.history.add(fingerprint, HISTORY_FACTOR * learnt.peak)
