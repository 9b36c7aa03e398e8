"""Per-tenant accounting of L1: a soft share, an optional hard cap, and bounded metrics.

A client names a tenant with each store and lookup (``Reserve.tenant``, ``Lookup.tenant``; the
connector passes vLLM's ``cache_salt``, else the LoRA name, else ""). A page belongs to the
tenant whose reservation wrote it; a block two tenants store is one page (equal hashes are one
key), owned by its first writer. Pages loaded from a tier below or adopted belong to "".

:class:`TenantPolicy` is a pool's eviction policy: one inner policy (the configured one) per
tenant holding pages, and the choice of which tenant gives the next victim: the tenant holding
the most pages of the pool, every page it holds counted (reserved, locked or evictable). So a
tenant at or under its soft share (the pages held over the tenants holding some) is not evicted
while another holds more than it: a tenant's burst evicts its own pages once it holds the most,
and when the largest tenant's pages are all reserved or locked, only a tenant over its share
gives pages; else the store is refused the rest (``tenant_share_refused_objects_total``). With
one tenant it is exactly its inner policy.

Tenants are anyone's choice (vLLM's ``cache_salt``), so a pool counts at most
:data:`~kvshelf.server.limits.MAX_TENANTS_PER_POOL` named ones apart, the first to hold pages;
the pages of any other count as one overflow tenant's (``tenant_folded_objects_total``) until
one of those holds nothing. The inner policies share what they learn (a key history) through
:meth:`~kvshelf.server.policy.EvictionPolicy.maker`, so a tenant costs its name and its lists
(:data:`~kvshelf.server.limits.BYTES_PER_TENANT`), and each page refers to its tenant's one
name, never to a request's copy of it.

The hard cap (``kvshelf server --tenant-quota``): a store that would take a tenant over the cap
evicts the tenant's own pages (its inner policy's victims) to make room; what its own
unpinned pages cannot make room for is refused (``None`` pages, counted in
``reserve_over_quota_objects_total``), never taken from another tenant.

Costs on the socket loop: routing a page event is a dict lookup; choosing a victim is
O(log tenants) amortized (tenants kept in heaps by pages held); a lookup's miss is one call
for all tenants.

Must not import torch or vLLM, nor the tiers (the arena imports this).
"""

from __future__ import annotations

import heapq
import itertools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from kvshelf.metric_types import Counters
from kvshelf.metrics import MAX_TENANT_LABELS
from kvshelf.protocol import MAX_NAME_CHARS
from kvshelf.server.limits import MAX_TENANTS_PER_POOL
from kvshelf.server.policy import EvictionPolicy, PolicyPage

OTHER_LABEL = "other"
# The label of the tenant "" (requests that name none, pages loaded from below).
NO_TENANT_LABEL = "none"
# The tenant the pages of tenants past a pool's first MAX_TENANTS_PER_POOL are counted as:
# longer than any name a request may carry, so no client can name it.
OVERFLOW_TENANT = "\0" * (MAX_NAME_CHARS + 1)

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


@dataclass(frozen=True)
class TenantQuota:
    """A hard cap on the L1 bytes one tenant holds in a pool: ``bytes`` or ``percent`` of the
    arena (exactly one is non-zero)."""

    bytes: int = 0
    percent: float = 0.0

    def cap_bytes(self, arena_bytes: int) -> int:
        return self.bytes or int(arena_bytes * self.percent / 100)


def parse_tenant_quota(text: str) -> TenantQuota:
    """``--tenant-quota``: bytes (``512M``, ``2GiB``, ``1073741824``) or a percentage of the
    arena (``25%``).

    Raises:
        ValueError: naming the value, when it is neither or not positive.
    """
    value = text.strip()
    if value.endswith("%"):
        try:
            percent = float(value[:-1])
        except ValueError:
            percent = -1.0
        if not 0 < percent <= 100:
            raise ValueError(f"{text!r} is not a percentage in (0, 100]")
        return TenantQuota(percent=percent)
    match = _SIZE.fullmatch(value)
    size = int(float(match[1]) * _UNITS[(match[2] or "")[:1].lower()]) if match else 0
    if size <= 0:
        raise ValueError(f"{text!r} is not a positive size (bytes, K/M/G/T[iB]) or a percentage")
    return TenantQuota(bytes=size)


