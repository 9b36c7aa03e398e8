"""A real server process: store/load round trips, locks, stats and the stats command."""

from __future__ import annotations

import json
import os

import pytest

from kvshelf.client import ServerError
from kvshelf.protocol import ErrorCode, PageLayout, pool_name
from testbed.server import ServerProcess, free_port, map_arena_file, run_kvshelf

PAGE = 4096


def layout(rank: int = 0, world_size: int = 1, page_bytes: int = PAGE) -> PageLayout:
    return PageLayout(
        model_fingerprint="model",
        layout_fingerprint="layout",
        page_bytes=page_bytes,
        world_size=world_size,
        rank=rank,
    )


def block_hashes(prefix: bytes, n: int) -> list[bytes]:
    return [prefix + i.to_bytes(4, "big") * 7 for i in range(n)]


def test_store_and_load_round_trip_is_bit_exact(kvshelf_server: ServerProcess) -> None:
    world_size = 2
    clients = [kvshelf_server.client() for _ in range(world_size)]
    registrations = [c.register(layout(r, world_size)) for r, c in enumerate(clients)]
    pool = registrations[0].pool
    assert pool == pool_name("model", "layout", world_size)
    assert registrations[0].shm_name.startswith(f"kvshelf-{kvshelf_server.port}-")
    assert os.stat(f"/dev/shm/{registrations[0].shm_name}").st_mode & 0o777 == 0o600
    hashes = block_hashes(b"rt", 6)
    payload = {(r, h): os.urandom(PAGE) for r in range(world_size) for h in hashes}

    arena = map_arena_file(registrations[0].shm_name)
    try:
        for rank, client in enumerate(clients):
            reservation = client.reserve(pool, rank, hashes)
            for h, page in zip(hashes, reservation.pages, strict=True):
                assert page is not None
                arena[page * PAGE : (page + 1) * PAGE] = payload[rank, h]
            client.commit(reservation.reservation_id)

        result = clients[0].lookup(pool, [*hashes, b"missing"], world_size=world_size, lock=True)
        assert result.num_hit_blocks == len(hashes) and result.lock_id > 0
        assert result.boot_id == kvshelf_server.boot_id
        for rank, client in enumerate(clients):
            for h, page in zip(hashes, result.pages[rank], strict=True):
                assert arena[page * PAGE : (page + 1) * PAGE] == payload[rank, h]
            client.release(result.lock_id, rank, copied=len(hashes))
    finally:
        arena.close()
    stats = clients[0].stats()
    assert stats["resident_objects"] == 12 and stats["loaded_objects_total"] == 12
    assert stats["lookup_hit_objects_total"] == 12 and stats["bad_requests_total"] == 0
    for client in clients:
        client.close()


def test_state_errors_are_reported_and_counted(kvshelf_server: ServerProcess) -> None:
    with kvshelf_server.client() as client:
        pool = client.register(layout()).pool
        cases = [
            (lambda: client.commit(999), ErrorCode.UNKNOWN_RESERVATION),
            (lambda: client.abort(999), ErrorCode.UNKNOWN_RESERVATION),
            (lambda: client.release(999, 0), ErrorCode.UNKNOWN_LOCK),
            (lambda: client.reserve("pool-nope", 0, [b"h"]), ErrorCode.UNKNOWN_POOL),
            (lambda: client.reserve(pool, 1, [b"h"]), ErrorCode.INVALID_ARGUMENT),
            (lambda: client.register(layout(page_bytes=2 * PAGE)), ErrorCode.LAYOUT_MISMATCH),
        ]
        for call, code in cases:
            with pytest.raises(ServerError) as info:
                call()
            assert info.value.code is code
        reservation = client.reserve(pool, 0, [b"h"])
        client.commit(reservation.reservation_id)
        with pytest.raises(ServerError):
            client.commit(reservation.reservation_id)
        stats = client.stats()
        assert stats["bad_requests_total"] == len(cases) + 1
        assert stats["resident_objects"] == 1 and stats["active_reservations"] == 0
        # An unknown pool is no hit, not an error.
        assert client.lookup("pool-nope", [b"h"], world_size=1, lock=True).num_hit_blocks == 0


REQUIRED_STATS = (
    "resident_objects",
    "resident_bytes",
    "capacity_bytes",
    "committed_objects_total",
    "lookup_requests_total",
    "lookup_hit_objects_total",
    "loaded_objects_total",
    "evicted_objects_total",
    "bad_requests_total",
)


def test_stats_command(kvshelf_server: ServerProcess) -> None:
    with kvshelf_server.client() as client:
        pool = client.register(layout()).pool
        client.commit(client.reserve(pool, 0, block_hashes(b"s", 3)).reservation_id)
        client.lookup(pool, block_hashes(b"s", 3), world_size=1, lock=False)
    port = str(kvshelf_server.port)

    as_json = run_kvshelf("stats", "--port", port, "--json")
    assert as_json.returncode == 0, as_json.stderr
    stats = json.loads(as_json.stdout)
    for field in REQUIRED_STATS:
        assert type(stats[field]) is int, field
    assert stats["resident_objects"] == 3 and stats["resident_bytes"] == 3 * PAGE
    assert stats["capacity_bytes"] == 64 * 1024 * 1024
    assert stats["committed_objects_total"] == 3 and stats["lookup_hit_objects_total"] == 3

    table = run_kvshelf("stats", "--port", port)
    assert table.returncode == 0, table.stderr
    assert "resident_objects" in table.stdout and "{" not in table.stdout


def test_stats_command_without_a_server_fails_clearly() -> None:
    result = run_kvshelf("stats", "--port", str(free_port()), "--timeout-s", "0.3", "--json")
    assert result.returncode != 0
    assert "no answer" in result.stderr and result.stdout == ""
