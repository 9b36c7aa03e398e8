"""Pools have a life cycle (kvshelf.server.pool_life), against real server processes.

Every cache reset of a vLLM engine is a new identity epoch, hence a new pool. These tests
register epochs as a worker rank does (``Register.retires`` names the pool it used before,
with the holder token its client got) and check that the server never fills up with dead
epochs: a replaced epoch is retired unless another engine still holds it, its pages are freed,
a disk tier does not restore it at restart, at the limit an empty or long unused pool goes, a
pool in use or with live leases never does, and no client can retire a pool it does not hold.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from pathlib import Path

from kvshelf.client import KVShelfClient, ServerError
from kvshelf.protocol import ErrorCode, PageLayout
from kvshelf.server.limits import MIN_PAGE_BYTES
from testbed.server import ServerProcess, map_arena_file

PAGE = MIN_PAGE_BYTES
MAX_POOLS = 4
# Sweeps of retiring pools run at most once a second (pool_life.SWEEP_INTERVAL_S).
SWEEP_WAIT_S = 10.0


def server(max_pools: int = MAX_POOLS, extra: tuple[str, ...] = ()) -> ServerProcess:
    return ServerProcess(extra_args=["--max-pools", str(max_pools), *extra])


def layout(model: str) -> PageLayout:
    """A world-size-1 layout; ``model`` stands for the epoch's model identity."""
    return PageLayout(
        model_fingerprint=model, layout_fingerprint="life", page_bytes=PAGE, world_size=1, rank=0
    )


def block(tag: str, i: int) -> bytes:
    return f"{tag}-{i:06d}".encode().ljust(32, b".")


