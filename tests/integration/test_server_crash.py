"""Crash recovery with real server processes: a server killed with SIGKILL leaves its arena,
the next server on its port adopts it (docs/crash-recovery.md), and ``kvshelf gc`` removes
the arenas of dead servers only.

Every test removes only arenas of its own ports: other tests' servers share /dev/shm.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

from kvshelf.client import KVShelfClient
from kvshelf.platform.ownership import Owner, scan
from kvshelf.platform.shm import ARENA_PREFIX, SHM_DIR, shm_path
from kvshelf.protocol import MAX_HASH_BYTES, PageLayout, pool_name
from kvshelf.server.page_table import (
    POOL_RECORD_BYTES,
    RECORD_BYTES,
    carries_header,
    decode_header,
    read_tail,
)
from testbed.server import ServerProcess, free_port, map_arena_file, run_kvshelf

PAGE = 64 * 1024
NUM_PAGES = 16
WORLD_SIZE = 2
LEASE_S = 2.0
LAYOUT = PageLayout(
    model_fingerprint="m",
    layout_fingerprint="crash",
    page_bytes=PAGE,
    world_size=WORLD_SIZE,
    rank=0,
)
POOL = pool_name("m", "crash", WORLD_SIZE)


def key(i: int) -> bytes:
    return f"crash-{i:08d}".encode() * 2


def page_bytes(block_hash: bytes, rank: int) -> bytes:
    unit = block_hash + bytes([rank])
    return (unit * (PAGE // len(unit) + 1))[:PAGE]


def arenas(port: int) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"{ARENA_PREFIX}{port}-"))


def server(port: int | None = None, *args: str, size_pages: int = NUM_PAGES) -> ServerProcess:
    return ServerProcess(
        l1_size_gb=size_pages * PAGE / 2**30,
        lease_timeout_s=LEASE_S,
        port=port,
        extra_args=args,
    )


@contextlib.contextmanager
def cleanup(port: int) -> Iterator[None]:
    """Remove whatever arena of ``port`` a test leaves behind (its own port only)."""
    try:
        yield
    finally:
        for name in arenas(port):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shm_path(name))


def store(client: KVShelfClient, hashes: list[bytes]) -> None:
    """Store ``hashes`` for every rank as workers do: reserve, write the pages, commit."""
    registration = client.register(LAYOUT)
    arena = map_arena_file(registration.shm_name)
    try:
        for rank in range(WORLD_SIZE):
            reservation = client.reserve(registration.pool, rank, hashes)
            for block_hash, page in zip(hashes, reservation.pages, strict=True):
                assert page is not None
                arena[page * PAGE : (page + 1) * PAGE] = page_bytes(block_hash, rank)
            client.commit(reservation.reservation_id)
    finally:
        arena.close()


def read_back(client: KVShelfClient, hashes: list[bytes]) -> None:
    """Lock ``hashes`` and check every rank's page holds exactly what was stored."""
    registration = client.register(LAYOUT)
    while True:  # asked again while a disk tier's fetch is "pending"
        result = client.lookup(registration.pool, hashes, world_size=WORLD_SIZE, lock=True)
        if not result.pending:
            break
    assert result.num_hit_blocks == len(hashes)
    arena = map_arena_file(registration.shm_name)
    try:
        for rank, pages in enumerate(result.pages):
            for block_hash, page in zip(hashes, pages, strict=True):
                assert arena[page * PAGE : (page + 1) * PAGE] == page_bytes(block_hash, rank)
            client.release(result.lock_id, rank)
    finally:
        arena.close()


def assert_byte_sum(stats: dict[str, int]) -> None:
    parts = ("l1_free_bytes", "l1_reserved_bytes", "l1_quarantined_bytes", "l1_gap_bytes")
    assert sum(stats[p] for p in parts) + stats["resident_bytes"] == stats["capacity_bytes"]


def test_killed_server_arena_is_adopted_with_identical_bytes() -> None:
    hashes = [key(i) for i in range(6)]
    first = server()
    with cleanup(first.port):
        with first, first.client() as client:
            store(client, hashes)
            old_arena = first.shm_path
            first.send_signal(signal.SIGKILL)
        assert os.path.exists(old_arena), "a killed server cannot remove its arena"
        with server(first.port) as second, second.client() as client:
            stats = client.stats()
            assert stats["resident_objects"] == len(hashes) * WORLD_SIZE
            assert stats["adopted_objects_total"] == len(hashes) * WORLD_SIZE
            assert stats["committed_objects_total"] == 0 and stats["reserved_objects_total"] == 0
            assert client.register(LAYOUT).shm_name == os.path.basename(second.shm_path)
            assert not os.path.exists(old_arena)  # renamed to the new server's name
            read_back(client, hashes)
            assert_byte_sum(client.stats())
            assert f"adopted {len(hashes) * WORLD_SIZE} objects of 1 pools" in second.log()
            assert second.terminate() == 0
        assert arenas(first.port) == []


