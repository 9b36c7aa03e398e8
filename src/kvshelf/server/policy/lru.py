"""Least recently used: kvshelf's eviction order before there was a choice.

Must not import torch or vLLM.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvshelf.server.policy.base import EvictionPolicy, PolicyPage


class LruPolicy(EvictionPolicy):
    """Evict the page used least recently; a pin takes a page out, its unpin is a use."""

    name = "lru"

    __slots__ = ("_order",)

    def __init__(self) -> None:
        # Page location -> page, least recently used first.
        self._order: OrderedDict[int, PolicyPage] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, page: PolicyPage) -> bool:
        return page.location in self._order

    def add(self, page: PolicyPage) -> None:
        self._order[page.location] = page

    def touch(self, page: PolicyPage) -> None:
        self._order.move_to_end(page.location)

    def pin(self, page: PolicyPage) -> None:
        del self._order[page.location]

    def unpin(self, page: PolicyPage) -> None:
        self._order[page.location] = page

    def add_oldest(self, page: PolicyPage) -> None:
        self._order[page.location] = page
        self._order.move_to_end(page.location, last=False)

    def remove(self, page: PolicyPage) -> None:
        del self._order[page.location]

    def pop_victim(self) -> PolicyPage:
        return self._order.popitem(last=False)[1]

    def pages(self) -> Iterator[PolicyPage]:
        return iter(self._order.values())

    def clear(self) -> None:
        self._order.clear()
