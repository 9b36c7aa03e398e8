"""Per-tenant accounting (kvshelf.server.tenants): bounded metric labels, victims from the
largest tenant, the hard cap's room, the --tenant-quota parser, the connector's tenant."""

from __future__ import annotations

import itertools
import re
import tracemalloc
from types import SimpleNamespace

import pytest

from kvshelf.cli.server import build_parser
from kvshelf.metric_types import Counters
from kvshelf.metrics import MAX_TENANT_LABELS, SERVER
from kvshelf.protocol import MAX_NAME_CHARS
from kvshelf.roles.scheduler_lookups import request_tenant
from kvshelf.server.limits import BYTES_PER_TENANT, MAX_TENANTS_PER_POOL
from kvshelf.server.policy import EvictionPolicy, LruPolicy, ReusePolicy
from kvshelf.server.policy.reuse import HISTORY_FACTOR
from kvshelf.server.tenants import (
    NO_TENANT_LABEL,
    OTHER_LABEL,
    OVERFLOW_TENANT,
    TenantLedger,
    TenantPolicy,
    TenantQuota,
    parse_tenant_quota,
)


class _Page:
    """What a policy reads on a page, plus the owner tenant."""

    def __init__(self, location: int) -> None:
        self.location = location
        self.block_hash = location.to_bytes(8, "big")
        self.stamp = 0
        self.tenant = ""


def test_labels_are_bounded_and_the_rest_fold_into_other() -> None:
    ledger = TenantLedger()
    for i in range(10 * MAX_TENANT_LABELS):
        ledger.add_bytes(f"salt-{i}", 100)
        ledger.add_hits(f"salt-{i}", 1)
    ledger.add_bytes("", 5)
    bytes_, hits = ledger.snapshot()
    named = {f"salt-{i}" for i in range(MAX_TENANT_LABELS)}
    assert set(bytes_) == named | {OTHER_LABEL, NO_TENANT_LABEL}
    assert set(hits) == named | {OTHER_LABEL}
    assert bytes_[OTHER_LABEL] == 9 * MAX_TENANT_LABELS * 100
    assert sum(hits.values()) == 10 * MAX_TENANT_LABELS
    # A tenant seen first after the bound stays folded, even once others left.
    assert ledger.label(f"salt-{10 * MAX_TENANT_LABELS}") == OTHER_LABEL
    assert ledger.label("salt-0") == "salt-0"


def _stored(policy: TenantPolicy, tenant: str, locations: range) -> list[_Page]:
    pages = [_Page(location) for location in locations]
    policy.quota_room(tenant, len(pages))
    policy.hold(tenant, pages)
    for page in pages:
        policy.add(page)
    return pages


def test_victims_come_from_the_tenant_holding_the_most() -> None:
    policy = TenantPolicy(LruPolicy, page_bytes=1)
    _stored(policy, "b", range(0, 4))
    _stored(policy, "a", range(4, 10))
    assert len(policy) == 10 and policy.held == {"a": 6, "b": 4}
    victims = [policy.pop_victim().tenant for _ in range(4)]  # type: ignore[attr-defined]
    # a down to b's size; then, tied, the tenant storing last (a) goes first.
    assert victims == ["a", "a", "a", "b"]
    assert policy.held == {"a": 3, "b": 3}
    # A store by b counts its pages as b's while it evicts: b's own go.
    policy.quota_room("b", 2)
    assert [policy.pop_victim().tenant for _ in range(2)] == ["b", "b"]  # type: ignore[attr-defined]


def test_a_tenant_holding_nothing_is_forgotten() -> None:
    policy = TenantPolicy(LruPolicy, page_bytes=1)
    pages = _stored(policy, "a", range(3))
    policy.pin(pages[0])
    policy.clear()
    assert policy.held == {"a": 1} and len(policy) == 0
    policy.unpin(pages[0])
    policy.remove(pages[0])
    assert policy.held == {} and list(policy.pages()) == []


def test_the_cap_makes_room_from_the_tenants_own_unpinned_pages() -> None:
    policy = TenantPolicy(LruPolicy, page_bytes=1, cap_pages=4)
    pages = _stored(policy, "a", range(4))
    assert policy.quota_room("b", 4) == (0, 4)
    assert policy.quota_room("a", 3) == (3, 3)
    policy.pin(pages[0])
    policy.pin(pages[1])
    # Two evictable pages of its own: two new pages, the rest refused.
    assert policy.quota_room("a", 3) == (2, 2)


