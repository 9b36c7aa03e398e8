"""A stopping worker drains its queued stores within ``kvshelf.stop_drain_timeout_s``: what
its store thread reaches in time is committed, the rest aborted, and a block one rank
committed and another aborted is freed on both (docs/safety.md, "Stopping an engine").
Workers of a TP=2 pool against a real server; a slow rank is a store thread held back
before its first batch."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from kvshelf.plan import StoreJob
from kvshelf.roles import store_queue
from kvshelf.roles.worker import WorkerConnector
from testbed.server import ServerProcess

NUM_BLOCKS = 64
BLOCKS = range(1, 41)
HASHES = [b"d%d" % b for b in BLOCKS]


def make_worker(server: ServerProcess, rank: int, drain_s: float) -> WorkerConnector:
    return WorkerConnector(
        client_factory=lambda: server.client(timeout_s=5.0),
        model_fingerprint="m",
        layout_fingerprint="l",
        rank=rank,
        world_size=2,
        retry_interval_s=0.1,
        stop_drain_timeout_s=drain_s,
    )


def hold_store_thread(worker: WorkerConnector) -> threading.Event:
    """Hold the worker's store thread back before it takes its first batch (a slow rank):
    it goes on once the returned event is set."""
    go = threading.Event()
    worker._stores._confine = go.wait  # the first thing the thread calls
    return go


def submit_jobs(worker: WorkerConnector) -> None:
    worker.submit_stores([StoreJob(f"r{b}", (b,), (b"d%d" % b,), 0) for b in BLOCKS])


def stop_in_background(worker: WorkerConnector) -> threading.Thread:
    """Start ``worker.shutdown()`` in a thread; return once its stop counted the queue (it
    sets the drain deadline right after), so that everything queued is the stop's to drain."""
    stopper = threading.Thread(target=worker.shutdown)
    stopper.start()
    deadline = time.monotonic() + 5.0
    while worker._stores._abort_from is None:
        assert time.monotonic() < deadline, "the stop never began"
        time.sleep(0.001)
    return stopper


@pytest.fixture(autouse=True)
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    # Batches of 4 pages (a page: 2 layers of 16 KiB): 40 one-block jobs make 10 batches.
    monkeypatch.setattr(store_queue, "STORE_BATCH_BYTES", 4 * 2 * 16 * 1024)


def kv_caches() -> dict[str, torch.Tensor]:
    return {f"layer{i}": torch.randn(NUM_BLOCKS, 2, 16, 128) for i in range(2)}


def test_a_stop_commits_every_queued_store_within_the_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with ServerProcess(extra_args=["--no-prefault"]) as server, server.client() as client:
        workers = [make_worker(server, rank, drain_s=3.0) for rank in (0, 1)]
        gates = [hold_store_thread(worker) for worker in workers]
        for worker in workers:
            worker.register_kv_caches(kv_caches(), NUM_BLOCKS)
            submit_jobs(worker)
        with caplog.at_level(logging.INFO, logger="kvshelf"):
            stoppers = [stop_in_background(worker) for worker in workers]
            for gate in gates:
                gate.set()
            for stopper in stoppers:
                stopper.join(10.0)
        hit = client.lookup(workers[0].pool, HASHES, world_size=2, lock=False)
        assert hit.num_hit_blocks == len(HASHES)
        for rank in (0, 1):
            assert (
                f"kvshelf worker rank {rank} stopped in" in caplog.text
                and "40 queued store jobs committed, 0 aborted" in caplog.text
            )
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_rank_past_the_bound_aborts_and_the_block_is_freed_on_every_rank(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 0 commits every block; rank 1 reaches its queue only after its 0.2 s bound, so it
    aborts every batch: the server frees rank 0's pages of those blocks, and no block is left
    committed by rank 0 only."""
    with ServerProcess(extra_args=["--no-prefault"]) as server, server.client() as client:
        fast, slow = (make_worker(server, rank, drain_s=0.2) for rank in (0, 1))
        held = hold_store_thread(slow)
        for worker in (fast, slow):
            worker.register_kv_caches(kv_caches(), NUM_BLOCKS)
            submit_jobs(worker)
        fast.shutdown()
        assert client.stats()["resident_objects"] == len(HASHES)  # committed by rank 0 only
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="kvshelf"):
            stopper = stop_in_background(slow)
            time.sleep(0.3)  # past the bound
            held.set()
            stopper.join(10.0)
        assert time.monotonic() - started < 0.2 + 1.0 + 0.5
        stats = client.stats()
        assert stats["resident_objects"] == 0
        assert stats["unwhole_dropped_objects_total"] == len(HASHES)
        assert stats["active_reservations"] == 0
        assert client.lookup(fast.pool, HASHES, world_size=2, lock=False).num_hit_blocks == 0
        warning = "kvshelf worker rank 1 stopped in"
        (record,) = [r for r in caplog.records if warning in r.getMessage()]
        assert record.levelno == logging.WARNING
        assert "0 queued store jobs committed, 40 aborted past the 0.2 s drain bound" in (
            record.getMessage()
        )
