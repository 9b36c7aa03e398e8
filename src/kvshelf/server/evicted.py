"""The keys the server evicted recently, remembered in bounded memory to explain misses.

A lookup that stops short of its blocks is counted under a reason (``miss_evicted_total`` or
``miss_never_stored_total``, ...); telling "evicted" from "never stored" needs the keys that
were in the cache once. :class:`RecentlyEvicted` keeps a 64-bit fingerprint of each evicted
``(pool, block hash)`` in two generations of Python sets: when the newer one holds
``capacity`` fingerprints, the older is dropped and a new one begins.

Accuracy: it remembers at least the last ``capacity`` evictions and at most ``2 * capacity``;
a key evicted longer ago reads as never stored. A key never evicted reads as evicted only if
its fingerprint collides with a remembered one (probability about ``2 * capacity / 2**64``,
nil in practice). Memory: about 67 bytes per fingerprint (a set slot and an int; measured
with tracemalloc), so at most about 34 MiB for the default capacity of 262,144. Adding costs
one tuple hash and a set insert (about 0.6 microseconds here), on the eviction path.

Runs on the socket loop's thread only. Must not import torch or vLLM.
"""

from __future__ import annotations

# Evictions to remember at least (the working set of a few arenas of large pages).
DEFAULT_CAPACITY = 1 << 18


class RecentlyEvicted:
    """The fingerprints of the last ``capacity`` to ``2 * capacity`` evicted keys.

    Args:
        capacity: how many evictions each generation holds.
    """

    __slots__ = ("_capacity", "_current", "_previous")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        assert capacity > 0
        self._capacity = capacity
        self._current: set[int] = set()
        self._previous: set[int] = set()

    def add(self, pool: str, block_hash: bytes) -> None:
        """Remember that the key ``block_hash`` of ``pool`` was evicted (for some rank)."""
        if len(self._current) >= self._capacity:
            self._previous = self._current
            self._current = set()
        self._current.add(hash((pool, block_hash)))

    def __contains__(self, key: tuple[str, bytes]) -> bool:
        fingerprint = hash(key)
        return fingerprint in self._current or fingerprint in self._previous

    def __len__(self) -> int:
        return len(self._current) + len(self._previous)