# Registers, reserves 2 keys for rank 0, writes half of the first page, reports, then waits
# for the server to be killed: the reservation is never committed.
HALF_WRITER = textwrap.dedent(
    """
    import sys, time
    from kvshelf.client import KVShelfClient
    from kvshelf.protocol import PageLayout
    from testbed.server import map_arena_file

    client = KVShelfClient("127.0.0.1", int(sys.argv[1]))
    layout = PageLayout(model_fingerprint="m", layout_fingerprint="crash", page_bytes={page},
                        world_size={world_size}, rank=0)
    registration = client.register(layout)
    reservation = client.reserve(registration.pool, 0, [b"half-0" * 4, b"half-1" * 4])
    arena = map_arena_file(registration.shm_name)
    page = reservation.pages[0]
    arena[page * {page} : page * {page} + {page} // 2] = b"x" * ({page} // 2)
    print("reserved", flush=True)
    time.sleep(600)
    """
).format(page=PAGE, world_size=WORLD_SIZE)


def test_crash_mid_store_adopts_no_half_written_page() -> None:
    stored = [key(i) for i in range(3)]
    first = server()
    with cleanup(first.port):
        with first, first.client() as client:
            store(client, stored)
            writer = subprocess.Popen(
                [sys.executable, "-c", HALF_WRITER, str(first.port)],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert writer.stdout is not None
                assert writer.stdout.readline().strip() == "reserved"
                first.send_signal(signal.SIGKILL)
            finally:
                writer.kill()
                writer.wait()
        with server(first.port) as second, second.client() as client:
            started = time.monotonic()
            pool = client.register(LAYOUT).pool
            half = [b"half-0" * 4, b"half-1" * 4]
            assert client.lookup(pool, half, world_size=WORLD_SIZE, lock=False).num_hit_blocks == 0
            stats = client.stats()
            assert stats["resident_objects"] == len(stored) * WORLD_SIZE
            # The 2 reserved pages are out of use, the 6 adopted ones kept from eviction.
            assert stats["l1_quarantined_bytes"] == 2 * PAGE
            assert stats["quarantined_pages"] == 2 + len(stored) * WORLD_SIZE
            assert_byte_sum(stats)
            fresh = [key(100 + i) for i in range(NUM_PAGES)]
            early = client.reserve(pool, 1, fresh)
            assert sum(p is not None for p in early.pages) == NUM_PAGES - 2 - 6
            client.abort(early.reservation_id)
            while client.stats()["quarantined_pages"]:
                assert time.monotonic() < started + LEASE_S + 5, "the quarantine never ended"
                time.sleep(0.1)
            stats = client.stats()
            assert stats["l1_quarantined_bytes"] == 0 and stats["l1_reserved_bytes"] == 0
            assert_byte_sum(stats)
            # Every page is usable again: the half-written ones and the adopted ones (evicted).
            late = client.reserve(pool, 1, fresh)
            assert None not in late.pages
            assert stats["adopted_objects_total"] == len(stored) * WORLD_SIZE


def kill_holding(hashes: list[bytes], *args: str, size_pages: int = NUM_PAGES) -> int:
    """A server on a new port that stored ``hashes`` and was then killed; its port."""
    first = server(None, *args, size_pages=size_pages)
    with first, first.client() as client:
        store(client, hashes)
        first.send_signal(signal.SIGKILL)
    return first.port


def test_no_adopt_removes_the_dead_arena_and_starts_empty() -> None:
    port = kill_holding([key(1)])
    with cleanup(port):
        (dead,) = arenas(port)
        with server(port, "--no-adopt") as second, second.client() as client:
            assert client.stats()["resident_objects"] == 0
            assert arenas(port) == [os.path.basename(second.shm_path)]
            assert f"removed the dead server's arena {shm_path(dead)} (--no-adopt)" in second.log()


def test_keep_arena_on_exit_then_adopted() -> None:
    hashes = [key(i) for i in range(4)]
    first = server(None, "--keep-arena-on-exit")
    with cleanup(first.port):
        with first, first.client() as client:
            store(client, hashes)
            assert first.terminate() == 0
        assert arenas(first.port) == [os.path.basename(first.shm_path)]
        assert "kept the arena" in first.log()
        with server(first.port) as second, second.client() as client:
            assert client.stats()["adopted_objects_total"] == len(hashes) * WORLD_SIZE
            read_back(client, hashes)
            assert second.terminate() == 0
        assert arenas(first.port) == []


def test_arena_of_another_size_is_removed() -> None:
    port = kill_holding([key(1)])
    with cleanup(port):
        (dead,) = arenas(port)
        with server(port, size_pages=2 * NUM_PAGES) as second, second.client() as client:
            assert client.stats()["resident_objects"] == 0
            assert arenas(port) == [os.path.basename(second.shm_path)]
            log = second.log()
            assert f"removed the dead server's arena {shm_path(dead)}: cannot adopt it" in log
            assert "--l1-size-gb asks for" in log


def test_corrupt_table_is_removed() -> None:
    port = kill_holding([key(1)])
    with cleanup(port):
        (dead,) = arenas(port)
        fd = os.open(shm_path(dead), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            geometry = decode_header(read_tail(fd, size), size)
            # The first byte of the key (block hash) of slot 0: the first page, committed.
            records_at = geometry.capacity + geometry.pool_slots * POOL_RECORD_BYTES
            hash_at = records_at + RECORD_BYTES - MAX_HASH_BYTES
            os.pwrite(fd, b"\xff", hash_at)
        finally:
            os.close(fd)
        with server(port) as second, second.client() as client:
            assert client.stats()["resident_objects"] == 0
            log = second.log()
            assert f"removed the dead server's arena {shm_path(dead)}: cannot adopt it" in log
            assert "fails its checksum" in log
            assert arenas(port) == [os.path.basename(second.shm_path)]


def test_arena_without_header_is_left_alone_and_reported() -> None:
    port = free_port()
    old = shm_path(f"{ARENA_PREFIX}{port}-old")
    with cleanup(port):
        with open(old, "wb") as f:
            f.truncate(1 << 20)  # an older kvshelf's arena: pages only, no header, no lock
        with server(port) as second:
            assert os.path.exists(old)
            assert "whose owner cannot be proven gone" in second.log()
            assert os.path.basename(old) in second.log()
        gc = run_kvshelf("gc", "--port", str(port))
        assert gc.returncode == 0 and os.path.exists(old)
        assert "no kvshelf ownership header" in gc.stderr


def test_gc_removes_only_dead_arenas() -> None:
    dead_port = kill_holding([key(1)])
    with cleanup(dead_port), server() as live, cleanup(live.port), live.client() as client:
        store(client, [key(2)])
        (dead,) = arenas(dead_port)
        size = os.stat(shm_path(dead)).st_size
        dry = run_kvshelf("gc", "--dry-run", "--port", str(dead_port))
        assert dry.returncode == 0 and f"would remove {shm_path(dead)}" in dry.stdout
        assert arenas(dead_port) == [dead]
        assert [f.owner for f in scan(carries_header, port=live.port)] == [Owner.LIVE]
        for port in (live.port, dead_port):
            result = run_kvshelf("gc", "--port", str(port))
            assert result.returncode == 0, result.stderr
        assert f"removed {shm_path(dead)} ({size:,} bytes)" in result.stdout
        assert arenas(dead_port) == []
        assert arenas(live.port) == [os.path.basename(live.shm_path)]
        read_back(client, [key(2)])


def test_gc_help_and_bad_flag() -> None:
    assert run_kvshelf("gc", "--help").returncode == 0
    bad = run_kvshelf("gc", "--bogus")
    assert bad.returncode == 2 and "--bogus" in bad.stderr


def test_clean_stop_still_removes_the_arena() -> None:
    with server() as live:
        path = live.shm_path
        assert live.terminate() == 0
    assert not os.path.exists(path)


# A client that dies mid-load and mid-store: stores 4 keys for both ranks, locks them, reserves
# 6 more for rank 0, writes half of one page, reports, then waits for its SIGKILL.
HOLDER = textwrap.dedent(
    """
    import sys, time
    from kvshelf.client import KVShelfClient
    from kvshelf.protocol import PageLayout
    from testbed.server import map_arena_file

    client = KVShelfClient("127.0.0.1", int(sys.argv[1]))
    layout = PageLayout(model_fingerprint="m", layout_fingerprint="crash", page_bytes={page},
                        world_size={world_size}, rank=0)
    registration = client.register(layout)
    pool = registration.pool
    stored = [b"held-%d" % i * 4 for i in range(4)]
    for rank in range({world_size}):
        client.commit(client.reserve(pool, rank, stored).reservation_id)
    lock = client.lookup(pool, stored, world_size={world_size}, lock=True)
    held = client.reserve(pool, 0, [b"open-%d" % i * 4 for i in range(6)])
    arena = map_arena_file(registration.shm_name)
    page = held.pages[0]
    arena[page * {page} : page * {page} + {page} // 2] = b"x" * ({page} // 2)
    print(lock.num_hit_blocks, sum(p is not None for p in held.pages), flush=True)
    time.sleep(600)
    """
).format(page=PAGE, world_size=WORLD_SIZE)


def test_killed_client_mid_store_and_mid_load_leaks_no_byte() -> None:
    size_pages = 32
    with server(size_pages=size_pages) as live, live.client(timeout_s=1.0) as other:
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(live.port)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().split() == ["4", "6"]
        finally:
            holder.kill()
            holder.wait()
        killed_at = time.monotonic()
        stats = other.stats()
        assert stats["locked_objects"] == 4 * WORLD_SIZE and stats["reserved_objects"] == 6
        assert stats["l1_reserved_bytes"] == 6 * PAGE
        assert_byte_sum(stats)
        # Meanwhile another client stores and loads as usual (each call answered within its
        # 1 s timeout, else ServerUnavailable).
        mine = [key(500 + i) for i in range(3)]
        store(other, mine)
        read_back(other, mine)
        while other.stats()["active_reservations"] or other.stats()["active_locks"]:
            assert time.monotonic() < killed_at + LEASE_S + 5, "a dead client's lease never ended"
            time.sleep(0.1)
        stats = other.stats()
        assert stats["locked_objects"] == 0 and stats["reserved_objects"] == 0
        assert stats["l1_reserved_bytes"] == 0 and stats["l1_quarantined_bytes"] == 0
        assert stats["resident_bytes"] == (4 + 3) * WORLD_SIZE * PAGE
        assert stats["l1_free_bytes"] + stats["l1_gap_bytes"] == (size_pages - 14) * PAGE
        assert_byte_sum(stats)


def stored_on_disk(client: KVShelfClient, hashes: list[bytes]) -> None:
    """Store ``hashes`` two at a time, each pair written to disk before the next (the disk
    tier's write queue holds a quarter of these tiny arenas)."""
    for start in range(0, len(hashes), 2):
        store(client, hashes[start : start + 2])
        deadline = time.monotonic() + 20
        while True:
            stats = client.stats()
            if stats["l2_stored_objects_total"] == stats["committed_objects_total"]:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.02)


def test_adopted_pages_and_the_disk_tier_keep_one_entry_per_key(tmp_path: Path) -> None:
    hashes = [key(i) for i in range(4)]
    disk = ("--l2-disk-path", str(tmp_path / "l2"), "--l2-disk-size-gb", "0.01")
    first = server(None, *disk, size_pages=32)
    with cleanup(first.port):
        with first, first.client() as client:
            stored_on_disk(client, hashes)
            first.send_signal(signal.SIGKILL)
        with server(first.port, *disk, size_pages=32) as second, second.client() as client:
            stats = client.stats()
            # Both hold every key; the index keeps the L1 page, the disk tier its object.
            assert stats["adopted_objects_total"] == stats["resident_objects"] == 8
            assert stats["l2_resident_objects"] == 8
            read_back(client, hashes)
            assert client.stats()["l2_hit_objects_total"] == 0  # served from L1
            deadline = time.monotonic() + LEASE_S + 5
            while client.stats()["quarantined_pages"]:
                assert time.monotonic() < deadline, "the quarantine never ended"
                time.sleep(0.1)
            # New keys fill L1: the adopted pages are evicted and their keys fall back to the
            # disk tier's entries, from which they are read back, bytes unchanged.
            stored_on_disk(client, [key(100 + i) for i in range(16)])
            assert client.stats()["evicted_objects_total"] >= 8
            read_back(client, hashes)
            stats = client.stats()
            assert stats["l2_hit_objects_total"] >= 8 and stats["l2_corrupt_objects_total"] == 0
            assert_byte_sum(stats)


def test_a_server_that_cannot_bind_leaves_an_adopted_arena_for_the_next() -> None:
    port = kill_holding([key(1)])
    with cleanup(port):
        with socket.socket() as taken:
            # The killed server's connections may linger in TIME_WAIT on the port.
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            taken.bind(("127.0.0.1", port))
            taken.listen()
            blocked = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "kvshelf.server",
                    "--port",
                    str(port),
                    "--l1-size-gb",
                    repr(NUM_PAGES * PAGE / 2**30),
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        assert blocked.returncode == 1 and "cannot bind" in blocked.stderr
        assert "adopted 2 objects" in blocked.stderr
        with server(port) as second, second.client() as client:
            assert client.stats()["adopted_objects_total"] == 2
