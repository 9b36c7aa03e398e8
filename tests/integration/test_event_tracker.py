"""The scheduler side's event tracker against a real server (with a disk tier): what it
publishes for stores it planned, blocks a lookup found, evictions to disk, and a retired pool.

vLLM is not needed here: requests are plain objects with ``block_hashes`` and the tracker's
``describe`` reads their tokens (``kvshelf.vllm.events`` does it with vLLM's helpers).
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvshelf.client import KVShelfClient
from kvshelf.protocol import MAX_HASH_BYTES, PageLayout
from kvshelf.roles.events import (
    CPU,
    DEFAULT_MAX_PENDING_BYTES,
    PENDING_BYTES_PER_ENTRY,
    PENDING_BYTES_PER_PROBE,
    STORAGE,
    BlockInfo,
    Cleared,
    Event,
    EventReader,
    EventTracker,
    Removed,
    Stored,
)
from kvshelf.server.limits import MIN_PAGE_BYTES
from testbed.server import ServerProcess

PAGE = 16 * 1024
L1_PAGES = 16
TOKENS = 4
LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="tracker", page_bytes=PAGE, world_size=1, rank=0
)


def request(tag: bytes, blocks: int) -> Any:
    hashes = [tag + i.to_bytes(4, "big") * 4 for i in range(blocks)]
    tokens = [[i * 10 + t for t in range(TOKENS)] for i in range(blocks)]
    return SimpleNamespace(block_hashes=hashes, tokens=tokens)


def describe(req: Any, start: int, end: int) -> list[BlockInfo]:
    return [
        BlockInfo(
            parent=req.block_hashes[i - 1] if i else None,
            token_ids=tuple(req.tokens[i]),
            lora_name=None,
            extra_keys=None,
        )
        for i in range(start, end)
    ]


def take_until(tracker: EventTracker, done: Any, timeout_s: float = 10.0) -> list[Event]:
    events: list[Event] = []
    deadline = time.monotonic() + timeout_s
    while not done(events):
        assert time.monotonic() < deadline, events
        events += tracker.take()
        time.sleep(0.02)
    return events


def wait_for_disk(client: KVShelfClient, objects: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.stats()["l2_stored_objects_total"] < objects:
        assert time.monotonic() < deadline, "the disk tier did not write the objects"
        time.sleep(0.02)


def test_stored_found_demoted_and_retired(tmp_path: Path) -> None:
    with (
        ServerProcess(
            l1_size_gb=L1_PAGES * PAGE / 2**30,
            eviction_watermark=1.0,
            extra_args=["--l2-disk-path", str(tmp_path), "--l2-disk-size-gb", "1"],
        ) as server,
        server.client() as client,
    ):
        pool = client.register(LAYOUT).pool
        tracker = EventTracker(EventReader(KVShelfClient(server.host, server.port), pool), describe)
        try:
            # A store this engine planned: published once the server committed it, as one
            # chain with its tokens.
            mine = request(b"a", 4)
            tracker.blocks_planned(mine, 0, 4)
            assert tracker.take() == []
            client.commit(client.reserve(pool, 0, mine.block_hashes).reservation_id)
            (stored,) = take_until(tracker, lambda events: events)
            assert isinstance(stored, Stored) and stored.medium == CPU
            assert stored.hashes == mine.block_hashes and stored.parent is None
            assert stored.token_ids == [t for block in mine.tokens for t in block]

            # A sibling's store: not published until a lookup of this engine finds it.
            sibling = request(b"b", 3)
            client.commit(client.reserve(pool, 0, sibling.block_hashes).reservation_id)
            time.sleep(0.3)
            assert tracker.take() == []
            tracker.blocks_found(sibling, 3)
            (found,) = tracker.take()
            assert isinstance(found, Stored) and found.hashes == sibling.block_hashes
            wait_for_disk(client, 7)

            # Evicted from L1, kept on disk: withdrawn from CPU, published at STORAGE.
            for round_ in range(4):
                batch = request(bytes([round_]) + b"f", 4).block_hashes
                client.commit(client.reserve(pool, 0, batch).reservation_id)
                wait_for_disk(client, 7 + 4 * (round_ + 1))

            def demoted(events: list[Event]) -> set[bytes]:
                return {h for e in events if isinstance(e, Stored) for h in e.hashes}

            everything = set(mine.block_hashes) | set(sibling.block_hashes)
            events = take_until(tracker, lambda events: demoted(events) == everything)
            removed = {h for e in events if isinstance(e, Removed) for h in e.hashes}
            assert removed == everything
            assert all(e.medium == CPU for e in events if isinstance(e, Removed))
            assert all(e.medium == STORAGE for e in events if isinstance(e, Stored))

            # A new identity epoch retires the pool for this engine.
            tracker.switch_pool("pool-retired")
            assert tracker.take() == [Cleared()]
        finally:
            tracker.close()


def held_bytes(reader: EventReader) -> int:
    """What the reader holds for the step, counted as it counts it."""
    held = 0
    for _, kind, payload in list(reader.items):
        if kind == "log":
            held += sum(len(h) + PENDING_BYTES_PER_ENTRY for h in payload[1])
        elif kind == "present":
            held += PENDING_BYTES_PER_PROBE * len(payload[0])
    return held


def test_an_idle_engines_reader_starts_over_rather_than_hold_a_siblings_stores() -> None:
    pages = 2048
    small = PageLayout(
        model_fingerprint="m",
        layout_fingerprint="idle",
        page_bytes=MIN_PAGE_BYTES,
        world_size=1,
        rank=0,
    )
    with (
        ServerProcess(l1_size_gb=pages * MIN_PAGE_BYTES / 2**30, eviction_watermark=1.0) as server,
        server.client() as client,
    ):
        pool = client.register(small).pool
        reader = EventReader(KVShelfClient(server.host, server.port), pool)
        tracker = EventTracker(reader, describe)
        try:
            mine = request(b"i", 4)
            tracker.blocks_planned(mine, 0, 4)
            client.commit(client.reserve(pool, 0, mine.block_hashes).reservation_id)
            assert take_until(tracker, lambda events: events)[0].hashes == mine.block_hashes
            # Locked (a lookup's lock lasts the lease), so the flood below cannot evict them.
            client.lookup(pool, mine.block_hashes, world_size=1, lock=True)

            # The engine idles (no step takes what its reader reads) while a sibling stores
            # 8 arenas of blocks with the largest hashes: about 30,000 entries, 10 MB.
            for round_ in range(8):
                batch = [
                    round_.to_bytes(4, "big") + i.to_bytes(4, "big") * (MAX_HASH_BYTES // 4 - 1)
                    for i in range(pages)
                ]
                client.commit(client.reserve(pool, 0, batch).reservation_id)
            time.sleep(1.5)
            assert not reader.failing
            assert held_bytes(reader) <= DEFAULT_MAX_PENDING_BYTES

            # The next step starts over: Cleared, then what the server still holds of the
            # blocks this engine knows.
            def stored(events: list[Event]) -> set[bytes]:
                return {
                    h for e in events if isinstance(e, Stored) and e.medium == CPU for h in e.hashes
                }

            events = tracker.take()
            assert events[:1] == [Cleared()]
            events += take_until(
                tracker, lambda more: stored(events + more) == set(mine.block_hashes)
            )
            assert not any(isinstance(e, Removed) for e in events)
        finally:
            tracker.close()
