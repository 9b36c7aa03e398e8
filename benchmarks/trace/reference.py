"""Offline reference policies for the simulator, over block ids: S3-FIFO, ARC and Belady.

Textbook versions (S3-FIFO: Yang et al., SOSP'23; ARC: Megiddo and Modha, FAST'03; Belady:
evict the block used again farthest in the future), driven like the server's policies: a
request's hits, then its missing blocks stored, each chain deepest block first.

Must not import torch or vLLM.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from benchmarks.trace.traces import Demand

NEVER = 1 << 62


class ReferencePolicy:
    """A cache of block ids: :meth:`contains`, then :meth:`access` with the request's hits."""

    def contains(self, block: int) -> bool:
        raise NotImplementedError

    def access(self, blocks: Sequence[int], hits: int) -> None:
        """The request used ``blocks`` (its demand); the first ``hits`` were resident."""
        raise NotImplementedError


class S3Fifo(ReferencePolicy):
    """A small FIFO (10 %) for new blocks, a main FIFO with reinsertion, a ghost FIFO."""

    def __init__(self, capacity: int, small: float = 0.1) -> None:
        self.capacity = capacity
        self.small_capacity = max(1, int(capacity * small))
        self.small: OrderedDict[int, None] = OrderedDict()
        self.main: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}

    def contains(self, block: int) -> bool:
        return block in self.freq

    def access(self, blocks: Sequence[int], hits: int) -> None:
        for block in reversed(blocks):
            if block in self.freq:
                self.freq[block] = min(3, self.freq[block] + 1)
                continue
            while len(self.small) + len(self.main) >= self.capacity:
                self._evict()
            if block in self.ghost:
                del self.ghost[block]
                self.main[block] = None
            else:
                self.small[block] = None
            self.freq[block] = 0

    def _evict(self) -> None:
        if len(self.small) >= self.small_capacity or not self.main:
            while self.small:
                block = self.small.popitem(last=False)[0]
                if self.freq[block] > 0:
                    self.freq[block] = 0
                    self.main[block] = None
                    if len(self.small) + len(self.main) < self.capacity:
                        return
                    continue
                del self.freq[block]
                self.ghost[block] = None
                if len(self.ghost) > self.capacity:
                    self.ghost.popitem(last=False)
                return
        while self.main:
            block = self.main.popitem(last=False)[0]
            if self.freq[block] > 0:
                self.freq[block] -= 1
                self.main[block] = None
            else:
                del self.freq[block]
                return


class Arc(ReferencePolicy):
    """Adaptive replacement cache: T1/T2 with ghosts B1/B2 and the adaptive target p."""

    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.p = 0
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def contains(self, block: int) -> bool:
        return block in self.t1 or block in self.t2

    def _replace(self, in_b2: bool) -> None:
        if self.t1 and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)):
            self.b1[self.t1.popitem(last=False)[0]] = None
        elif self.t2:
            self.b2[self.t2.popitem(last=False)[0]] = None
        else:
            self.b1[self.t1.popitem(last=False)[0]] = None

    def access(self, blocks: Sequence[int], hits: int) -> None:
        c, t1, t2, b1, b2 = self.c, self.t1, self.t2, self.b1, self.b2
        for x in reversed(blocks):
            if x in t1:
                del t1[x]
                t2[x] = None
            elif x in t2:
                t2.move_to_end(x)
            elif x in b1:
                self.p = min(c, self.p + max(len(b2) // max(1, len(b1)), 1))
                self._replace(False)
                del b1[x]
                t2[x] = None
            elif x in b2:
                self.p = max(0, self.p - max(len(b1) // max(1, len(b2)), 1))
                self._replace(True)
                del b2[x]
                t2[x] = None
            else:
                l1 = len(t1) + len(b1)
                if l1 == c:
                    if len(t1) < c:
                        b1.popitem(last=False)
                        self._replace(False)
                    else:
                        t1.popitem(last=False)
                elif l1 < c and l1 + len(t2) + len(b2) >= c:
                    if l1 + len(t2) + len(b2) == 2 * c:
                        b2.popitem(last=False)
                    self._replace(False)
                t1[x] = None


class Belady(ReferencePolicy):
    """Evict the block whose next request is farthest away (deepest first among equals)."""

    def __init__(self, capacity: int, stream: Sequence[Demand]) -> None:
        self.capacity = capacity
        upcoming: dict[int, int] = {}
        self.next_use: list[list[int]] = [[] for _ in stream]
        for i in range(len(stream) - 1, -1, -1):
            blocks = stream[i].blocks
            self.next_use[i] = [upcoming.get(b, NEVER) for b in blocks]
            for block in blocks:
                upcoming[block] = i
        self.request = 0
        self.resident: dict[int, tuple[int, int]] = {}
        self.heap: list[tuple[int, int, int]] = []

    def contains(self, block: int) -> bool:
        return block in self.resident

    def access(self, blocks: Sequence[int], hits: int) -> None:
        next_use = self.next_use[self.request]
        self.request += 1
        for depth, block in enumerate(blocks):
            self.resident[block] = (next_use[depth], depth)
            heapq.heappush(self.heap, (-next_use[depth], -depth, block))
        while len(self.resident) > self.capacity:
            use, depth, block = heapq.heappop(self.heap)
            if self.resident.get(block) == (-use, -depth):
                del self.resident[block]
