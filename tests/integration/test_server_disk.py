"""The disk tier (L2) behind real server processes: restart, integrity, budget, faults, crashes.

Clients write pages into the arena as workers do; lookups then must return exactly those bytes,
whether they come from L1 or are read back from disk.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvshelf.cli.server import main as server_main
from kvshelf.client import KVShelfClient, LookupResult
from kvshelf.protocol import PageLayout, pool_name
from kvshelf.server.tiers.disk_format import BLOCK_BYTES, parse_object_name
from testbed.disk import flip_middle_bytes, object_bytes, object_files, small_tmpfs
from testbed.server import ServerProcess, map_arena_file

PAGE = 64 * 1024
L1_PAGES = 32
WORLD_SIZE = 2
LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="disk", page_bytes=PAGE, world_size=WORLD_SIZE, rank=0
)
POOL = pool_name(LAYOUT.model_fingerprint, LAYOUT.layout_fingerprint, WORLD_SIZE)
# A page's object file: the page, its header, rounded up to whole blocks.
OBJECT_BYTES = PAGE + BLOCK_BYTES


def disk_server(path: Path | str, size_gb: float, l1_pages: int = L1_PAGES) -> ServerProcess:
    return ServerProcess(
        l1_size_gb=l1_pages * PAGE / 2**30,
        extra_args=["--l2-disk-path", str(path), "--l2-disk-size-gb", repr(size_gb)],
    )


def key(tag: str, i: int) -> bytes:
    return f"{tag}{i:08d}".encode() * 2


def page_bytes(block_hash: bytes, rank: int) -> bytes:
    return (block_hash + bytes([rank])) * (PAGE // (len(block_hash) + 1)) + bytes(
        PAGE % (len(block_hash) + 1)
    )


class Writer:
    """Stores blocks for every rank as workers do: reserve, write the arena's pages, commit."""

    def __init__(self, client: KVShelfClient) -> None:
        self.client = client
        registration = client.register(LAYOUT)
        self.pool = registration.pool
        self.arena = map_arena_file(registration.shm_name)

    def store(self, hashes: list[bytes]) -> None:
        for rank in range(WORLD_SIZE):
            reservation = self.client.reserve(self.pool, rank, hashes)
            for block_hash, page in zip(hashes, reservation.pages, strict=True):
                if page is not None:
                    self.arena[page * PAGE : (page + 1) * PAGE] = page_bytes(block_hash, rank)
            self.client.commit(reservation.reservation_id)

    def close(self) -> None:
        self.arena.close()


def store_on_disk(writer: Writer, hashes: list[bytes]) -> None:
    """Store ``hashes`` two at a time, each pair on disk before the next: the write queue holds
    a quarter of these tiny arenas, and a write that does not fit would be dropped."""
    client = writer.client
    before = client.stats()["l2_stored_objects_total"]
    for end in range(2, len(hashes) + 1, 2):
        writer.store(hashes[end - 2 : end])
        written = before + WORLD_SIZE * end
        wait_for(lambda: client.stats()["l2_stored_objects_total"] == written)  # noqa: B023
    assert client.stats()["l2_dropped_writes_total"] == 0


def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def lookup(client: KVShelfClient, pool: str, hashes: list[bytes]) -> LookupResult:
    """A locking lookup, asked again while the server answers "pending"."""
    while True:
        result = client.lookup(pool, hashes, world_size=WORLD_SIZE, lock=True)
        if not result.pending:
            return result


def check_hit(server: ServerProcess, client: KVShelfClient, hashes: list[bytes]) -> int:
    """Look ``hashes`` up, check every hit page holds its block's bytes, release; the hit."""
    registration = client.register(LAYOUT)
    result = lookup(client, registration.pool, hashes)
    arena = map_arena_file(registration.shm_name)
    try:
        for rank, pages in enumerate(result.pages):
            for block_hash, page in zip(hashes, pages, strict=False):
                assert arena[page * PAGE : (page + 1) * PAGE] == page_bytes(block_hash, rank)
    finally:
        arena.close()
    if result.lock_id:
        for rank in range(WORLD_SIZE):
            client.release(result.lock_id, rank)
    return result.num_hit_blocks