@pytest.mark.parametrize(
    ("text", "quota"),
    [
        ("25%", TenantQuota(percent=25.0)),
        ("512M", TenantQuota(bytes=512 * 2**20)),
        ("2GiB", TenantQuota(bytes=2 * 2**30)),
        ("4096", TenantQuota(bytes=4096)),
    ],
)
def test_quota_parses_bytes_and_percentages(text: str, quota: TenantQuota) -> None:
    assert parse_tenant_quota(text) == quota


@pytest.mark.parametrize("text", ["0", "0%", "150%", "-1", "lots", "12X"])
def test_bad_quota_names_the_value(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_tenant_quota(text)


def test_the_flag_rejects_a_bad_quota_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tenant-quota", "lots"])
    assert "argument --tenant-quota: 'lots' is not a positive size" in capsys.readouterr().err
    args = build_parser().parse_args(["--tenant-quota", "10%"])
    assert args.tenant_quota == TenantQuota(percent=10.0)


def test_the_connector_names_the_salt_else_the_lora_else_none() -> None:
    lora = SimpleNamespace(lora_name="adapter-1")
    assert request_tenant(SimpleNamespace(cache_salt="s1", lora_request=lora)) == "s1"
    assert request_tenant(SimpleNamespace(cache_salt=None, lora_request=lora)) == "adapter-1"
    assert request_tenant(SimpleNamespace(cache_salt=None, lora_request=None)) == ""
    assert len(request_tenant(SimpleNamespace(cache_salt="x" * 5000, lora_request=None))) == 64


# Issue 49 (adversarial review of 2026-12-07, defects 2, 4 and 8).


def test_tenants_past_the_cap_fold_into_one_overflow_tenant() -> None:
    """Defect 2: a pool accounts at most MAX_TENANTS_PER_POOL named tenants apart (each a
    salt anyone may choose); the rest are one tenant, with one soft share."""
    counters = Counters(SERVER)
    policy = TenantPolicy(LruPolicy, page_bytes=1, counters=counters)
    extra = 1000
    for i in range(MAX_TENANTS_PER_POOL + extra):
        _stored(policy, f"salt-{i}", range(i, i + 1))
    _stored(policy, "", range(10**6, 10**6 + 3))
    assert len(policy.held) == MAX_TENANTS_PER_POOL + 2
    assert policy.held[OVERFLOW_TENANT] == extra and policy.held[""] == 3
    assert counters["tenant_folded_objects_total"] == extra
    # A tenant holding pages keeps its own count; once one holds nothing its place is free.
    _stored(policy, "salt-0", range(10**5, 10**5 + 2))
    assert policy.held["salt-0"] == 3
    for _ in range(3):
        policy.victims_of("salt-0")(1)
    _stored(policy, "newcomer", range(10**5 + 9, 10**5 + 10))
    assert policy.held["newcomer"] == 1 and "salt-0" not in policy.held
    # The overflow is the largest: its own pages go first (least recently used of them).
    assert [p.tenant for p in policy.victims(2)] == [OVERFLOW_TENANT] * 2  # type: ignore[attr-defined]


def test_choosing_victims_among_many_tenants_keeps_its_heaps_bounded() -> None:
    """Defect 2: each victim is O(log tenants): the ordered heaps hold O(tenants) entries
    whatever the churn, and the victims follow the largest tenant exactly."""
    policy = TenantPolicy(LruPolicy, page_bytes=1)
    for i in range(MAX_TENANTS_PER_POOL):
        _stored(policy, f"t{i}", range(100 * i, 100 * i + 1 + i % 7))
    for _ in range(2000):
        (page,) = policy.victims(1)
        tenant = page.tenant  # type: ignore[attr-defined]
        # The victim's tenant held the most (now at most one page fewer than any other's).
        assert policy.held.get(tenant, 0) + 1 >= max(policy.held.values(), default=0)
        _stored(policy, f"t{len(policy) % 50}", range(10**6 + len(policy), 10**6 + len(policy) + 1))
    bound = 2 * len(policy.held) + 64
    assert len(policy._by_held) <= bound and len(policy._by_evictable) <= bound


def test_the_share_counts_reserved_pages_and_refuses_rather_than_push_a_tenant_below_it() -> None:
    """Defect 4 (scaled 1,000:1): A holds 24 committed pages of a 62-page pool; B reserves and
    never commits. Once B is the largest, B's store gets no victim from A (refused, counted)."""
    counters = Counters(SERVER)
    policy = TenantPolicy(LruPolicy, page_bytes=1, counters=counters)
    _stored(policy, "A", range(24))
    reserved = [_Page(location) for location in range(100, 138)]
    policy.quota_room("B", len(reserved))
    policy.hold("B", reserved)  # 38 reserved pages: the pool is full
    policy.quota_room("B", 4)
    assert policy.victims(4) == []
    assert counters["tenant_share_refused_objects_total"] == 4
    assert policy.held == {"A": 24, "B": 38}
    # The same with B's pages committed and locked (pinned).
    for page in reserved:
        policy.add(page)
        policy.pin(page)
    policy.quota_room("B", 4)
    assert policy.victims(4) == []
    # Unlocked, B's own pages go.
    for page in reserved:
        policy.unpin(page)
    assert {p.tenant for p in policy.victims(4)} == {"B"}  # type: ignore[attr-defined]


def test_a_tenant_over_its_share_still_gives_pages_when_the_largest_has_none_evictable() -> None:
    policy = TenantPolicy(LruPolicy, page_bytes=1)
    locked = _stored(policy, "L", range(30))
    for page in locked:
        policy.pin(page)
    _stored(policy, "M", range(100, 125))
    _stored(policy, "S", range(200, 205))
    # The share is the pages held, S's 3 to come included, over the three tenants: M gives
    # while it holds more, down to 19 of 54 + 3 (each page it gives lowers the share by 1/3).
    policy.quota_room("S", 3)
    victims = policy.victims(10)
    assert {p.tenant for p in victims} == {"M"}  # type: ignore[attr-defined]
    assert policy.held["M"] == 19 and len(victims) == 6


@pytest.mark.parametrize("kind", [LruPolicy, ReusePolicy])
def test_a_tenant_costs_at_most_bytes_per_tenant(kind: type[EvictionPolicy]) -> None:
    """Defect 8: MAX_TENANTS_PER_POOL one-page tenants of the longest names (4-byte
    characters), made while measured as a request's are, against one tenant's pages: each
    costs at most BYTES_PER_TENANT more, and tenants past the cap cost nothing more."""

    def held(tenants: int, pages: int) -> int:
        made = [_Page(location) for location in range(pages)]
        tracemalloc.start()
        policy = TenantPolicy(kind, page_bytes=1)
        for i, page in enumerate(made):
            name = f"{i % tenants:08d}".ljust(MAX_NAME_CHARS, "\U0001f600") if tenants > 1 else ""
            policy.quota_room(name, 1)
            policy.hold(name, [page])
            policy.add(page)
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert policy
        return size

    pages = 4 * MAX_TENANTS_PER_POOL
    one = held(1, pages)
    per_tenant = (held(MAX_TENANTS_PER_POOL, pages) - one) / MAX_TENANTS_PER_POOL
    assert per_tenant <= BYTES_PER_TENANT, per_tenant
    folded = held(4 * MAX_TENANTS_PER_POOL, pages) - one
    assert folded <= MAX_TENANTS_PER_POOL * BYTES_PER_TENANT + 16 * pages, folded


def test_the_reuse_history_is_the_pools_not_one_per_tenant() -> None:
    """Defect 8: tenants in turn churn a pool's worth of one-off keys (each keeping a few pages,
    so none is forgotten). The key history is the pool's (at most 2 x HISTORY_FACTOR x its
    peak), not one per tenant: what reuse keeps beyond LRU stays within what it declares per
    page of the pool."""

    def held(kind: type[EvictionPolicy]) -> int:
        tenants, peak = 32, 500
        keep = peak // tenants
        made = [_Page(location) for location in range(peak + tenants * keep)]
        serial = itertools.count()
        tracemalloc.start()
        policy = TenantPolicy(kind, page_bytes=1)
        for t in range(tenants):
            # The tenant takes the pool's pages but the few each tenant before it keeps.
            pages = made[t * keep : t * keep + peak]
            for _ in range(1 + HISTORY_FACTOR):
                for page in pages:
                    if page in policy:
                        policy.remove(page)
                    page.block_hash = next(serial).to_bytes(32, "big")
                    policy.quota_room(f"t{t}", 1)
                    policy.hold(f"t{t}", [page])
                    policy.add(page)
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert len(policy.held) == tenants
        return size

    extra = held(ReusePolicy) - held(LruPolicy)
    pages = 500 + 32 * (500 // 32)
    assert extra <= ReusePolicy.extra_bytes_per_page * pages, extra / pages
