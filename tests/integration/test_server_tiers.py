"""A tier below L1 whose loads finish later on its own thread, behind the real socket loop.

The server runs in this process (its loop on a thread), so the test can plug in a tier and
check the index's invariants; the clients are the real ones, over TCP.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zmq

from kvshelf.client import KVShelfClient
from kvshelf.protocol import PageLayout
from kvshelf.server.completions import Completions
from kvshelf.server.handler import RequestHandler
from kvshelf.server.index import CacheIndex
from kvshelf.server.loop import ServerLoop
from kvshelf.server.pool import Entry
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.base import Tier, TierLoad, TierStore
from kvshelf.server.tiers.shared_memory import ExtentAllocator, SharedMemoryArena
from testbed.server import free_port

PAGE = 4096
NUM_PAGES = 64
WORLD_SIZE = 2
LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="d", page_bytes=PAGE, world_size=WORLD_SIZE, rank=0
)


class DelayedTier(Tier):
    """A tier below L1 holding objects in memory; each load waits on its own thread until the
    test sets :attr:`go`, then copies the objects into their L1 pages and finishes."""

    name = "delayed"

    def __init__(self, objects: dict[int, bytes]) -> None:
        self.objects = objects
        self.go = threading.Event()
        self.loading = threading.Event()
        self.completed_loads: list[TierLoad] = []
        self._threads: list[threading.Thread] = []

    def lookup(self, entry: Entry) -> bool:
        return entry.location in self.objects

    def prepare_load(self, load: TierLoad) -> None:
        thread = threading.Thread(target=self._copy, args=(load,), daemon=True)
        self._threads.append(thread)
        thread.start()
        self.loading.set()

    def _copy(self, load: TierLoad) -> None:
        self.go.wait(timeout=30)
        for entry, view in zip(load.entries, load.views, strict=True):
            view[:] = self.objects[entry.location]
        load.finish([True] * len(load.pages))

    def complete_load(self, load: TierLoad) -> None:
        self.completed_loads.append(load)

    def prepare_store(self, store: TierStore) -> None:
        store.finish()

    def complete_store(self, store: TierStore) -> None:
        pass

    def close(self) -> None:
        self.go.set()
        for thread in self._threads:
            thread.join()


@dataclass
class InProcessServer:
    port: int
    memory: SharedMemoryArena
    index: CacheIndex
    tier: DelayedTier
    pool: str

    def client(self) -> KVShelfClient:
        return KVShelfClient("127.0.0.1", self.port, timeout_s=5.0)

    def page(self, page: int) -> bytes:
        return bytes(self.memory.view(page * PAGE, PAGE))


def block(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def object_bytes(rank: int, i: int) -> bytes:
    return bytes([16 * rank + i]) * PAGE


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[InProcessServer]:
    """Block 0 in L1 and blocks 1 and 2 in the delayed tier, for both ranks; then serving.

    The fetch deadline is ``request.param`` when the test sets one (indirect), else 60 s.
    """
    memory = SharedMemoryArena(f"kvshelf-test-delayed-{os.getpid()}", NUM_PAGES * PAGE)
    arena = ArenaTier(ExtentAllocator(memory.size_bytes), eviction_watermark=1.0, memory=memory)
    tier = DelayedTier(
        {10 * rank + i: object_bytes(rank, i) for rank in range(WORLD_SIZE) for i in (1, 2)}
    )
    completions = Completions()
    # No fetch deadline within the test: the tier finishes when the test says so.
    index = CacheIndex(
        [arena, tier],
        lease_timeout_s=30.0,
        completions=completions,
        fetch_answer_within_s=getattr(request, "param", 60.0),
    )
    pool = index.register(LAYOUT).name
    for rank in range(WORLD_SIZE):
        reservation_id, (page,) = index.reserve(pool, rank, [block(0)], now=0.0)
        assert page is not None
        memory.view(page * PAGE, PAGE)[:] = object_bytes(rank, 0)
        index.commit(reservation_id)
        for i in (1, 2):
            assert index.add_stored(pool, rank, block(i), tier, 10 * rank + i)
    completions.run()  # the delayed tier's stores of block 0

    port = free_port()
    context = zmq.Context()
    handler = RequestHandler(index, memory, boot_id="b" * 16)
    loop = ServerLoop(handler, index, f"tcp://127.0.0.1:{port}", context, completions)
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(stop.is_set,), daemon=True)
    thread.start()
    try:
        yield InProcessServer(port, memory, index, tier, pool)
    finally:
        stop.set()
        thread.join()
        loop.close()
        index.close()
        index.check_invariants()
        completions.close()
        context.term()
        memory.close()


def test_a_deferred_lookup_is_answered_when_the_tier_finishes(server: InProcessServer) -> None:
    hashes = [block(i) for i in range(4)]  # block 3 is nowhere
    with server.client() as waiting, server.client() as other:
        ticket = waiting.submit_lookup(server.pool, hashes, world_size=WORLD_SIZE, lock=True)
        assert server.tier.loading.wait(timeout=5)
        assert waiting.poll_lookup(ticket, wait_s=0.2) is None

        # Meanwhile the loop serves everyone else, the waiting client included.
        assert other.ping() == waiting.ping() == "b" * 16
        hit = other.lookup(server.pool, hashes[:1], world_size=WORLD_SIZE, lock=False)
        assert hit.num_hit_blocks == 1
        stats = other.stats()
        # Pinned: the L1 prefix of the pending lookup; its lock is not taken yet.
        assert stats["active_locks"] == 0 and stats["locked_objects"] == WORLD_SIZE
        reservation = other.reserve(server.pool, 0, [block(9)])
        other.commit(reservation.reservation_id)
        assert other.stats()["committed_objects_total"] == WORLD_SIZE + 1

        server.tier.go.set()
        result = waiting.poll_lookup(ticket, wait_s=5.0)
        assert result is not None
        assert result.num_hit_blocks == 3 and result.lock_id > 0
        assert len(result.pages) == WORLD_SIZE
        for rank, share in enumerate(result.pages):
            assert [server.page(page) for page in share] == [
                object_bytes(rank, i) for i in range(3)
            ]
        stats = other.stats()
        assert stats["active_locks"] == 1 and stats["locked_objects"] == 3 * WORLD_SIZE
        assert stats["lookup_requests_total"] == 2 and len(server.tier.completed_loads) == 1
        for rank in range(WORLD_SIZE):
            waiting.release(result.lock_id, rank)
        assert other.stats()["locked_objects"] == 0
        # The fetched blocks are L1 pages now: the same lookup is answered at once.
        again = other.lookup(server.pool, hashes, world_size=WORLD_SIZE, lock=False)
        assert again.num_hit_blocks == 3
        assert len(server.tier.completed_loads) == 1


@pytest.mark.parametrize("server", [0.2], indirect=True)
def test_a_slow_tier_gets_a_pending_answer_in_time_and_the_next_lookup_hits(
    server: InProcessServer,
) -> None:
    hashes = [block(i) for i in range(3)]
    with server.client() as client:
        started = time.monotonic()
        ticket = client.submit_lookup(server.pool, hashes, world_size=WORLD_SIZE, lock=True)
        # The tier has not finished (and will not until told): the answer is "pending",
        # well within the client's timeout, and nothing is locked.
        result = client.poll_lookup(ticket, wait_s=2.0)
        assert result is not None and result.pending and time.monotonic() - started < 1.0
        assert result.lock_id == 0 and client.stats()["locked_objects"] == 0
        server.tier.go.set()
        deadline = time.monotonic() + 5.0
        while (
            again := client.lookup(server.pool, hashes, world_size=WORLD_SIZE, lock=True)
        ).pending:
            assert time.monotonic() < deadline
        assert again.num_hit_blocks == 3 and len(server.tier.completed_loads) == 1
        for rank in range(WORLD_SIZE):
            client.release(again.lock_id, rank)
