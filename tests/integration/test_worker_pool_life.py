"""The worker role when the server retires or refuses its pool (kvshelf.server.pool_life), against
real servers: a retired pool is registered again on the next store; a refused registration is
one WARNING naming the cause and a counted metric, never a silent DEBUG line."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from kvshelf.plan import StoreJob
from kvshelf.protocol import PageLayout
from kvshelf.roles.worker import WorkerConnector
from testbed.server import ServerProcess
from testbed.worker import store_and_lock

NUM_BLOCKS = 16


@pytest.fixture
def worker_on() -> Iterator[object]:
    workers: list[WorkerConnector] = []

    def start(server: ServerProcess) -> WorkerConnector:
        worker = WorkerConnector(
            client_factory=lambda: server.client(timeout_s=5.0),
            model_fingerprint="m",
            layout_fingerprint="l",
            rank=0,
            world_size=1,
            retry_interval_s=0.1,
        )
        workers.append(worker)
        caches = {f"layer{i}": torch.randn(NUM_BLOCKS, 2, 16, 128) for i in range(2)}
        worker.register_kv_caches(caches, NUM_BLOCKS)
        return worker

    yield start
    for worker in workers:
        worker.shutdown()


def other_layout(name: str) -> PageLayout:
    return PageLayout(
        model_fingerprint=name, layout_fingerprint="l", page_bytes=4096, world_size=1, rank=0
    )


def test_a_worker_whose_pool_was_retired_registers_it_again(worker_on) -> None:
    with ServerProcess(extra_args=["--max-pools", "2"]) as server, server.client() as other:
        worker = worker_on(server)
        release = store_and_lock(worker, server, (1, 2))
        with server.client() as client:
            client.release(release.lock_id, 0)
        # Two more pools: at the limit the worker's (least recently used, idle) goes.
        other.register(other_layout("x"))
        other.register(other_layout("y"))
        assert other.stats()["pools_retired_total"] == 1
        hit = store_and_lock(worker, server, (3, 4), request_id="after-retirement")
        other.release(hit.lock_id, 0)
        assert worker.snapshot()["stores_dropped"] == 0


def test_a_refused_registration_is_one_warning_and_counted(
    worker_on, caplog: pytest.LogCaptureFixture
) -> None:
    with ServerProcess(extra_args=["--max-pools", "1"]) as server, server.client() as other:
        # The only pool is busy (a reservation in flight), so the worker's cannot make room.
        pool = other.register(other_layout("busy")).pool
        other.reserve(pool, 0, [b"busy-block"])
        with caplog.at_level(logging.DEBUG, logger="kvshelf.roles.server_link"):
            worker = worker_on(server)
            for i in range(3):
                worker.submit_stores([StoreJob(f"r{i}", (i,), (b"h%d" % i,), 0)])
                worker.flush_stores()
        warnings = [
            r for r in caplog.records if r.levelno == logging.WARNING and "refused" in r.message
        ]
        assert len(warnings) == 1, [r.message for r in caplog.records]
        assert "LIMIT_EXCEEDED" in warnings[0].message and worker.pool in warnings[0].message
        counters = worker.snapshot()
        assert counters["registrations_refused"] >= 3
        assert counters["stores_dropped"] == 3