class TenantLedger:
    """Every pool's bytes and every lookup's hits per tenant, for ``/metrics``.

    Kept on the socket loop; the metrics thread reads copies of the dicts. Labels are bounded:
    the first ``MAX_TENANT_LABELS`` tenants seen have their own, the rest share ``other``.
    """

    def __init__(self, max_labels: int = MAX_TENANT_LABELS) -> None:
        self._max_labels = max_labels
        self._labels: dict[str, str] = {"": NO_TENANT_LABEL, OVERFLOW_TENANT: OTHER_LABEL}
        self.bytes: dict[str, int] = {}
        self.hits: dict[str, int] = {}

    def label(self, tenant: str) -> str:
        label = self._labels.get(tenant)
        if label is None:
            # "" and the overflow have theirs already: the first max_labels named tenants.
            label = tenant if len(self._labels) - 2 < self._max_labels else OTHER_LABEL
            if label != OTHER_LABEL:
                self._labels[tenant] = label
        return label

    def add_bytes(self, tenant: str, count: int) -> None:
        label = self.label(tenant)
        self.bytes[label] = self.bytes.get(label, 0) + count

    def add_hits(self, tenant: str, count: int) -> None:
        label = self.label(tenant)
        self.hits[label] = self.hits.get(label, 0) + count

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        """Bytes and hits per label; safe to call from another thread."""
        return dict(self.bytes), dict(self.hits)


