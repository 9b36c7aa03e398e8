"""Miss reasons: a request whose lookup stops short of its blocks is counted once, under the
reason of its first missing block, by the server (``kvshelf stats``) and by the connector's
scheduler role (its stats), against real servers."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from kvshelf.client import KVShelfClient
from kvshelf.metrics import SCHEDULER, SERVER
from kvshelf.protocol import Lookup, LookupReply, MissReason, PageLayout, decode_reply, encode
from kvshelf.roles import scheduler_lookups as lookups_module
from kvshelf.roles.lookup_answers import ANSWER_REFRESH_S
from kvshelf.roles.scheduler import SchedulerConnector
from kvshelf.server.completions import Completions
from kvshelf.server.evicted import RecentlyEvicted
from kvshelf.server.handler import RequestHandler
from kvshelf.server.index import CacheIndex
from kvshelf.server.pool import Entry
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.base import Tier, TierLoad, TierStore
from kvshelf.server.tiers.shared_memory import ExtentAllocator, SharedMemoryArena
from testbed.server import ServerProcess, free_port

BLOCK = 4
PAGE = 64 * 1024
SERVER_REASONS = [n for n in SERVER.names() if n.startswith("miss_")]
CONNECTOR_REASONS = [n for n in SCHEDULER.names() if n.startswith("miss_")]


def layout(world_size: int = 1, rank: int = 0) -> PageLayout:
    return PageLayout(
        model_fingerprint="m",
        layout_fingerprint="l",
        page_bytes=PAGE,
        world_size=world_size,
        rank=rank,
    )


def hashes(seed: int, count: int = 4) -> list[bytes]:
    return [bytes([seed, i]) * 16 for i in range(count)]


def request(request_id: str, block_hashes: list[bytes]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=request_id,
        block_hashes=block_hashes,
        num_tokens=len(block_hashes) * BLOCK + 1,
        num_computed_tokens=0,
    )


def ask(scheduler: SchedulerConnector, req: SimpleNamespace) -> int:
    deadline = time.monotonic() + 5.0
    while (hit := scheduler.lookup(req, 0)) is None:
        assert time.monotonic() < deadline, "the lookup was never answered"
        time.sleep(0.001)
    return hit


def scheduler_for(client: KVShelfClient, pool: str, world_size: int = 1) -> SchedulerConnector:
    return SchedulerConnector(
        client, pool, block_size=BLOCK, world_size=world_size, get_block_ids=lambda _: []
    )


def reasons(counts: dict[str, int], names: list[str]) -> dict[str, int]:
    """The miss counters that are not 0."""
    return {name: counts[name] for name in names if counts[name]}


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    # 16 pages of 64 KiB: a fifth distinct request evicts the first one's blocks.
    with ServerProcess(l1_size_gb=16 * PAGE / (1 << 30), eviction_watermark=1.0) as process:
        yield process


def test_never_stored_counts_once_however_often_vllm_asks(server: ServerProcess) -> None:
    with server.client() as client:
        pool = client.register(layout()).pool
        client.commit(client.reserve(pool, 0, hashes(1)[:2]).reservation_id)
        scheduler = scheduler_for(client, pool)
        req = request("r", hashes(1))
        assert ask(scheduler, req) == 2 * BLOCK
        # vLLM could not allocate it and asks again, long enough for refreshes to go out.
        deadline = time.monotonic() + 10 * ANSWER_REFRESH_S
        while time.monotonic() < deadline:
            assert scheduler.lookup(req, 0) == 2 * BLOCK
            time.sleep(ANSWER_REFRESH_S / 4)
        lookups = scheduler.counters["lookups"]
        stats = client.stats()
    assert lookups > 2 and stats["lookup_requests_total"] == lookups
    assert reasons(stats, SERVER_REASONS) == {"miss_never_stored_total": 1}
    assert reasons(scheduler.snapshot(), CONNECTOR_REASONS) == {"miss_never_stored": 1}


def test_a_full_hit_counts_no_miss(server: ServerProcess) -> None:
    with server.client() as client:
        pool = client.register(layout()).pool
        client.commit(client.reserve(pool, 0, hashes(1)).reservation_id)
        scheduler = scheduler_for(client, pool)
        assert ask(scheduler, request("r", hashes(1))) == 4 * BLOCK
        stats = client.stats()
    assert reasons(stats, SERVER_REASONS) == {}
    assert reasons(scheduler.snapshot(), CONNECTOR_REASONS) == {}


def test_evicted(server: ServerProcess) -> None:
    with server.client() as client:
        pool = client.register(layout()).pool
        # 5 requests of 4 blocks into 16 pages: the first one's blocks are evicted (LRU).
        for seed in range(1, 6):
            client.commit(client.reserve(pool, 0, hashes(seed)).reservation_id)
        scheduler = scheduler_for(client, pool)
        assert ask(scheduler, request("old", hashes(1))) == 0
        assert ask(scheduler, request("new", hashes(9))) == 0
        stats = client.stats()
    assert stats["evicted_objects_total"] == 4
    assert reasons(stats, SERVER_REASONS) == {
        "miss_evicted_total": 1,
        "miss_never_stored_total": 1,
    }
    assert reasons(scheduler.snapshot(), CONNECTOR_REASONS) == {
        "miss_evicted": 1,
        "miss_never_stored": 1,
    }


def test_rank_incomplete(server: ServerProcess) -> None:
    with server.client() as client:
        pool = client.register(layout(world_size=2)).pool
        client.commit(client.reserve(pool, 0, hashes(1)).reservation_id)
        client.commit(client.reserve(pool, 1, hashes(1)[:1]).reservation_id)
        scheduler = scheduler_for(client, pool, world_size=2)
        assert ask(scheduler, request("r", hashes(1))) == BLOCK
        stats = client.stats()
    assert reasons(stats, SERVER_REASONS) == {"miss_rank_incomplete_total": 1}
    assert reasons(scheduler.snapshot(), CONNECTOR_REASONS) == {"miss_rank_incomplete": 1}


def test_server_unavailable_and_lookup_too_late_by_timeout() -> None:
    # Nobody listens: the first request's lookup times out (too late: no reply within the
    # client's timeout), after which the client fails fast (unavailable) until a probe answers.
    with KVShelfClient("127.0.0.1", free_port(), timeout_s=0.2, retry_interval_s=30.0) as client:
        scheduler = scheduler_for(client, "pool")
        assert ask(scheduler, request("first", hashes(1))) == 0
        assert ask(scheduler, request("second", hashes(2))) == 0
        assert ask(scheduler, request("second", hashes(2))) == 0  # asked again: counted once
    assert reasons(scheduler.snapshot(), CONNECTOR_REASONS) == {
        "miss_lookup_too_late": 1,
        "miss_server_unavailable": 1,
    }


def test_lookup_too_late_when_the_request_ends_first(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lookups_module, "LOOKUP_WAIT_PER_STEP_S", 0.0)
    with server.client(timeout_s=5.0) as client:
        pool = client.register(layout()).pool
        scheduler = scheduler_for(client, pool)
        req = request("aborted", hashes(1))
        os.kill(server.pid, signal.SIGSTOP)
        try:
            assert scheduler.lookup(req, 0) is None
            scheduler.request_finished(req, [])
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert reasons(scheduler.snapshot(), CONNECTOR_REASONS) == {"miss_lookup_too_late": 1}
        # The server still answered that lookup, under its own reason.
        deadline = time.monotonic() + 5.0
        while client.stats()["miss_never_stored_total"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)


class FailingTier(Tier):
    """A tier below L1 that holds every key it is told about and never manages to load one."""

    name = "failing"

    def lookup(self, entry: Entry) -> bool:
        return True

    def prepare_load(self, load: TierLoad) -> None:
        load.finish([False] * len(load.pages))

    def complete_load(self, load: TierLoad) -> None:
        pass

    def prepare_store(self, store: TierStore) -> None:
        store.finish()

    def complete_store(self, store: TierStore) -> None:
        pass


def test_tier_error() -> None:
    memory = SharedMemoryArena(f"kvshelf-test-miss-{os.getpid()}", 16 * PAGE)
    completions = Completions()
    try:
        arena = ArenaTier(ExtentAllocator(memory.size_bytes), eviction_watermark=1.0, memory=memory)
        tier = FailingTier()
        index = CacheIndex([arena, tier], lease_timeout_s=30.0, completions=completions)
        handler = RequestHandler(index, memory, boot_id="b" * 16)
        pool = index.register(layout()).name
        blocks = hashes(1)
        index.commit(index.reserve(pool, 0, blocks[:1], now=0.0)[0])
        for block in blocks[1:]:
            index.add_stored(pool, 0, block, tier, block)
        completions.run()
        lookup = Lookup(request_id=7, pool=pool, hashes=blocks, world_size=1, lock=False)
        # Deferred until the tier's loads finish (not landed), then answered from L1.
        assert handler.handle(b"peer", encode(lookup)) is None
        completions.run()
        ((_, frame),) = handler.take_deferred()
        reply = decode_reply(frame)
        assert isinstance(reply, LookupReply)
        assert (reply.num_hit_blocks, reply.miss_reason) == (1, MissReason.TIER_ERROR)
        assert reasons(index.stats(), SERVER_REASONS) == {"miss_tier_error_total": 1}
        # A lookup that does not ask to count its miss (a request asking again) counts none.
        again = Lookup(
            request_id=8, pool=pool, hashes=blocks, world_size=1, lock=False, count_miss=False
        )
        assert handler.handle(b"peer", encode(again)) is None
        completions.run()
        ((_, frame),) = handler.take_deferred()
        assert decode_reply(frame).miss_reason == MissReason.NONE
        assert reasons(index.stats(), SERVER_REASONS) == {"miss_tier_error_total": 1}
        index.check_invariants()
        index.close()
    finally:
        completions.close()
        memory.close()


def test_recently_evicted_keys_are_bounded_and_forget_the_oldest() -> None:
    evicted = RecentlyEvicted(capacity=4)
    for i in range(12):
        evicted.add("pool", bytes([i]))
    assert len(evicted) <= 8
    # The last `capacity` evictions at least are remembered; the first ones are forgotten.
    assert all(("pool", bytes([i])) in evicted for i in range(8, 12))
    assert all(("pool", bytes([i])) not in evicted for i in range(4))
    assert ("other pool", bytes([11])) not in evicted
