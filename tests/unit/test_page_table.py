"""The page table's format (header, pool and page records, torn and corrupt records) and the
slot allocator; then an index whose arena is "crashed" (left in /dev/shm with its lock dropped)
and adopted, checked by the index's invariants at every step."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from kvshelf.platform.ownership import Owner, scan
from kvshelf.platform.shm import arena_name
from kvshelf.protocol import MAX_HASH_BYTES, PageLayout
from kvshelf.server.adoption import open_arena, rebuild
from kvshelf.server.index import CacheIndex
from kvshelf.server.page_table import (
    HEADER_BYTES,
    POOL_RECORD_BYTES,
    RECORD_BYTES,
    Geometry,
    PageTable,
    SlotAllocator,
    SlotState,
    TableError,
    carries_header,
    decode_header,
    encode_header,
)
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.shared_memory import ExtentAllocator, SharedMemoryArena
from testbed.server import free_port

LAYOUT = PageLayout(
    model_fingerprint="model", layout_fingerprint="layout", page_bytes=8192, world_size=2, rank=1
)


def table(capacity: int = 64 * 4096, pool_slots: int = 2) -> PageTable:
    geometry = Geometry.for_capacity(capacity, pool_slots)
    return PageTable(memoryview(bytearray(geometry.trailer_bytes)), geometry)


def test_header_round_trip_and_rejections() -> None:
    geometry = Geometry.for_capacity(1 << 20, 16)
    header = encode_header(geometry)
    assert len(header) == HEADER_BYTES
    assert decode_header(header, geometry.file_bytes) == geometry
    with pytest.raises(TableError, match="no kvshelf arena header"):
        decode_header(bytes(HEADER_BYTES), geometry.file_bytes)
    with pytest.raises(TableError, match="add up to"):
        decode_header(header, geometry.file_bytes + 4096)
    flipped = bytearray(header)
    flipped[20] ^= 1  # in the capacity
    with pytest.raises(TableError, match="checksum"):
        decode_header(bytes(flipped), geometry.file_bytes)


def test_records_round_trip() -> None:
    t = table()
    t.write_pool(1, LAYOUT)
    t.place(0, 1, 0, 8192)
    t.place(3, 1, 8192, 8192)
    long_hash = b"h" * MAX_HASH_BYTES
    t.key(0, SlotState.RESERVED, 1, long_hash)
    t.mark([SimpleNamespace(slot=0)], SlotState.COMMITTED)
    assert t.pools() == {1: LAYOUT}
    first, second = t.records()
    assert (first.slot, first.state, first.pool_slot, first.rank) == (0, SlotState.COMMITTED, 1, 1)
    assert (first.offset, first.length, first.block_hash) == (0, 8192, long_hash)
    assert (second.slot, second.state, second.offset, second.rank) == (3, SlotState.FREE, 8192, -1)
    t.mark([SimpleNamespace(slot=0), SimpleNamespace(slot=-1)], SlotState.FREE)
    t.mark([SimpleNamespace(slot=3)], SlotState.UNUSED)
    assert [(r.slot, r.state) for r in t.records()] == [(0, SlotState.FREE)]


def _torn(t: PageTable, slot: int) -> None:
    """Overwrite a byte of a record's hash, as a key write cut short would leave it."""
    records_at = t.geometry.pool_slots * POOL_RECORD_BYTES
    t._buf[records_at + slot * RECORD_BYTES + RECORD_BYTES - MAX_HASH_BYTES] ^= 0xFF


@pytest.mark.parametrize("state", [SlotState.FREE, SlotState.RESERVED, SlotState.FILLING])
def test_torn_key_reads_as_no_key(state: SlotState) -> None:
    t = table()
    t.write_pool(0, LAYOUT)
    t.place(2, 0, 0, 8192)
    t.key(2, state, 0, b"k" * 32)
    _torn(t, 2)
    (record,) = t.records()
    assert record.state is state and record.rank == -1 and record.block_hash == b""


def test_corrupt_committed_record_or_place_or_pool_is_refused() -> None:
    t = table()
    t.write_pool(0, LAYOUT)
    t.place(0, 0, 0, 8192)
    t.key(0, SlotState.COMMITTED, 0, b"k" * 32)
    _torn(t, 0)
    with pytest.raises(TableError, match="committed page record 0"):
        t.records()
    t = table()
    t.place(1, 0, 0, 8192)
    records_at = t.geometry.pool_slots * POOL_RECORD_BYTES
    t._buf[records_at + RECORD_BYTES + 20] ^= 1  # in the offset
    with pytest.raises(TableError, match="place fails its checksum"):
        t.records()
    t.write_pool(1, LAYOUT)
    t._buf[POOL_RECORD_BYTES + 20] ^= 1
    with pytest.raises(TableError, match="pool record 1"):
        t.pools()


def test_slot_allocator() -> None:
    slots = SlotAllocator(3)
    assert [slots.take(), slots.take(), slots.take(), slots.take()] == [0, 1, 2, -1]
    slots.give(1)
    assert slots.taken == 2 and slots.take() == 1
    adopted = SlotAllocator(8)
    adopted.mark({0, 3})
    assert adopted.taken == 2
    assert [adopted.take() for _ in range(7)] == [1, 2, 4, 5, 6, 7, -1]
    with pytest.raises(AssertionError):
        adopted.give(9)


