"""A rank that gives up a block (abort, lease end) takes the other ranks' pages of it along:
no block stays committed by some ranks only, whichever rank finishes first (docs/safety.md,
"Stopping an engine"). Against a real server, one client per rank of a TP=2 pool."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvshelf.client import KVShelfClient
from kvshelf.protocol import PageLayout
from testbed.server import ServerProcess

PAGE = 64 * 1024
BLOCKS = [bytes([7, i]) * 16 for i in range(4)]


@pytest.fixture
def ranks() -> Iterator[tuple[ServerProcess, str, KVShelfClient, KVShelfClient]]:
    server = ServerProcess(lease_timeout_s=0.5)
    with server, server.client() as rank0, server.client() as rank1:
        layouts = [
            PageLayout(
                model_fingerprint="m",
                layout_fingerprint="l",
                page_bytes=PAGE,
                world_size=2,
                rank=r,
            )
            for r in (0, 1)
        ]
        pool = rank0.register(layouts[0]).pool
        rank1.register(layouts[1])
        yield server, pool, rank0, rank1


def whole_blocks(client: KVShelfClient, pool: str) -> int:
    return client.lookup(pool, BLOCKS, world_size=2, lock=False).num_hit_blocks


def test_an_abort_frees_the_pages_another_rank_committed(ranks) -> None:
    _, pool, rank0, rank1 = ranks
    rank0.commit(rank0.reserve(pool, 0, BLOCKS).reservation_id)
    rank1.abort(rank1.reserve(pool, 1, BLOCKS).reservation_id)
    stats = rank0.stats()
    assert stats["resident_objects"] == 0, "rank 0's pages of blocks rank 1 gave up stayed"
    assert stats["unwhole_dropped_objects_total"] == len(BLOCKS)
    assert whole_blocks(rank0, pool) == 0
    # The blocks can be stored again, whole.
    for rank, client in enumerate((rank0, rank1)):
        client.commit(client.reserve(pool, rank, BLOCKS).reservation_id)
    assert whole_blocks(rank0, pool) == len(BLOCKS)


def test_an_abort_before_the_other_rank_commits_frees_its_pages_at_the_commit(ranks) -> None:
    _, pool, rank0, rank1 = ranks
    reserved = rank0.reserve(pool, 0, BLOCKS)
    rank1.abort(rank1.reserve(pool, 1, BLOCKS).reservation_id)
    rank0.commit(reserved.reservation_id)
    stats = rank0.stats()
    assert stats["resident_objects"] == 0
    assert stats["active_reservations"] == 0
    assert stats["unwhole_dropped_objects_total"] == len(BLOCKS)
    assert stats["l1_reserved_bytes"] == 0


def test_an_abort_keeps_blocks_its_rank_already_holds(ranks) -> None:
    _, pool, rank0, rank1 = ranks
    for rank, client in enumerate((rank0, rank1)):
        client.commit(client.reserve(pool, rank, BLOCKS[:2]).reservation_id)
    rank0.commit(rank0.reserve(pool, 0, BLOCKS).reservation_id)
    # Rank 1's reserve skips the two blocks it holds; its abort gives up the other two only.
    rank1.abort(rank1.reserve(pool, 1, BLOCKS).reservation_id)
    stats = rank0.stats()
    assert stats["resident_objects"] == 4
    assert stats["unwhole_dropped_objects_total"] == 2
    assert whole_blocks(rank0, pool) == 2


def test_a_lapsed_reservation_frees_the_pages_another_rank_committed(ranks) -> None:
    """A rank killed before it could abort: its reservation's lease ends (0.5 s here)."""
    _, pool, rank0, rank1 = ranks
    rank1.reserve(pool, 1, BLOCKS)
    rank0.commit(rank0.reserve(pool, 0, BLOCKS).reservation_id)
    deadline = time.monotonic() + 10
    while (stats := rank0.stats())["expired_reservations_total"] == 0:
        assert time.monotonic() < deadline, "the reservation never expired"
        time.sleep(0.05)
    assert stats["resident_objects"] == 0
    assert stats["unwhole_dropped_objects_total"] == len(BLOCKS)


def test_a_sharded_pool_of_one_rank_is_untouched_by_aborts() -> None:
    with ServerProcess() as server, server.client() as client:
        pool = client.register(
            PageLayout(
                model_fingerprint="m", layout_fingerprint="l", page_bytes=PAGE, world_size=1, rank=0
            )
        ).pool
        client.commit(client.reserve(pool, 0, BLOCKS[:2]).reservation_id)
        client.abort(client.reserve(pool, 0, BLOCKS).reservation_id)
        stats = client.stats()
        assert stats["resident_objects"] == 2
        assert stats["unwhole_dropped_objects_total"] == 0
