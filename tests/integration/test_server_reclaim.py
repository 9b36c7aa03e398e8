"""A redeploy on a full arena (a real server): the new weights' pool gets pages at once, taken
from the old pool's extents."""

from __future__ import annotations

from kvshelf.protocol import PageLayout
from testbed.server import ServerProcess

PAGE = 16 * 1024
ARENA_PAGES = 4 * 4096  # four 64 MiB extents


def layout(model: str) -> PageLayout:
    return PageLayout(
        model_fingerprint=model, layout_fingerprint="l", page_bytes=PAGE, world_size=1, rank=0
    )


def keys(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}{i}".encode().ljust(32, b".") for i in range(count)]


def test_redeploy_on_a_full_arena_serves_the_new_pool_at_once() -> None:
    with (
        ServerProcess(l1_size_gb=ARENA_PAGES * PAGE / 2**30) as server,
        server.client() as client,
    ):
        old = client.register(layout("old-weights")).pool
        old_keys = keys("old", ARENA_PAGES)
        for start in range(0, ARENA_PAGES, 4096):
            reservation = client.reserve(old, 0, old_keys[start : start + 4096])
            client.commit(reservation.reservation_id)
        stats = client.stats()
        assert stats["resident_objects"] >= 0.9 * ARENA_PAGES
        assert stats["allocated_bytes"] == stats["capacity_bytes"]

        new = client.register(layout("new-weights")).pool
        new_keys = keys("new", 200)
        reservation = client.reserve(new, 0, new_keys)
        assert None not in reservation.pages
        client.commit(reservation.reservation_id)
        assert client.lookup(new, new_keys, world_size=1, lock=False).num_hit_blocks == 200
        stats = client.stats()
        assert stats["reclaimed_extents_total"] == 1
        assert stats["reserve_no_space_objects_total"] == 0
