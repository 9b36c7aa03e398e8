"""Per-tenant accounting (kvshelf.server.tenants): bounded metric labels, victims from the
largest tenant, the hard cap's room, the --tenant-quota parser, the connector's tenant."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from kvshelf.cli.server import build_parser
from kvshelf.metrics import MAX_TENANT_LABELS
from kvshelf.roles.scheduler_lookups import request_tenant
from kvshelf.server.policy import LruPolicy
from kvshelf.server.tenants import (
    NO_TENANT_LABEL,
    OTHER_LABEL,
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