def content(block_hash: bytes) -> bytes:
    return (block_hash * (PAGE // len(block_hash) + 1))[:PAGE]


def store(client: KVShelfClient, arena: mmap.mmap, pool: str, hashes: list[bytes]) -> None:
    """Reserve, write the pages as a worker does, commit."""
    reservation = client.reserve(pool, 0, hashes)
    for block_hash, page in zip(hashes, reservation.pages, strict=True):
        assert page is not None
        arena[page * PAGE : (page + 1) * PAGE] = content(block_hash)
    client.commit(reservation.reservation_id)


def hits(client: KVShelfClient, pool: str, hashes: list[bytes]) -> int:
    while True:
        result = client.lookup(pool, hashes, world_size=1, lock=False)
        if not result.pending:
            return result.num_hit_blocks


def wait_for(condition: Callable[[], bool], timeout_s: float = SWEEP_WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_forty_epochs_in_a_row_each_store_and_hit_within_the_pool_limit() -> None:
    with server() as process, process.client() as client:
        registration = client.register(layout("weights"))
        arena = map_arena_file(registration.shm_name)
        previous = registration.pool
        capacity = client.stats()["capacity_bytes"]
        try:
            earlier = [block("e0", i) for i in range(8)]
            store(client, arena, previous, earlier)
            for epoch in range(1, 41):
                pool = client.register(layout(f"weights@{epoch}"), retires=previous).pool
                hashes = [block(f"e{epoch}", i) for i in range(8)]
                store(client, arena, pool, hashes)
                assert hits(client, pool, hashes) == 8
                assert hits(client, previous, earlier) == 0
                earlier = hashes
                stats = client.stats()
                # The replaced epoch went at once: only the current one holds pages.
                assert stats["pools"] == 1, epoch
                assert stats["resident_objects"] == 8
                assert stats["l1_free_bytes"] == capacity - 8 * PAGE
                previous = pool
            stats = client.stats()
            assert stats["pools_retired_total"] == 40
            assert stats["rejected_over_limit_total"] == 0
        finally:
            arena.close()


def test_an_epoch_another_engine_still_holds_is_not_retired() -> None:
    hashes = [block("shared", i) for i in range(4)]
    with server() as process, process.client() as a, process.client() as b:
        first = a.register(layout("weights"))
        assert b.register(layout("weights")).pool == first.pool
        arena = map_arena_file(first.shm_name)
        try:
            store(a, arena, first.pool, hashes)
            # Engine a resets its cache: its own new epoch; b still serves the first one.
            a_new = a.register(layout("weights@a1"), retires=first.pool).pool
            assert hits(b, first.pool, hashes) == 4
            assert a.stats()["pools"] == 2 and a.stats()["pools_retired_total"] == 0
            # Engine b resets too: nobody holds the first epoch any more.
            b_new = b.register(layout("weights@b1"), retires=first.pool).pool
            assert hits(b, first.pool, hashes) == 0
            stats = b.stats()
            assert stats["pools"] == 2 and stats["pools_retired_total"] == 1
            assert stats["resident_objects"] == 0
            assert {a_new, b_new} == {a.registration.pool, b.registration.pool}
        finally:
            arena.close()


def test_a_retired_pools_pages_are_freed_for_other_pools() -> None:
    with server() as process, process.client() as client:
        registration = client.register(layout("old"))
        arena = map_arena_file(registration.shm_name)
        try:
            capacity = client.stats()["capacity_bytes"]
            old = [block("old", i) for i in range(512)]
            for start in range(0, len(old), 128):
                store(client, arena, registration.pool, old[start : start + 128])
            before = client.stats()
            assert before["resident_objects"] == 512 and before["allocated_bytes"] > 0
            new_pool = client.register(layout("new"), retires=registration.pool).pool
            stats = client.stats()
            assert stats["resident_objects"] == 0 and stats["resident_bytes"] == 0
            assert stats["allocated_bytes"] == 0 and stats["l1_free_bytes"] == capacity
            # No evictions were needed: the pages were freed with the pool, not evicted.
            assert stats["evicted_objects_total"] == 0
            fresh = [block("new", i) for i in range(512)]
            for start in range(0, len(fresh), 128):
                store(client, arena, new_pool, fresh[start : start + 128])
            assert hits(client, new_pool, fresh) == 512
        finally:
            arena.close()


def test_with_a_disk_tier_a_restart_does_not_restore_retired_pools(tmp_path: Path) -> None:
    directory = tmp_path / "l2"
    disk = ("--l2-disk-path", str(directory), "--l2-disk-size-gb", "0.05")
    hashes = [block("kept", i) for i in range(4)]
    with server(max_pools=2, extra=disk) as process, process.client() as client:
        registration = client.register(layout("weights"))
        arena = map_arena_file(registration.shm_name)
        try:
            pool = registration.pool
            for epoch in range(1, 6):
                store(client, arena, pool, [block(f"e{epoch}", i) for i in range(4)])
                wait_for(lambda: client.stats()["l2_stored_objects_total"] == 4 * epoch)  # noqa: B023
                pool = client.register(layout(f"weights@{epoch}"), retires=pool).pool
            store(client, arena, pool, hashes)
            wait_for(lambda: client.stats()["l2_resident_objects"] == 4)
        finally:
            arena.close()
        kept = pool
    # Only the live epoch's folder is left (retired ones are renamed, then removed).
    wait_for(lambda: sorted(p.name for p in directory.iterdir()) == [kept])
    with server(max_pools=2, extra=disk) as process, process.client() as client:
        stats = client.stats()
        assert stats["pools"] == 1 and stats["l2_resident_objects"] == 4
        assert hits(client, kept, hashes) == 4


def test_pools_restored_from_disk_at_the_limit_make_room_for_a_new_epoch(tmp_path: Path) -> None:
    """Engines of a release without ``retires`` filled the disk tier with one pool per epoch:
    after a restart the server holds its maximum, and a new epoch still registers."""
    directory = tmp_path / "l2"
    disk = ("--l2-disk-path", str(directory), "--l2-disk-size-gb", "0.05")
    with server(max_pools=2, extra=disk) as process, process.client() as client:
        for epoch in range(2):
            registration = client.register(layout(f"weights@{epoch}"))
            arena = map_arena_file(registration.shm_name)
            store(client, arena, registration.pool, [block(f"e{epoch}", 0)])
            arena.close()
        wait_for(lambda: client.stats()["l2_resident_objects"] == 2)
    with server(max_pools=2, extra=disk) as process, process.client() as client:
        assert client.stats()["pools"] == 2
        pool = client.register(layout("weights@2")).pool
        stats = client.stats()
        assert stats["pools"] == 2 and stats["pools_retired_total"] == 1
        assert hits(client, pool, [block("e2", 0)]) == 0


def test_at_the_limit_an_empty_pool_goes_never_one_in_use() -> None:
    with server(max_pools=3) as process, process.client() as client:
        registration = client.register(layout("a"))
        arena = map_arena_file(registration.shm_name)
        try:
            pools = {"a": registration.pool}
            pools["b"] = client.register(layout("b")).pool
            pools["c"] = client.register(layout("c")).pool
            for name in ("a", "c"):  # b holds nothing
                store(client, arena, pools[name], [block(name, 0)])
            pools["d"] = client.register(layout("d")).pool
            stats = client.stats()
            assert stats["pools"] == 3 and stats["pools_retired_total"] == 1
            assert hits(client, pools["b"], [block("b", 0)]) == 0
            assert hits(client, pools["a"], [block("a", 0)]) == 1
            assert hits(client, pools["c"], [block("c", 0)]) == 1
            # A worker of the retired pool gets UNKNOWN_POOL and registers again.
            try:
                client.reserve(pools["b"], 0, [block("b", 1)])
            except ServerError as exc:
                assert exc.code is ErrorCode.UNKNOWN_POOL
            else:
                raise AssertionError("a retired pool took a reservation")
        finally:
            arena.close()


def test_a_pool_with_live_locks_or_reservations_is_never_retired() -> None:
    hashes = [block("locked", i) for i in range(4)]
    with server(max_pools=2) as process, process.client() as client:
        registration = client.register(layout("locked"))
        arena = map_arena_file(registration.shm_name)
        try:
            locked = registration.pool
            store(client, arena, locked, hashes)
            lock = client.lookup(locked, hashes, world_size=1, lock=True)
            assert lock.num_hit_blocks == 4
            reserving = client.register(layout("reserving")).pool
            reservation = client.reserve(reserving, 0, [block("r", 0)])
            # At the limit with both pools busy: refused, nothing retired.
            try:
                client.register(layout("third"))
            except ServerError as exc:
                assert exc.code is ErrorCode.LIMIT_EXCEEDED
            else:
                raise AssertionError("a busy pool was retired")
            assert client.stats()["pools_retired_total"] == 0
            client.abort(reservation.reservation_id)

            # The locked pool's epoch is replaced: it is retiring, not dropped. Its locked
            # pages keep their bytes and the lock releases as usual; new lookups miss.
            client.register(layout("locked@1"), retires=locked)
            assert hits(client, locked, hashes) == 0
            time.sleep(2.5)  # sweeps run meanwhile
            # reserving (idle and empty: a pool in use would not be) made room for locked@1.
            stats = client.stats()
            assert stats["pools"] == 2 and stats["pools_retired_total"] == 1
            assert stats["resident_objects"] == 4
            for block_hash, page in zip(hashes, lock.pages[0], strict=True):
                assert arena[page * PAGE : (page + 1) * PAGE] == content(block_hash)
            client.release(lock.lock_id, 0)
            wait_for(lambda: client.stats()["pools_retired_total"] == 2)
            stats = client.stats()
            assert stats["pools"] == 1 and stats["resident_objects"] == 0
        finally:
            arena.close()


def test_no_client_retires_a_pool_it_does_not_hold(tmp_path: Path) -> None:
    """Issue 49, defect 5 (the review's 1,000 blocks scaled to 256, 16 pools to 4): a client
    that names another engine's pool (listed by ``Stats``) in ``retires``, or registers junk
    layouts at the limit of pools, or resends a ``Register`` whose reply it lost, retires
    nothing it does not hold: the engine keeps its hits in L1 and on disk, and its reserves."""
    disk = ("--l2-disk-path", str(tmp_path / "l2"), "--l2-disk-size-gb", "0.05")
    hashes = [block("victim", i) for i in range(256)]
    with (
        server(extra=disk) as process,
        process.client() as victim,
        process.client() as attacker,
        process.client() as other,
    ):
        registration = victim.register(layout("victim"))
        pool = registration.pool
        arena = map_arena_file(registration.shm_name)
        try:
            for start in range(0, len(hashes), 64):
                store(victim, arena, pool, hashes[start : start + 64])
            wait_for(lambda: victim.stats()["l2_resident_objects"] == len(hashes))
            assert pool in attacker.server_stats().pool_objects

            attacker.register(layout("attacker"), retires=pool)
            # Junk layouts at the limit: empty pools make room for each other, the victim's
            # pool (in use) is never taken.
            refused = 0
            for i in range(4 * MAX_POOLS):
                try:
                    attacker.register(layout(f"junk-{i}"), retires=pool)
                except ServerError as exc:
                    assert exc.code is ErrorCode.LIMIT_EXCEEDED
                    refused += 1
            assert hits(victim, pool, hashes) == len(hashes)
            stats = victim.stats()
            assert stats["l2_resident_objects"] == len(hashes)
            store(victim, arena, pool, [block("victim", 1000)])

            # Two engines share the first epoch; one resets, and its Register is sent twice (a
            # client timeout): the other still holds the pool.
            other.register(layout("victim"))
            for _ in range(2):
                victim.register(layout("victim@1"), retires=pool)
            assert hits(other, pool, hashes) == len(hashes)
            # The other engine resets too: nobody holds it, it goes.
            other.register(layout("victim@2"), retires=pool)
            assert hits(other, pool, hashes) == 0
        finally:
            arena.close()
