"""Per-tenant shares and the hard cap (``--tenant-quota``) against a real server, seen through
lookups and ``/metrics``."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tests.integration.test_server_metrics import scrape

from kvshelf.client import KVShelfClient
from kvshelf.protocol import PageLayout
from kvshelf.roles.scheduler import SchedulerConnector
from testbed.server import ServerProcess, free_port

PAGE = 16 * 1024
NUM_PAGES = 64
# Two tenants in a pool of 64 pages: a soft share of 32 each.
SHARE = NUM_PAGES // 2
LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="tenants", page_bytes=PAGE, world_size=1, rank=0
)


def keys(tag: bytes, n: int, start: int = 0) -> list[bytes]:
    return [tag + i.to_bytes(4, "big") * 4 for i in range(start, start + n)]


def store(client: KVShelfClient, pool: str, hashes: list[bytes], tenant: str) -> int:
    """Reserve and commit ``hashes`` for ``tenant``; how many got a page."""
    reservation = client.reserve(pool, 0, hashes, tenant=tenant)
    client.commit(reservation.reservation_id)
    return sum(page is not None for page in reservation.pages)


def server(*extra_args: str) -> tuple[ServerProcess, int]:
    port = free_port()
    process = ServerProcess(
        l1_size_gb=NUM_PAGES * PAGE / 2**30,
        eviction_watermark=1.0,
        extra_args=["--metrics-port", str(port), *extra_args],
    )
    return process, port


def test_a_burst_of_ten_shares_cannot_push_another_tenant_below_its_share() -> None:
    process, port = server()
    with process, process.client() as client:
        pool = client.register(LAYOUT).pool
        kept = keys(b"B", SHARE)
        assert store(client, pool, kept, "tenant-b") == SHARE
        for batch in range(10 * SHARE // 8):
            assert store(client, pool, keys(b"A", 8, start=8 * batch), "tenant-a") == 8
        # A filled the rest of the pool and then evicted only its own pages.
        hit = client.lookup(pool, kept, world_size=1, lock=False, tenant="tenant-b")
        assert hit.num_hit_blocks == SHARE
        assert client.stats()["evicted_objects_total"] == 10 * SHARE - SHARE
        # A's newest blocks are there: it keeps the other half of the pool.
        newest = keys(b"A", SHARE, start=9 * SHARE)
        assert client.lookup(pool, newest, world_size=1, lock=False).num_hit_blocks == SHARE

        metrics = scrape(port)
        assert metrics["kvshelf_tenant_bytes{tenant=tenant-b}"] == SHARE * PAGE
        assert metrics["kvshelf_tenant_bytes{tenant=tenant-a}"] == SHARE * PAGE
        assert metrics["kvshelf_tenant_hit_objects_total{tenant=tenant-b}"] == SHARE
        # The lookup that named no tenant counts under "none".
        assert metrics["kvshelf_tenant_hit_objects_total{tenant=none}"] == SHARE


def test_without_tenants_the_same_burst_evicts_everything_else() -> None:
    """The control: what the first test's tenants prevent."""
    process, _ = server()
    with process, process.client() as client:
        pool = client.register(LAYOUT).pool
        kept = keys(b"B", SHARE)
        store(client, pool, kept, "")
        for batch in range(10 * SHARE // 8):
            store(client, pool, keys(b"A", 8, start=8 * batch), "")
        assert client.lookup(pool, kept, world_size=1, lock=False).num_hit_blocks == 0


def test_a_tenant_at_its_hard_cap_evicts_its_own_pages_and_never_exceeds_it() -> None:
    cap = NUM_PAGES // 4  # --tenant-quota 25% of the arena
    process, port = server("--tenant-quota", "25%")
    with process, process.client() as client:
        pool = client.register(LAYOUT).pool
        kept = keys(b"B", cap)
        assert store(client, pool, kept, "tenant-b") == cap
        for batch in range(10 * SHARE // 8):
            assert store(client, pool, keys(b"A", 8, start=8 * batch), "tenant-a") == 8
            held = scrape(port)["kvshelf_tenant_bytes{tenant=tenant-a}"]
            assert held <= cap * PAGE, f"tenant-a holds {held:.0f} bytes after batch {batch}"
        assert held == cap * PAGE
        # Half the arena is still free: A made room from its own pages only.
        assert client.stats()["evicted_objects_total"] == 10 * SHARE - cap
        assert client.lookup(pool, kept, world_size=1, lock=False).num_hit_blocks == cap

        # More new blocks than the cap in one store: the cap's worth are placed, the rest
        # refused (none of them could be made room for by the tenant's own pages).
        wide = client.reserve(pool, 0, keys(b"W", cap + 4), tenant="tenant-a")
        assert sum(page is not None for page in wide.pages) == cap
        assert wide.pages[cap:] == [None] * 4
        client.abort(wide.reservation_id)
        stats = client.stats()
        assert stats["reserve_over_quota_objects_total"] == 4
        metrics = scrape(port)
        assert metrics["kvshelf_tenant_bytes{tenant=tenant-b}"] == cap * PAGE
        # The abort gave the pages back; A's committed pages went to make room for them.
        assert metrics["kvshelf_tenant_bytes{tenant=tenant-a}"] == 0


def test_the_connectors_lookups_name_the_requests_salt_else_its_lora() -> None:
    process, port = server()
    with process, process.client() as client:
        pool = client.register(LAYOUT).pool
        salted, adapted = keys(b"S", 3), keys(b"L", 2)
        store(client, pool, salted, "user-7")
        store(client, pool, adapted, "adapter-1")
        scheduler = SchedulerConnector(
            client, pool, block_size=4, world_size=1, get_block_ids=lambda _: []
        )
        lora = SimpleNamespace(lora_name="adapter-1")
        for request in (
            SimpleNamespace(request_id="r1", block_hashes=salted, cache_salt="user-7"),
            SimpleNamespace(request_id="r2", block_hashes=adapted, lora_request=lora),
        ):
            request.num_tokens = len(request.block_hashes) * 4 + 1
            request.num_computed_tokens = 0
            deadline = time.monotonic() + 5.0
            while scheduler.lookup(request, 0) is None:
                assert time.monotonic() < deadline, "the lookup was never answered"
                time.sleep(0.001)
        metrics = scrape(port)
        assert metrics["kvshelf_tenant_hit_objects_total{tenant=user-7}"] == 3
        assert metrics["kvshelf_tenant_hit_objects_total{tenant=adapter-1}"] == 2