class TenantPolicy(EvictionPolicy):
    """A pool's evictable pages, one inner policy per tenant; victims from the largest tenant.

    Args:
        kind: the configured policy's class; its :meth:`~EvictionPolicy.maker` makes the
            tenants' inner policies.
        page_bytes: the pool's page size.
        cap_pages: the hard cap in pages per tenant; 0: none.
        ledger: the server's per-tenant metrics.
        counters: the server's counters (folded pages, evictions the share refused); None:
            not counted.
    """

    name = "tenants"

    __slots__ = (
        "_by_evictable",
        "_by_held",
        "_counters",
        "_evictable",
        "_make",
        "_named",
        "_names",
        "_page_bytes",
        "_policies",
        "_pool_wide",
        "_storing",
        "_taking",
        "_total",
        "cap_pages",
        "held",
        "ledger",
    )

    def __init__(
        self,
        kind: type[EvictionPolicy],
        page_bytes: int,
        cap_pages: int = 0,
        ledger: TenantLedger | None = None,
        counters: Counters | None = None,
    ) -> None:
        self._make = kind.maker()
        # Hears each lookup's miss once for every tenant: their policies share what they
        # learn (EvictionPolicy.maker).
        self._pool_wide = self._make()
        self._page_bytes = page_bytes
        self.cap_pages = cap_pages
        self.ledger = TenantLedger() if ledger is None else ledger
        self._counters = counters
        self._policies: dict[str, EvictionPolicy] = {}
        self._evictable = 0
        # Pages each tenant holds in the pool: RESERVED and COMMITTED (pinned or not); their
        # sum; how many tenants but "" and OVERFLOW_TENANT hold some.
        self.held: dict[str, int] = {}
        self._total = 0
        self._named = 0
        # Each holder's name, the one object its pages refer to: a request's name is a new
        # string each time, which a page must not keep (1,024 characters, up to 4 KiB).
        self._names: dict[str, str] = {}
        # Tenants by pages held, most first: heaps of (-held, tenant), an entry pushed at each
        # change and dropped, once stale, when it comes to the top (_top). One of every
        # holder, one of the holders with evictable pages.
        self._by_held: list[tuple[int, str]] = []
        self._by_evictable: list[tuple[int, str]] = []
        # The tenant storing now and the pages its store takes (until hold): they count as
        # its own while its store evicts, so that the store does not evict a smaller tenant
        # for pages that make the storing tenant the larger one. It also wins ties.
        self._storing = ""
        self._taking = 0

    # Accounting the tiers report beyond the policy seam.

    def hold(self, tenant: str, pages: Iterable[PolicyPage]) -> None:
        """``pages`` were taken for ``tenant`` (reserved, or filled from below for "")."""
        key = self._key(tenant)
        count = 0
        for page in pages:
            page.tenant = key  # type: ignore[attr-defined]
            count += 1
        self._taking = 0
        if count:
            self._count(key, count)
            if key == OVERFLOW_TENANT and self._counters is not None:
                self._counters.add("tenant_folded_objects_total", count)

    def release(self, pages: Iterable[PolicyPage]) -> None:
        """Reserved ``pages`` were dropped (an abort) without being committed."""
        for page in pages:
            self._count(page.tenant, -1)  # type: ignore[attr-defined]

    def quota_room(self, tenant: str, count: int) -> tuple[int, int]:
        """For a store of ``count`` new pages: how many of the tenant's own pages to evict
        first, and how many pages it may take in all (the rest are refused)."""
        key = self._storing = self._key(tenant)
        self._taking = count
        if not self.cap_pages:
            return 0, count
        room = self.cap_pages - self.held.get(key, 0)
        if count <= room:
            return 0, count
        policy = self._policies.get(key)
        own = min(count - room, len(policy) if policy is not None else 0)
        self._taking = max(0, room + own)
        return own, self._taking

    def victims_of(self, tenant: str) -> Callable[[int], list[PolicyPage]]:
        """Takes so many victims of ``tenant``'s own pages (no more than it has evictable)."""
        key = self._key(tenant)
        return lambda count: [self._pop(key) for _ in range(count)]

    def victims(self, count: int) -> list[PolicyPage]:
        """Up to ``count`` victims, each from the largest tenant (:meth:`_victim`, O(log
        tenants) amortized); fewer when the soft share refuses the rest."""
        pages: list[PolicyPage] = []
        while len(pages) < count and self._evictable:
            tenant = self._victim()
            if tenant is None:
                if self._counters is not None:
                    self._counters.add("tenant_share_refused_objects_total", count - len(pages))
                break
            pages.append(self._pop(tenant))
        return pages

    # The policy seam.

    def __len__(self) -> int:
        return self._evictable

    def __contains__(self, page: PolicyPage) -> bool:
        policy = self._policies.get(page.tenant)  # type: ignore[attr-defined]
        return policy is not None and page in policy

    def add(self, page: PolicyPage) -> None:
        policy = self._policy(page)
        policy.add(page)
        self._now_evictable(page.tenant, policy)  # type: ignore[attr-defined]

    def touch(self, page: PolicyPage) -> None:
        self._policy(page).touch(page)

    def pin(self, page: PolicyPage) -> None:
        self._policy(page).pin(page)
        self._evictable -= 1

    def unpin(self, page: PolicyPage) -> None:
        policy = self._policy(page)
        policy.unpin(page)
        self._now_evictable(page.tenant, policy)  # type: ignore[attr-defined]

    def add_oldest(self, page: PolicyPage) -> None:
        policy = self._policy(page)
        policy.add_oldest(page)
        self._now_evictable(page.tenant, policy)  # type: ignore[attr-defined]

    def remove(self, page: PolicyPage) -> None:
        self._policy(page).remove(page)
        self._evictable -= 1
        self._count(page.tenant, -1)  # type: ignore[attr-defined]

    def pop_victim(self) -> PolicyPage:
        """The next victim; only called when the soft share allows one (see :meth:`victims`,
        which the arena calls)."""
        (page,) = self.victims(1)
        return page

    def pages(self) -> Iterator[PolicyPage]:
        return itertools.chain.from_iterable(p.pages() for p in list(self._policies.values()))

    def clear(self) -> None:
        for tenant, policy in list(self._policies.items()):
            count = len(policy)
            policy.clear()
            self._evictable -= count
            self._count(tenant, -count)

    def missed(self, block_hash: bytes) -> None:
        # The lookup's tenant is not known here, and needs not be: the tenants' policies share
        # what they learn, so one call is the pool's.
        self._pool_wide.missed(block_hash)

    # Internals.

    def _key(self, tenant: str) -> str:
        """The tenant a page of ``tenant`` is counted as: itself, or once
        ``MAX_TENANTS_PER_POOL`` others hold pages of the pool, the overflow tenant."""
        name = self._names.get(tenant)
        if name is not None:
            return name
        if not tenant or self._named < MAX_TENANTS_PER_POOL:
            return tenant
        return OVERFLOW_TENANT

    def _policy(self, page: PolicyPage) -> EvictionPolicy:
        tenant: str = page.tenant  # type: ignore[attr-defined]
        policy = self._policies.get(tenant)
        if policy is None:
            policy = self._policies[tenant] = self._make()
        return policy

    def _now_evictable(self, tenant: str, policy: EvictionPolicy) -> None:
        """A page of ``tenant`` became evictable."""
        self._evictable += 1
        if len(policy) == 1:  # it had none: not among _by_evictable's live entries
            self._push(self._by_evictable, tenant)

    def _pop(self, tenant: str) -> PolicyPage:
        page = self._policies[tenant].pop_victim()
        self._evictable -= 1
        self._count(tenant, -1)
        return page

    def _victim(self) -> str | None:
        """The tenant to evict a page of: the one holding the most pages (every page it
        holds counted, the storing tenant's with the pages its store takes, and winning ties)
        among those with evictable pages, if it is the largest of all or holds more than its
        soft share (the pages held over the tenants holding some); else None. So a tenant at
        or under its share (to the page) never loses a page to a larger tenant whose own
        pages are reserved or locked."""
        storing = self._storing
        mine = self.held.get(storing, 0) + self._taking
        largest = self._top(self._by_held, evictable=False)
        most = max(mine, largest[1] if largest is not None else 0)
        candidate = self._top(self._by_evictable, evictable=True)
        if self._policies.get(storing) and (candidate is None or mine >= candidate[1]):
            candidate = storing, mine
        if candidate is None:
            return None
        tenant, pages = candidate
        if pages >= most:
            return tenant
        holders = len(self.held) + (self._taking > 0 and storing not in self.held)
        return tenant if pages * holders > self._total + self._taking else None

    def _top(self, heap: list[tuple[int, str]], evictable: bool) -> tuple[str, int] | None:
        """The tenant with the most pages in ``heap`` (popping stale entries), and its pages."""
        held, policies = self.held, self._policies
        while heap:
            negative, tenant = heap[0]
            if held.get(tenant) == -negative and (not evictable or policies.get(tenant)):
                return tenant, -negative
            heapq.heappop(heap)
        return None

    def _push(self, heap: list[tuple[int, str]], tenant: str) -> None:
        heapq.heappush(heap, (-self.held[tenant], tenant))
        if len(heap) > 2 * len(self.held) + 64:
            # Mostly stale entries: rebuilt in O(tenants), at most once per tenants + 64
            # pushes, so each push stays O(log tenants) amortized and a heap O(tenants).
            policies = self._policies
            evictable = heap is self._by_evictable
            heap[:] = [
                (-count, name)
                for name, count in self.held.items()
                if not evictable or policies.get(name)
            ]
            heapq.heapify(heap)

    def _count(self, tenant: str, count: int) -> None:
        before = self.held.get(tenant, 0)
        held = before + count
        self._total += count
        self.ledger.add_bytes(tenant, count * self._page_bytes)
        if not before:
            self._names[tenant] = tenant
            if tenant and tenant != OVERFLOW_TENANT:
                self._named += 1
        if held:
            self.held[tenant] = held
            self._push(self._by_held, tenant)
            if self._policies.get(tenant):
                self._push(self._by_evictable, tenant)
            return
        # Forget a tenant holding nothing: tenants come and go (a salt per user, say).
        del self.held[tenant]
        del self._names[tenant]
        if tenant and tenant != OVERFLOW_TENANT:
            self._named -= 1
        policy = self._policies.get(tenant)
        if policy is not None and not policy:
            del self._policies[tenant]


@dataclass(frozen=True)
class Tenants:
    """What the arena needs to give each pool its :class:`TenantPolicy`.

    Attributes:
        quota: the hard cap per tenant and pool; None: none.
        ledger: the per-tenant metrics of every pool.
    """

    quota: TenantQuota | None = None
    ledger: TenantLedger = field(default_factory=TenantLedger)

    def policy(
        self,
        kind: type[EvictionPolicy],
        page_bytes: int,
        arena_bytes: int,
        counters: Counters | None = None,
    ) -> TenantPolicy:
        cap = 0
        if self.quota is not None:
            cap = max(1, self.quota.cap_bytes(arena_bytes) // page_bytes)
        return TenantPolicy(kind, page_bytes, cap, self.ledger, counters)