PAGE = 4096
CAPACITY = 48 * PAGE


@pytest.fixture
def port() -> Iterator[int]:
    port = free_port()
    yield port
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"kvshelf-{port}-"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")


def layout(page_bytes: int, world_size: int = 1) -> PageLayout:
    return PageLayout(
        model_fingerprint="m",
        layout_fingerprint=f"l{page_bytes}",
        page_bytes=page_bytes,
        world_size=world_size,
        rank=0,
    )


def index_on(memory: SharedMemoryArena, adopted: object = None) -> CacheIndex:
    arena = ArenaTier(
        ExtentAllocator(memory.size_bytes),
        eviction_watermark=1.0,
        extent_bytes=4 * PAGE,
        memory=memory,
        table=memory.table(),
    )
    pools = ()
    if adopted is not None:
        rebuild(arena, adopted, quarantine_until=5.0)  # type: ignore[arg-type]
        pools = adopted.pools  # type: ignore[attr-defined]
    return CacheIndex([arena], lease_timeout_s=10.0, pools=pools)


def keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i:04d}".encode() * 4 for i in range(n)]


def byte_sum(stats: dict[str, int]) -> int:
    parts = ("l1_free_bytes", "l1_reserved_bytes", "l1_quarantined_bytes", "l1_gap_bytes")
    return sum(stats[p] for p in parts) + stats["resident_bytes"]


def test_crashed_index_is_adopted(port: int) -> None:
    memory = SharedMemoryArena(arena_name(port, "dead"), CAPACITY)
    index = index_on(memory)
    small = index.register(layout(PAGE, world_size=2)).name
    big = index.register(layout(5 * PAGE)).name  # 5-page pages: an alignment gap
    committed, reserved = keys("c", 6), keys("r", 3)
    for rank in range(2):
        index.commit(index.reserve(small, rank, committed, now=0.0)[0])
    index.commit(index.reserve(big, 0, keys("b", 2), now=0.0)[0])
    index.reserve(small, 0, reserved, now=0.0)  # never committed: the writer dies with it
    locked = index.lookup(small, committed[:2], world_size=2, lock=True, now=0.0)
    assert locked[0] == 2
    index.check_invariants()
    stats = index.stats()
    assert stats["l1_gap_bytes"] > 0 and stats["l1_reserved_bytes"] == 3 * PAGE
    assert byte_sum(stats) == CAPACITY
    # The crash: the file stays, the lock goes (as when the kernel closes a killed process's
    # descriptors).
    memory.keep_on_close = True
    memory.close()
    (found,) = scan(carries_header, port=port)
    assert found.owner is Owner.DEAD  # the scan now holds its lock
    found.release()

    adopted_memory, adopted = open_arena(port, arena_name(port, "new"), CAPACITY, 16, adopt=True)
    assert adopted is not None and adopted.source == arena_name(port, "dead")
    try:
        index = index_on(adopted_memory, adopted)
        index.check_invariants()
        stats = index.stats()
        assert stats["adopted_objects_total"] == 6 * 2 + 2
        assert stats["resident_objects"] == 14 and stats["reserved_objects"] == 0
        assert stats["l1_quarantined_bytes"] == 3 * PAGE
        assert stats["quarantined_pages"] == 14 + 3
        assert byte_sum(stats) == CAPACITY
        assert index.lookup(small, committed, world_size=2, lock=False, now=1.0)[0] == 6
        assert index.lookup(small, reserved, world_size=2, lock=False, now=1.0)[0] == 0
        # Loadable during the quarantine; locked and released, it stays held.
        lock = index.lookup(small, committed[:3], world_size=2, lock=True, now=1.0)
        index.check_invariants()
        # New stores get the free pages only: adopted ones are neither evicted nor reused.
        free_pages = stats["l1_free_bytes"] // PAGE
        rid, pages = index.reserve(small, 1, keys("n", 40), now=1.0)
        got = sum(p is not None for p in pages)
        assert 0 < got <= free_pages
        index.abort(rid)
        index.expire(now=5.0)  # the quarantine ends (with the lease timeout, in a server)
        stats = index.stats()
        assert stats["quarantined_pages"] == 0 and stats["l1_quarantined_bytes"] == 0
        assert stats["locked_objects"] == 3 * 2  # the lock taken meanwhile still holds
        index.check_invariants()
        for rank in range(2):
            index.release(lock[1], rank)
        index.check_invariants()
        rid, pages = index.reserve(small, 1, keys("n", 40), now=6.0)
        assert sum(p is not None for p in pages) > got  # quarantined and adopted pages reused
        index.commit(rid)
        index.check_invariants()
        assert byte_sum(index.stats()) == CAPACITY
    finally:
        adopted_memory.close()


def test_reading_the_table_allocates_no_unwritten_page(port: int) -> None:
    memory = SharedMemoryArena(arena_name(port, "sparse"), 64 << 20)  # 16384 slots: 5 MiB
    try:
        table = memory.table()
        table.write_pool(0, LAYOUT)
        table.place(9000, 0, 0, 8192)
        table.key(9000, SlotState.COMMITTED, 0, b"k" * 32)
        before = os.fstat(memory._fd).st_blocks
        assert [r.slot for r in table.records()] == [9000]
        assert os.fstat(memory._fd).st_blocks == before <= 64 * 1024 // 512
    finally:
        memory.close()
