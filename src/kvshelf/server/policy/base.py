"""The seam between the L1 tier and the choice of which pages to evict.

The arena tier (:mod:`kvshelf.server.tiers.arena`) owns pages and their states; a pool's
:class:`EvictionPolicy` owns only the order in which its *evictable* pages (COMMITTED, nothing
pinning them) go. The tier tells the policy what happens to a page (:meth:`~EvictionPolicy.add`,
:meth:`~EvictionPolicy.touch`, :meth:`~EvictionPolicy.pin`, :meth:`~EvictionPolicy.unpin`,
:meth:`~EvictionPolicy.remove`) and asks it for victims (:meth:`~EvictionPolicy.pop_victim`).
Every call is O(1) and runs on the socket loop.

Call order conventions the policies rely on: the pages of one chain are handed over deepest
block first (the tier reverses chain order), so that among pages of equal standing the tail of
a chain goes before its head: a block is worth nothing once a block before it is gone.

Must not import torch or vLLM, nor the tiers (the tiers import this).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from typing import ClassVar, Protocol


class PolicyPage(Protocol):
    """What a policy reads and writes on a page (:class:`kvshelf.server.pool.Page`)."""

    location: int
    block_hash: bytes
    # Free for the policy's use (its last use on the policy's clock, say); kept while pinned.
    stamp: int


class EvictionPolicy(abc.ABC):
    """The evictable pages of one pool and the order in which they are evicted."""

    # The name ``kvshelf server --eviction-policy`` takes.
    name: ClassVar[str]
    # Memory per page of the pool's peak size beyond what the index counts per page
    # (kvshelf.server.limits.BYTES_PER_PAGE covers one LRU entry): the server's stated
    # worst case adds it (IndexLimits.policy_bytes_per_page).
    extra_bytes_per_page: ClassVar[int] = 0

    # No instance dict: a pool keeps one policy per tenant (kvshelf.server.tenants).
    __slots__ = ()

    @classmethod
    def maker(cls) -> Callable[[], EvictionPolicy]:
        """What makes the policies of one pool's tenants (:mod:`kvshelf.server.tenants`).

        They may share what they learn (a key history, say), so that it is bounded by the
        pool's size and not by tenants x its size; :meth:`missed` on any one of them then
        counts for all. By default each is a policy of its own with nothing to share.
        """
        return cls

    @abc.abstractmethod
    def __len__(self) -> int:
        """The number of evictable pages."""

    def __bool__(self) -> bool:
        return len(self) > 0

    @abc.abstractmethod
    def __contains__(self, page: PolicyPage) -> bool:
        """Whether ``page`` is evictable (in the policy)."""

    @abc.abstractmethod
    def add(self, page: PolicyPage) -> None:
        """A page newly COMMITTED (stored, or loaded from a tier below) is evictable."""

    @abc.abstractmethod
    def touch(self, page: PolicyPage) -> None:
        """An evictable page was used (a lookup hit it or a store found it present)."""

    @abc.abstractmethod
    def pin(self, page: PolicyPage) -> None:
        """An evictable page is pinned (read by a client, or written behind by a tier below):
        out of eviction until :meth:`unpin`."""

    @abc.abstractmethod
    def unpin(self, page: PolicyPage) -> None:
        """A pinned page is evictable again, as if used just now (the policy may tell a pin's
        use from a hit's, which :meth:`touch` reports before a lookup pins its pages)."""

    @abc.abstractmethod
    def add_oldest(self, page: PolicyPage) -> None:
        """A page adopted from a dead server's arena is evictable, before any page used since."""

    @abc.abstractmethod
    def remove(self, page: PolicyPage) -> None:
        """An evictable page leaves without being the policy's victim (its extent is
        reclaimed); not counted as an eviction by the policy."""

    @abc.abstractmethod
    def pop_victim(self) -> PolicyPage:
        """Take the page to evict next out of the policy. Only called when it is not empty."""

    @abc.abstractmethod
    def pages(self) -> Iterator[PolicyPage]:
        """The evictable pages, in no promised order."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Forget every evictable page (``kvshelf clear``)."""

    def missed(self, block_hash: bytes) -> None:  # noqa: B027 - a hook with nothing to do
        """A lookup's prefix ended at ``block_hash``: the first block it asked for and missed.

        Only this block tells whether keeping something longer would have made the hit
        longer; blocks past it would not have been hits anyway.
        """
