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
the gain: forgetting by collision drops the returning conversations).

Must not import torch or vLLM.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator

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


class ReusePolicy(EvictionPolicy):
    """Two LRU lists, first use and reused; a reused page outlives a first-use one k times."""

    name = "reuse"
    # Measured with tracemalloc over 100k pages and 20 capacities of one-off keys: 1,263 B per
    # page after the churn, 1,644 B at its peak, against LRU's 243 and 348 B.
    extra_bytes_per_page = 1_400

    def __init__(self) -> None:
        # Page location -> page, least recently used first; page.stamp is its last use.
        self._first: OrderedDict[int, PolicyPage] = OrderedDict()
        self._reused: OrderedDict[int, PolicyPage] = OrderedDict()
        self._clock = itertools.count(1)
        self._now = 0
        self._pinned = 0
        # The most pages the policy has known at once: its measure of the pool's capacity.
        self._peak = 1
        self._history = _History()
        self._ghost_first = _Ghosts()
        self._ghost_reused = _Ghosts()
        self.k = K_START

    def __len__(self) -> int:
        return len(self._first) + len(self._reused)

    def __contains__(self, page: PolicyPage) -> bool:
        return page.location in self._first or page.location in self._reused

    def add(self, page: PolicyPage) -> None:
        fingerprint = hash(page.block_hash)
        target = self._reused if fingerprint in self._history else self._first
        self._use(page, fingerprint)
        target[page.location] = page
        known = len(self) + self._pinned
        if known > self._peak:
            self._peak = known

    def touch(self, page: PolicyPage) -> None:
        location = page.location
        if location in self._reused:
            # Already reused: its key goes into the history when it is evicted (pop_victim),
            # not at every hit, which keeps a hit to a list move on the loop.
            self._reused.move_to_end(location)
            self._now = page.stamp = next(self._clock)
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
        self._pinned += 1

    def unpin(self, page: PolicyPage) -> None:
        self._pinned -= 1
        target = self._first if page.stamp < 0 else self._reused
        self._now = page.stamp = next(self._clock)
        target[page.location] = page

    def add_oldest(self, page: PolicyPage) -> None:
        page.stamp = 0
        self._first[page.location] = page
        self._first.move_to_end(page.location, last=False)

    def remove(self, page: PolicyPage) -> None:
        if self._first.pop(page.location, None) is None:
            del self._reused[page.location]

    def pop_victim(self) -> PolicyPage:
        first, reused = self._first, self._reused
        if first and reused:
            now = self._now
            oldest_first = next(iter(first.values())).stamp
            oldest_reused = next(iter(reused.values())).stamp
            from_reused = now - oldest_reused > self.k * (now - oldest_first)
        else:
            from_reused = not first
        if from_reused:
            page = reused.popitem(last=False)[1]
            ghosts = self._ghost_reused
        else:
            page = first.popitem(last=False)[1]
            ghosts = self._ghost_first
        fingerprint = hash(page.block_hash)
        if from_reused:
            # Hits of a reused page skip the history (touch): remember its key from here, so
            # that it comes back as reused.
            self._history.add(fingerprint, HISTORY_FACTOR * self._peak)
        ghosts.add(fingerprint, max(1, self._peak // GHOST_DIVISOR))
        return page

    def missed(self, block_hash: bytes) -> None:
        fingerprint = hash(block_hash)
        if fingerprint in self._ghost_first:
            # A first-use page evicted too early ended this hit: give first-use pages room.
            self.k = max(K_MIN, self.k * (1 - K_STEP))
        elif fingerprint in self._ghost_reused:
            self.k = min(K_MAX, self.k * (1 + K_STEP))

    def pages(self) -> Iterator[PolicyPage]:
        return itertools.chain(self._first.values(), self._reused.values())

    def clear(self) -> None:
        self._first.clear()
        self._reused.clear()
        self._history.clear()
        self._ghost_first.clear()
        self._ghost_reused.clear()

    def _use(self, page: PolicyPage, fingerprint: int) -> None:
        self._now = page.stamp = next(self._clock)
        self._history.add(fingerprint, HISTORY_FACTOR * self._peak)
