"""The worker's helper threads against a real server: the arena prefault and the store thread's
CPUs (in a worker process started with vLLM's OpenMP binding variables)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
import torch

from kvshelf.plan import LoadJob, StoreJob
from kvshelf.roles import store_queue
from kvshelf.roles.worker import WorkerConnector
from testbed.server import ServerProcess, free_port, resident_bytes
from testbed.worker import store_and_lock

NUM_BLOCKS = 64
ARENA_GIB = 1 / 16


def make_worker(server: ServerProcess) -> WorkerConnector:
    return WorkerConnector(
        client_factory=lambda: server.client(timeout_s=5.0),
        model_fingerprint="m",
        layout_fingerprint="l",
        rank=0,
        world_size=1,
        retry_interval_s=0.1,
    )


@pytest.fixture
def kv_caches() -> dict[str, torch.Tensor]:
    return {f"layer{i}": torch.randn(NUM_BLOCKS, 2, 16, 128) for i in range(2)}


@pytest.fixture
def worker_of(kv_caches: dict[str, torch.Tensor]) -> Iterator[object]:
    workers: list[WorkerConnector] = []

    def start(server: ServerProcess) -> WorkerConnector:
        worker = make_worker(server)
        workers.append(worker)
        worker.register_kv_caches(kv_caches, NUM_BLOCKS)
        return worker

    yield start
    for worker in workers:
        worker.shutdown()


def test_worker_prefaults_a_preallocated_arena(worker_of) -> None:
    with ServerProcess(l1_size_gb=ARENA_GIB) as server:
        assert os.stat(server.shm_path).st_blocks * 512 >= ARENA_GIB * 2**30
        worker_of(server)
        deadline = time.monotonic() + 30
        while resident_bytes(path=server.shm_path) < ARENA_GIB * 2**30:
            assert time.monotonic() < deadline, "the worker's mapping was not pre-faulted"
            time.sleep(0.01)


def test_worker_maps_a_lazily_allocated_arena_on_demand(
    worker_of, caplog: pytest.LogCaptureFixture
) -> None:
    with ServerProcess(l1_size_gb=ARENA_GIB, extra_args=["--no-prefault"]) as server:
        with caplog.at_level(logging.DEBUG, logger="kvshelf"):
            worker_of(server)
        assert "not pre-allocated" in caplog.text
        assert resident_bytes(path=server.shm_path) == 0
        # Only the page table header's page (docs/crash-recovery.md); no page of the arena.
        assert os.stat(server.shm_path).st_blocks * 512 == 4096


WORKER = """
import json, logging, os, sys, threading
import torch
from kvshelf.client import KVShelfClient
from kvshelf.plan import StoreJob
from kvshelf.roles import store_queue
from kvshelf.roles.worker import WorkerConnector

