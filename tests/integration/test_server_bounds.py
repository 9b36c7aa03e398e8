"""The page bomb: tiny pages, huge batches, many busy pools and many locks from one client get
error replies, the server's memory stays within the bound ``kvshelf server --help`` states, and
other clients keep being served."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from kvshelf.client import KVShelfClient, ServerError
from kvshelf.protocol import MAX_HASHES_PER_REQUEST, ErrorCode, PageLayout
from kvshelf.server.config import GIB
from kvshelf.server.limits import MIN_PAGE_BYTES, IndexLimits
from kvshelf.server.policy import DEFAULT_POLICY, POLICIES
from testbed.server import ServerProcess

ARENA_GB = 0.0625
MAX_POOLS = 4
MAX_UNITS = 200_000
# The Python process, its libraries and ZeroMQ's buffers (a handful of clients here).
PROCESS_SLACK = 64 * 1024 * 1024


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    extra = ["--max-pools", str(MAX_POOLS), "--max-lease-units-per-pool", str(MAX_UNITS)]
    with ServerProcess(l1_size_gb=ARENA_GB, lease_timeout_s=60.0, extra_args=extra) as process:
        yield process


def layout(name: str, page_bytes: int = MIN_PAGE_BYTES) -> PageLayout:
    return PageLayout(
        model_fingerprint=name, layout_fingerprint="l", page_bytes=page_bytes, world_size=1, rank=0
    )


def hashes(prefix: str, count: int) -> list[bytes]:
    return [hashlib.sha256(f"{prefix}{i}".encode()).digest() for i in range(count)]


def anon_rss(pid: int) -> int:
    """The server's private resident memory (the shared arena excluded)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def rejected(call: object, code: ErrorCode) -> None:
    with pytest.raises(ServerError) as info:
        call()  # type: ignore[operator]
    assert info.value.code is code, info.value


def served(client: KVShelfClient, pool: str, key: bytes) -> None:
    """The well-behaved client stores and finds one block."""
    reservation = client.reserve(pool, 0, [key])
    client.commit(reservation.reservation_id)
    assert client.lookup(pool, [key], world_size=1, lock=False).num_hit_blocks == 1


def test_page_bomb_gets_errors_memory_stays_bounded_others_are_served(
    server: ServerProcess,
) -> None:
    good = server.client()
    good_pool = good.register(layout("good")).pool
    served(good, good_pool, b"good-0")
    start_rss = anon_rss(server.pid)
    bomb = server.client(timeout_s=10.0)

    # Tiny pages: refused, no pool made.
    rejected(lambda: bomb.register(layout("tiny", page_bytes=1)), ErrorCode.INVALID_ARGUMENT)
    rejected(lambda: bomb.register(layout("tiny", MIN_PAGE_BYTES - 1)), ErrorCode.INVALID_ARGUMENT)
    # Many pools: up to the bound (one more would retire the least recently used idle pool).
    pools = [bomb.register(layout(f"bomb{i}")).pool for i in range(MAX_POOLS - 1)]
    assert bomb.stats()["pools"] == MAX_POOLS

    # Huge batches, never committed, in every pool: refused once a pool's units are spent.
    batch = MAX_HASHES_PER_REQUEST
    for n, pool in enumerate(pools):
        taken = 0
        while taken + 1 + batch <= MAX_UNITS:
            bomb.reserve(pool, 0, hashes(f"{pool}-{taken}-", batch))
            taken += 1 + batch
        rejected(lambda p=pool: bomb.reserve(p, 0, hashes("more", batch)), ErrorCode.LIMIT_EXCEEDED)
        served(good, good_pool, b"good-%d" % (n + 1))

    # Many locks: the good pool's own committed pages locked over and over by the bomb client
    # until that pool's units run out; the good client's stores still go through (no lock).
    keys = hashes("locked", 1000)
    for start in range(0, len(keys), 100):
        reservation = good.reserve(good_pool, 0, keys[start : start + 100])
        good.commit(reservation.reservation_id)
    locks = 0
    with pytest.raises(ServerError) as info:
        while True:
            assert bomb.lookup(good_pool, keys, world_size=1, lock=True).num_hit_blocks == 1000
            locks += 1
    assert info.value.code is ErrorCode.LIMIT_EXCEEDED
    assert locks == MAX_UNITS // 1001
    assert good.ping()
    # Every pool holds leases now: none is idle, so one more pool is refused.
    rejected(lambda: bomb.register(layout("one-too-many")), ErrorCode.LIMIT_EXCEEDED)

    stats = good.stats()
    assert stats["rejected_over_limit_total"] == len(pools) + 1
    assert stats["pools"] == MAX_POOLS
    bound = IndexLimits(
        max_pools=MAX_POOLS,
        max_lease_units_per_pool=MAX_UNITS,
        policy_bytes_per_page=POLICIES[DEFAULT_POLICY].extra_bytes_per_page,
    ).index_bytes(int(ARENA_GB * GIB))
    grown = anon_rss(server.pid) - start_rss
    print(f"server anon RSS grew {grown / 2**20:.1f} MiB; bound {bound / 2**20:.1f} MiB")
    assert grown <= bound + PROCESS_SLACK, (grown, bound)
    # The bound is not vacuous: the bomb did take memory.
    assert grown > bound / 20, (grown, bound)
    good.close()
    bomb.close()