@pytest.fixture
def directory(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "l2"


def test_flags_come_together_and_the_directory_is_owner_only(directory: Path) -> None:
    assert server_main(["--l2-disk-path", str(directory)]) == 2
    assert server_main(["--l2-disk-size-gb", "1"]) == 2
    assert not directory.exists()
    with disk_server(directory, 0.01) as server, server.client() as client:
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        stats = client.stats()
        assert stats["l2_capacity_bytes"] == int(0.01 * 2**30)
        assert stats["l2_resident_objects"] == 0


def test_l1_eviction_keeps_keys_on_disk_and_a_restart_serves_them(directory: Path) -> None:
    hashes = [key("a", i) for i in range(3 * L1_PAGES)]
    with disk_server(directory, 0.05) as server, server.client() as client:
        writer = Writer(client)
        store_on_disk(writer, hashes)
        stats = client.stats()
        assert stats["evicted_objects_total"] > 0
        assert stats["l2_resident_objects"] == WORLD_SIZE * len(hashes)
        # The first blocks left L1 long ago; they come back from disk, in pieces as L1 allows.
        assert check_hit(server, client, hashes[:4]) == 4
        assert client.stats()["l2_hit_objects_total"] >= WORLD_SIZE * 4
        writer.close()
    assert not [name for name in os.listdir("/dev/shm") if str(server.port) in name]

    with disk_server(directory, 0.05) as server, server.client() as client:
        stats = client.stats()
        assert stats["l2_resident_objects"] == WORLD_SIZE * len(hashes)
        assert stats["pools"] == 1 and stats["resident_objects"] == 0
        # Before any worker registers: the scheduler's lookup alone is answered from disk.
        result = lookup(client, POOL, hashes[:6])
        assert result.num_hit_blocks == 6
        for rank in range(WORLD_SIZE):
            client.release(result.lock_id, rank)
        assert check_hit(server, client, hashes[6:12]) == 6
        assert client.stats()["l2_hit_objects_total"] == WORLD_SIZE * 12


def test_damaged_objects_are_misses_counted_and_removed(directory: Path) -> None:
    hashes = [key("c", i) for i in range(8)]
    with disk_server(directory, 0.05) as server, server.client() as client:
        writer = Writer(client)
        store_on_disk(writer, hashes)
        writer.close()
    files = object_files(str(directory))
    assert len(files) == WORLD_SIZE * 8
    # Block 3's objects: flipped bytes in the middle; block 5's rank 1: truncated.
    damaged = [f for f in files if key("c", 3).hex() in f]
    flip_middle_bytes(damaged)
    (truncated,) = [f for f in files if f.endswith(f"1-{key('c', 5).hex()}.kv")]
    with open(truncated, "r+b") as f:
        f.truncate(PAGE // 2)
    with disk_server(directory, 0.05) as server, server.client() as client:
        # The truncated file is found by its length at start.
        assert client.stats()["l2_corrupt_objects_total"] == 1
        assert check_hit(server, client, hashes) == 3
        stats = client.stats()
        assert stats["l2_corrupt_objects_total"] == 1 + WORLD_SIZE
        assert not any(os.path.exists(f) for f in [*damaged, truncated])
        assert check_hit(server, client, hashes[4:5]) == 1


def test_the_directory_never_exceeds_its_budget(directory: Path) -> None:
    budget_objects = 6
    size_gb = budget_objects * OBJECT_BYTES / 2**30
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(object_bytes(str(directory)))
            time.sleep(0.001)

    with disk_server(directory, size_gb) as server, server.client() as client:
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            writer = Writer(client)
            for i in range(40):
                writer.store([key("b", i)])
            wait_for(lambda: client.stats()["l2_stored_objects_total"] >= 3 * budget_objects)
            time.sleep(0.2)
        finally:
            stop.set()
            watcher.join()
        stats = client.stats()
        assert stats["l2_resident_bytes"] <= budget_objects * OBJECT_BYTES
        assert stats["l2_resident_objects"] <= budget_objects
        # The newest block is on disk; the oldest were evicted from both tiers.
        assert check_hit(server, client, [key("b", 39)]) == 1
        assert check_hit(server, client, [key("b", 0)]) == 0
        writer.close()
    assert len(seen) > 10 and max(seen) <= budget_objects * OBJECT_BYTES


def test_a_full_file_system_and_a_vanished_directory_degrade_and_recover() -> None:
    try:
        mount = small_tmpfs(4 * OBJECT_BYTES)
        path = mount.__enter__()
    except OSError as exc:
        pytest.skip(f"needs a small tmpfs: {exc}")
    try:
        directory = os.path.join(path, "l2")
        # The budget is larger than the file system: writes hit ENOSPC.
        with disk_server(directory, 0.05) as server, server.client() as client:
            writer = Writer(client)
            hashes = [key("f", i) for i in range(10)]
            for block_hash in hashes:
                writer.store([block_hash])
            wait_for(lambda: client.stats()["l2_errors_total"] > 0)
            time.sleep(0.2)
            stats = client.stats()
            assert 0 < stats["l2_stored_objects_total"] <= 4
            # L1 keeps serving every block.
            assert check_hit(server, client, hashes) == len(hashes)

            # The directory goes; stores and lookups go on, and the tier writes again later.
            shutil.rmtree(directory)
            errors = client.stats()["l2_errors_total"]
            stored = client.stats()["l2_stored_objects_total"]
            time.sleep(1.1)  # past the pause after the last fault
            for i in range(6):
                writer.store([key("g", i)])
                time.sleep(0.05)
            wait_for(lambda: client.stats()["l2_stored_objects_total"] > stored)
            assert os.path.isdir(directory)
            # Objects whose files went with the directory are misses, counted as errors.
            assert check_hit(server, client, hashes[:1]) == 1  # in L1 still
            writer.close()
            assert client.stats()["l2_errors_total"] >= errors
            assert client.ping()
    finally:
        mount.__exit__(None, None, None)


def test_after_a_kill_during_writes_every_object_served_is_intact(directory: Path) -> None:
    server = disk_server(directory, 0.2, l1_pages=64)
    stored: list[bytes] = []
    with server, server.client(timeout_s=2.0) as client:
        writer = Writer(client)
        for i in range(200):
            writer.store([key("k", i)])
            stored.append(key("k", i))
            if client.stats()["l2_stored_objects_total"] >= 40:
                break
        # Keep committing while the server dies.
        killer = threading.Timer(0.05, os.kill, args=(server.pid, signal.SIGKILL))
        killer.start()
        try:
            for i in range(200, 2000):
                writer.store([key("k", i)])
                stored.append(key("k", i))
        except Exception:
            pass
        killer.join()
        writer.close()
    server.kill()
    # Keys the kill left on disk for some ranks only (a write in flight or dropped for one of
    # them) can never hit: the lookup needs every rank.
    ranks: dict[bytes, int] = {}
    for path in object_files(str(directory)):
        parsed = parse_object_name(os.path.basename(path))
        assert parsed is not None
        ranks[parsed[1]] = ranks.get(parsed[1], 0) + 1
    incomplete = sum(count for count in ranks.values() if count < WORLD_SIZE)
    with disk_server(directory, 0.2, l1_pages=64) as server, server.client() as client:
        restored = client.stats()["l2_resident_objects"]
        assert restored >= 40
        hits = 0
        for block_hash in stored:
            hits += check_hit(server, client, [block_hash])
        stats = client.stats()
        # Every object that answered a lookup held exactly its bytes (check_hit compares);
        # anything damaged was caught and counted, never served.
        assert hits * WORLD_SIZE + stats["l2_corrupt_objects_total"] >= restored - incomplete
        assert hits > 0


def test_a_state_space_hit_ends_at_a_state_held_on_disk_after_a_restart(directory: Path) -> None:
    """``Lookup.ends`` with every object on disk only: the hit ends at the longest boundary
    whose prefix and state the disk holds, and comes back from there."""
    prefix = [key("p", i) for i in range(6)]
    ends = [[key("s", i)] for i in range(6)]
    with disk_server(directory, 0.05) as server, server.client() as client:
        writer = Writer(client)
        store_on_disk(writer, [*prefix, *ends[1], *ends[3]])
        writer.close()
    with disk_server(directory, 0.05) as server, server.client() as client:
        assert client.stats()["resident_objects"] == 0
        while True:
            result = client.lookup(
                POOL, prefix, world_size=WORLD_SIZE, lock=True, block_keys=1, ends=ends
            )
            if not result.pending:
                break
        assert (result.end_block, result.num_hit_blocks) == (4, 4 + 1)
        for rank in range(WORLD_SIZE):
            client.release(result.lock_id, rank)