port, num_blocks = int(sys.argv[1]), int(sys.argv[2])
logging.basicConfig(level=logging.INFO)
torch.ones(1 << 20).sum()  # the OpenMP runtime is up and the main thread bound, as in vLLM
worker = WorkerConnector(
    client_factory=lambda: KVShelfClient("127.0.0.1", port, timeout_s=5.0),
    model_fingerprint="m", layout_fingerprint="l", rank=0, world_size=1,
)
kv_caches = {f"layer{i}": torch.randn(num_blocks, 2, 16, 128) for i in range(2)}
worker.register_kv_caches(kv_caches, num_blocks)
blocks = tuple(range(1, num_blocks))
worker.submit_stores([StoreJob("r", blocks, tuple(b"%d" % b for b in blocks), 0)])
worker.flush_stores()
threads = {t.name: t for t in threading.enumerate()}
print(json.dumps({
    "store_cpus": sorted(os.sched_getaffinity(threads["kvshelf-store"].native_id)),
    "load_cpus": sorted(os.sched_getaffinity(threads["kvshelf-load"].native_id)),
    "main_cpus": sorted(os.sched_getaffinity(0)),
    "stored": worker.counters["blocks_stored"],
}))
worker.shutdown()
"""


def test_load_and_store_threads_run_on_the_cpus_vllm_leaves_free() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs")
    compute, spare = allowed[:-1], allowed[-1]
    # What vLLM gives a worker with VLLM_CPU_NUM_OF_RESERVED_CPU=1; two OpenMP threads so that
    # a store copy would start a parallel region.
    env = {
        **os.environ,
        "OMP_PLACES": "{" + ",".join(map(str, compute)) + "}",
        "OMP_PROC_BIND": "true",
        "OMP_NUM_THREADS": "2",
    }
    with ServerProcess(l1_size_gb=ARENA_GIB) as server:
        result = subprocess.run(
            [sys.executable, "-c", WORKER, str(server.port), "256"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out == {"store_cpus": [spare], "load_cpus": [spare], "main_cpus": compute, "stored": 255}
    assert result.stderr.count(f"load, settle, store and prefault threads on CPUs {spare},") == 1


def load_layer_by_layer(worker, kv_caches, hit, sources, targets) -> None:
    """Load a hit into ``targets`` as vLLM's attention layers consume it: wait for a layer,
    then read it (it must hold the ``sources`` blocks' data); then settle the step."""
    worker.start_loads([LoadJob("r", targets, (tuple(hit.pages[0]),), hit.lock_id, hit.boot_id)])
    for name, layer in kv_caches.items():
        worker.wait_for_layer(name)
        assert torch.equal(layer[list(targets)], layer[list(sources)]), name
    worker.finish_loads()


def test_loads_fill_each_layer_before_the_forward_reads_it(worker_of, kv_caches) -> None:
    with ServerProcess(l1_size_gb=ARENA_GIB, extra_args=["--no-prefault"]) as server:
        worker = worker_of(server)
        sources = (1, 2, 3, 7, 9)
        hit = store_and_lock(worker, server, sources)
        targets = (40, 41, 42, 50, 60)
        load_layer_by_layer(worker, kv_caches, hit, sources, targets)
        assert worker.take_load_errors() == set()
        assert worker.counters["blocks_loaded"] == len(targets)
        with server.client() as client:
            assert client.stats()["active_locks"] == 0


def test_a_stalled_server_holds_no_step_for_a_lock_release(worker_of, kv_caches) -> None:
    # The server stops while a step loads: the step loop sends the load's lock release and
    # goes on within its release budget instead of waiting out the client's 5 s timeout; the
    # settle thread takes the answer once the server is back.
    with ServerProcess(l1_size_gb=ARENA_GIB, extra_args=["--no-prefault"]) as server:
        worker = worker_of(server)
        sources = (1, 2, 3)
        hit = store_and_lock(worker, server, sources)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            load_layer_by_layer(worker, kv_caches, hit, sources, (40, 41, 42))
            assert time.monotonic() - started < 1.0
            assert worker.take_load_errors() == set()
        finally:
            os.kill(server.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10.0
        while worker.counters["blocks_loaded"] != len(sources):
            assert time.monotonic() < deadline, "the release's answer was never taken"
            time.sleep(0.05)
        with server.client() as client:
            assert client.stats()["active_locks"] == 0


def test_a_step_never_waits_for_the_store_threads_stalled_call(worker_of, kv_caches) -> None:
    # The store thread waits for a stalled server's reply (the worker's client, 5 s timeout)
    # when a step's loads are placed: their lock releases do not queue behind that call.
    with ServerProcess(l1_size_gb=ARENA_GIB, extra_args=["--no-prefault"]) as server:
        worker = worker_of(server)
        sources = (1, 2, 3)
        hit = store_and_lock(worker, server, sources)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            worker.submit_stores([StoreJob("w", (20, 21), (b"w20", b"w21"), 0)])
            time.sleep(0.3)  # the store thread is in its reserve's round trip
            started = time.monotonic()
            load_layer_by_layer(worker, kv_caches, hit, sources, (40, 41, 42))
            assert time.monotonic() - started < 1.0
        finally:
            os.kill(server.pid, signal.SIGCONT)
        deadline = time.monotonic() + 15.0
        while worker.counters["blocks_loaded"] != len(sources):
            assert time.monotonic() < deadline, "the release's answer was never taken"
            time.sleep(0.05)


def test_a_failed_load_marks_its_blocks_and_spares_the_others(worker_of, kv_caches) -> None:
    with ServerProcess(l1_size_gb=ARENA_GIB, extra_args=["--no-prefault"]) as server:
        worker = worker_of(server)
        hit = store_and_lock(worker, server, (1, 2))
        pages = tuple(hit.pages[0])
        with server.client() as client:
            other = client.lookup(worker.pool, [b"h1", b"h2"], world_size=1, lock=True)
        worker.start_loads(
            [
                LoadJob("bad", (30, 31), ((pages[0], 1 << 30),), hit.lock_id, hit.boot_id),
                LoadJob("good", (40, 41), (pages,), other.lock_id, other.boot_id),
            ]
        )
        # A name that is not a KV cache layer waits for every layer.
        worker.wait_for_layer("not-a-layer")
        assert worker.take_load_errors() == {30, 31}
        for layer in kv_caches.values():
            assert torch.equal(layer[[40, 41]], layer[[1, 2]])
        assert worker.counters["blocks_loaded"] == 2
        assert worker.counters["blocks_load_failed"] == 2
        with server.client() as client:
            assert client.stats()["active_locks"] == 0


class StalledLoadThread:
    """Stands for a load thread that gets no CPU: it holds the load thread until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.released = False

    def run(self) -> None:
        self.release.wait(10)
        self.released = True


def test_the_step_loop_copies_the_layers_a_stalled_load_thread_has_not_started(
    worker_of, kv_caches
) -> None:
    with ServerProcess(l1_size_gb=ARENA_GIB, extra_args=["--no-prefault"]) as server:
        worker = worker_of(server)
        sources = (1, 2, 3)
        hit = store_and_lock(worker, server, sources)
        stall = StalledLoadThread()
        worker._loads._batches.put(stall)
        try:
            targets = (20, 21, 22)
            load_layer_by_layer(worker, kv_caches, hit, sources, targets)
            # Every layer was copied while the load thread was still held.
            assert not stall.released
        finally:
            stall.release.set()
        assert worker.take_load_errors() == set()
        assert worker.counters["blocks_loaded"] == len(targets)


def test_a_worker_that_cannot_open_the_arena_logs_one_error_and_serves_without_it(
    worker_of, caplog: pytest.LogCaptureFixture
) -> None:
    with ServerProcess(l1_size_gb=ARENA_GIB) as server:
        # As a worker in another IPC namespace sees it: the arena is not there.
        os.unlink(server.shm_path)
        with caplog.at_level(logging.ERROR, logger="kvshelf"):
            worker = worker_of(server)
            worker.start_loads([])  # the step loop keeps going
            worker.finish_loads()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    message = errors[0].getMessage()
    assert "same IPC namespace" in message and "serving without the cache" in message


def test_queued_store_jobs_go_as_one_batch_and_flush_waits_for_their_commit(kv_caches) -> None:
    with ServerProcess(l1_size_gb=ARENA_GIB, extra_args=["--no-prefault"]) as server:
        worker = make_worker(server)
        blocks = range(1, 41)
        # Queued before the store thread starts: it finds them all waiting.
        worker.submit_stores([StoreJob(f"r{b}", (b,), (b"q%d" % b,), 0) for b in blocks])
        try:
            with server.client() as client:
                requests_before = client.stats()["requests_total"]
                worker.register_kv_caches(kv_caches, NUM_BLOCKS)
                worker.flush_stores()
                # Committed by the time flush_stores returns (the commit was not waited for).
                hit = client.lookup(
                    worker.pool, [b"q%d" % b for b in blocks], world_size=1, lock=False
                )
                assert hit.num_hit_blocks == len(blocks)
                # Register, one reserve, one commit, one ping to confirm it, this stats call.
                assert client.stats()["requests_total"] - requests_before <= 6
            assert worker.counters["blocks_stored"] == len(blocks)
            assert worker.take_completed() == {f"r{b}": 1 for b in blocks}
            assert worker.finished_sending() == set()
        finally:
            worker.shutdown()


def test_batches_queued_behind_each_other_all_commit_and_flush_waits_for_the_last(
    kv_caches, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs queued for several batches: each batch's successor is reserved while it copies
    (its commit is then confirmed by a later reserve's reply); every job is stored and
    counted done, and a lookup right after ``flush_stores`` sees every block."""
    # Batches of 4 pages (a page: 2 layers of 16 KiB), so 40 one-block jobs make 10 batches.
    monkeypatch.setattr(store_queue, "STORE_BATCH_BYTES", 4 * 2 * 16 * 1024)
    with ServerProcess(l1_size_gb=ARENA_GIB, extra_args=["--no-prefault"]) as server:
        worker = make_worker(server)
        blocks = range(1, 41)
        worker.submit_stores([StoreJob(f"r{b}", (b,), (b"p%d" % b,), 0) for b in blocks])
        try:
            with server.client() as client:
                before = client.stats()
                worker.register_kv_caches(kv_caches, NUM_BLOCKS)
                worker.flush_stores()
                hashes = [b"p%d" % b for b in blocks]
                hit = client.lookup(worker.pool, hashes, world_size=1, lock=False)
                assert hit.num_hit_blocks == len(blocks)
                after = client.stats()
                assert after["reservations_total"] - before["reservations_total"] == 10
                # Register, 10 reserves, 10 commits, one ping at the end, a lookup, a stats.
                assert after["requests_total"] - before["requests_total"] <= 24
                # The bytes of the first batches are the blocks'.
                hit = client.lookup(worker.pool, hashes[:3], world_size=1, lock=True)
                load_layer_by_layer(worker, kv_caches, hit, (1, 2, 3), (50, 51, 52))
            assert worker.counters["blocks_stored"] == len(blocks)
            assert worker.counters["stores_dropped"] == 0
            assert worker.take_completed() == {f"r{b}": 1 for b in blocks}
        finally:
            worker.shutdown()


def test_a_worker_reattached_inside_inference_mode_still_stores_and_loads(
    worker_of, kv_caches
) -> None:
    """vLLM runs the forward pass, where ``start_loads`` meets a restarted server and maps its
    new arena, under ``torch.inference_mode``; the store and load threads do not. Tensors made
    there must stay writable from those threads (a bench-chaos run lost every load and store
    after a server restart to "Inplace update to inference tensor outside InferenceMode")."""
    with ServerProcess(l1_size_gb=ARENA_GIB, extra_args=["--no-prefault"]) as server:
        worker = worker_of(server)
        server.restart()
        with server.client(timeout_s=5.0) as client:
            boot_id = client.ping()  # the new boot id, as the scheduler learns it
        with torch.inference_mode():
            # A load of the new boot, which this worker has not attached to yet.
            worker.start_loads([LoadJob("r", (1,), ((0,),), 1, boot_id)])
            worker.finish_loads()
        worker.take_load_errors()
        sources = (1, 2, 3)
        hit = store_and_lock(worker, server, sources, request_id="after-restart")
        assert worker.counters["blocks_stored"] == len(sources)
        load_layer_by_layer(worker, kv_caches, hit, sources, (40, 41, 42))
        assert worker.take_load_errors() == set()


def test_a_step_waits_only_for_queued_stores_that_read_a_block_it_reuses(kv_caches) -> None:
    """vLLM may hand out a block a queued store still reads (a window slid past it, a
    preemption). The step that reuses it waits for that store's copy, so the page gets the
    block's bytes, not the step's; a step that reuses other blocks does not wait at all, even
    while stores are queued (before, a hybrid model's step waited for every queued store)."""
    with ServerProcess(l1_size_gb=ARENA_GIB, extra_args=["--no-prefault"]) as server:
        worker = make_worker(server)
        before = {name: layer[3].clone() for name, layer in kv_caches.items()}
        # Queued before the store thread starts: nothing copies them until it does.
        worker.submit_stores([StoreJob("r", (2, 3), (b"w2", b"w3"), 0)])
        try:
            other_load = LoadJob("s", (12,), ((0,),), 0, "")
            assert not worker.before_reuse([10, 11], [other_load])
            reused = threading.Event()

            def reuse_block_3() -> None:
                assert worker.before_reuse([10, 3])
                reused.set()

            waiter = threading.Thread(target=reuse_block_3)
            waiter.start()
            assert not reused.wait(0.3), "block 3 was reused before its store copied it"
            worker.register_kv_caches(kv_caches, NUM_BLOCKS)
            assert reused.wait(10.0)
            waiter.join()
            for layer in kv_caches.values():
                layer[3].fill_(7.0)  # the step's forward pass
            worker.flush_stores()
            with server.client() as client:
                hit = client.lookup(worker.pool, [b"w3"], world_size=1, lock=True)
            assert hit.num_hit_blocks == 1
            worker.start_loads(
                [LoadJob("r", (40,), (tuple(hit.pages[0]),), hit.lock_id, hit.boot_id)]
            )
            worker.finish_loads()
            assert worker.take_load_errors() == set()
            for name, layer in kv_caches.items():
                assert torch.equal(layer[40], before[name]), name
            assert worker.counters["store_reuse_waits"] == 1
        finally:
            worker.shutdown()


def test_queued_stores_of_two_tenants_go_as_one_reserve_each_naming_its_tenant(
    kv_caches,
) -> None:
    port = free_port()
    with ServerProcess(
        l1_size_gb=ARENA_GIB, extra_args=["--no-prefault", "--metrics-port", str(port)]
    ) as server:
        worker = make_worker(server)
        # Queued before the store thread starts: a tenant change ends the batch.
        worker.submit_stores(
            [
                StoreJob("a1", (1, 2), (b"ta1", b"ta2"), 0, tenant="user-a"),
                StoreJob("a2", (3,), (b"ta3",), 0, tenant="user-a"),
                StoreJob("b1", (4, 5), (b"tb1", b"tb2"), 0, tenant="user-b"),
            ]
        )
        try:
            with server.client() as client:
                reserves_before = client.stats()["reservations_total"]
                worker.register_kv_caches(kv_caches, NUM_BLOCKS)
                worker.flush_stores()
                assert client.stats()["reservations_total"] - reserves_before == 2
            url = f"http://127.0.0.1:{port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
            page_bytes = 2 * 2 * 16 * 128 * 4  # two layers of (2, 16, 128) float32 per block
            assert f'kvshelf_tenant_bytes{{tenant="user-a"}} {3 * page_bytes}.0' in text
            assert f'kvshelf_tenant_bytes{{tenant="user-b"}} {2 * page_bytes}.0' in text
        finally:
            worker.shutdown()
