"""Per-tenant accounting of L1: a soft share, an optional hard cap, and bounded metrics.

A client names a tenant with each store and lookup (``Reserve.tenant``, ``Lookup.tenant``; the
connector passes vLLM's ``cache_salt``, else the LoRA name, else ""). A page belongs to the
tenant whose reservation wrote it; a block two tenants store is one page (equal hashes are one
key), owned by its first writer. Pages loaded from a tier below or adopted belong to "".

:class:`TenantPolicy` is a pool's eviction policy: one inner policy (the configured one) per
tenant holding pages, and the choice of which tenant gives the next victim: the tenant holding
the most pages of the pool. So a tenant at or under its soft share (the pool's pages over the
tenants holding some) is not evicted while another holds more than it: a tenant's burst evicts
its own pages once it holds the most. With one tenant it is exactly its inner policy.

The hard cap (``kvshelf server --tenant-quota``): a store that would take a tenant over the cap
evicts the tenant's own pages (its inner policy's victims) to make room; what its own
unpinned pages cannot make room for is refused (``None`` pages, counted in
``reserve_over_quota_objects_total``), never taken from another tenant.

Costs on the socket loop: routing a page event is a dict lookup; choosing a victim is O(1)
with one tenant in the pool and O(tenants holding pages in the pool) otherwise.

Must not import torch or vLLM, nor the tiers (the arena imports this).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from kvshelf.metrics import MAX_TENANT_LABELS
from kvshelf.server.policy import EvictionPolicy, PolicyPage

OTHER_LABEL = "other"
# The label of the tenant "" (requests that name none, pages loaded from below).
NO_TENANT_LABEL = "none"

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
        self._labels: dict[str, str] = {"": NO_TENANT_LABEL}
        self.bytes: dict[str, int] = {}
        self.hits: dict[str, int] = {}

    def label(self, tenant: str) -> str:
        label = self._labels.get(tenant)
        if label is None:
            # "" has its label already, so the first max_labels named tenants get theirs.
            label = tenant if len(self._labels) <= self._max_labels else OTHER_LABEL
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
        make: makes a tenant's inner policy (the configured policy's class).
        page_bytes: the pool's page size.
        cap_pages: the hard cap in pages per tenant; 0: none.
        ledger: the server's per-tenant metrics.
    """

    name = "tenants"

    def __init__(
        self,
        make: Callable[[], EvictionPolicy],
        page_bytes: int,
        cap_pages: int = 0,
        ledger: TenantLedger | None = None,
    ) -> None:
        self._make = make
        self._page_bytes = page_bytes
        self.cap_pages = cap_pages
        self.ledger = TenantLedger() if ledger is None else ledger
        self._policies: dict[str, EvictionPolicy] = {}
        # Pages each tenant holds in the pool: RESERVED and COMMITTED (pinned or not).
        self.held: dict[str, int] = {}
        self._evictable = 0
        # The tenant storing now and the pages its store takes (until hold): they count as
        # its own while its store evicts, so that the store does not evict a smaller tenant
        # for pages that make the storing tenant the larger one. It also wins ties.
        self._storing = ""
        self._taking = 0

    # Accounting the tiers report beyond the policy seam.

    def hold(self, tenant: str, pages: Iterable[PolicyPage]) -> None:
        """``pages`` were taken for ``tenant`` (reserved, or filled from below for "")."""
        count = 0
        for page in pages:
            page.tenant = tenant  # type: ignore[attr-defined]
            count += 1
        self._taking = 0
        if count:
            self._count(tenant, count)

    def release(self, pages: Iterable[PolicyPage]) -> None:
        """Reserved ``pages`` were dropped (an abort) without being committed."""
        for page in pages:
            self._count(page.tenant, -1)  # type: ignore[attr-defined]

    def quota_room(self, tenant: str, count: int) -> tuple[int, int]:
        """For a store of ``count`` new pages: how many of the tenant's own pages to evict
        first, and how many pages it may take in all (the rest are refused)."""
        self._storing = tenant
        self._taking = count
        if not self.cap_pages:
            return 0, count
        room = self.cap_pages - self.held.get(tenant, 0)
        if count <= room:
            return 0, count
        policy = self._policies.get(tenant)
        own = min(count - room, len(policy) if policy is not None else 0)
        self._taking = max(0, room + own)
        return own, self._taking

    def victims_of(self, tenant: str) -> Callable[[], PolicyPage]:
        """Pops the victims of ``tenant``'s own pages (only while it has evictable ones)."""
        policy = self._policies[tenant]

        def pop() -> PolicyPage:
            self._evictable -= 1
            page = policy.pop_victim()
            self._count(tenant, -1)
            return page

        return pop

    # The policy seam.

    def __len__(self) -> int:
        return self._evictable

    def __contains__(self, page: PolicyPage) -> bool:
        policy = self._policies.get(page.tenant)  # type: ignore[attr-defined]
        return policy is not None and page in policy

    def add(self, page: PolicyPage) -> None:
        self._policy(page).add(page)
        self._evictable += 1

    def touch(self, page: PolicyPage) -> None:
        self._policy(page).touch(page)

    def pin(self, page: PolicyPage) -> None:
        self._policy(page).pin(page)
        self._evictable -= 1

    def unpin(self, page: PolicyPage) -> None:
        self._policy(page).unpin(page)
        self._evictable += 1

    def add_oldest(self, page: PolicyPage) -> None:
        self._policy(page).add_oldest(page)
        self._evictable += 1

    def remove(self, page: PolicyPage) -> None:
        self._policy(page).remove(page)
        self._evictable -= 1
        self._count(page.tenant, -1)  # type: ignore[attr-defined]

    def pop_victim(self) -> PolicyPage:
        return self.victims_of(self._largest())()

    def pages(self) -> Iterator[PolicyPage]:
        return itertools.chain.from_iterable(p.pages() for p in list(self._policies.values()))

    def clear(self) -> None:
        for tenant, policy in list(self._policies.items()):
            count = len(policy)
            policy.clear()
            self._evictable -= count
            self._count(tenant, -count)

    def missed(self, block_hash: bytes) -> None:
        # The lookup's tenant is not known here, and needs not be: the salt is in the hash, so
        # only the tenant that evicted this block remembers it.
        for policy in self._policies.values():
            policy.missed(block_hash)

    # Internals.

    def _policy(self, page: PolicyPage) -> EvictionPolicy:
        tenant: str = page.tenant  # type: ignore[attr-defined]
        policy = self._policies.get(tenant)
        if policy is None:
            policy = self._policies[tenant] = self._make()
        return policy

    def _largest(self) -> str:
        """The tenant with evictable pages holding the most pages, the storing tenant's count
        with the pages its store takes; the storing tenant among those tied."""
        policies = self._policies
        if len(policies) == 1:
            return next(iter(policies))
        held = self.held
        best, most = self._storing, -1
        if policies.get(best):
            most = held.get(best, 0) + self._taking
        for tenant, policy in policies.items():
            if policy and held.get(tenant, 0) > most:
                best, most = tenant, held[tenant]
        return best

    def _count(self, tenant: str, count: int) -> None:
        held = self.held.get(tenant, 0) + count
        self.ledger.add_bytes(tenant, count * self._page_bytes)
        if held:
            self.held[tenant] = held
            return
        # Forget a tenant holding nothing: tenants come and go (a salt per user, say).
        del self.held[tenant]
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
        self, make: Callable[[], EvictionPolicy], page_bytes: int, arena_bytes: int
    ) -> TenantPolicy:
        cap = 0
        if self.quota is not None:
            cap = max(1, self.quota.cap_bytes(arena_bytes) // page_bytes)
        return TenantPolicy(make, page_bytes, cap, self.ledger)
