"""The worker with the CUDA engine's pinning code on CPU tensors, against a real server: the
arena pinned through a fake CUDA driver library (``FakeCudaDriver``, ``cuda.h``'s ctypes
signatures), the streams faked. A refused registration leaves no error behind (the CUDA
runtime is never called) and the worker serves uncached; a load into pages not pinned yet is a
miss for the step, never a wait; every engine call from the worker's threads runs in the
device scope; an arena alias that cannot be made unpins and disables the cache with one ERROR
line; an engine the store thread builds makes no CUDA call until the step loop starts it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvshelf.client import KVShelfClient
from kvshelf.plan import LoadJob, StoreJob
from kvshelf.roles.worker import WorkerConnector
from kvshelf.transfer import CudaTransferEngine, engine_override
from kvshelf.transfer.pinned import CudaDriver
from kvshelf.transfer.streams import FakeCudaStreams
from testbed.cuda_driver import FakeCudaDriver
from testbed.server import ServerProcess, free_port
from testbed.worker import store_and_lock

NUM_BLOCKS = 32
SOURCES = (1, 2, 3)
TARGETS = (20, 21, 22)


def _worker(server: ServerProcess, caches: dict[str, torch.Tensor]) -> WorkerConnector:
    worker = WorkerConnector(
        client_factory=lambda: server.client(timeout_s=5.0),
        model_fingerprint="m",
        layout_fingerprint="l",
        rank=0,
        world_size=1,
        retry_interval_s=0.1,
    )
    worker.register_kv_caches(caches, NUM_BLOCKS)
    return worker


class Rig:
    """A real server; a CPU-engine worker that stores (``feeder``); the pinning worker under
    test, made by :meth:`pinning_worker` on its own KV caches."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.library = FakeCudaDriver()
        self.streams = FakeCudaStreams()
        self.caches = {f"layer{i}": torch.randn(NUM_BLOCKS, 2, 16, 64) for i in range(2)}
        self.feeder = _worker(server, self.caches)
        self.workers = [self.feeder]
        self.hashes = 0

    def engine(self, kv_caches, layout, arena) -> CudaTransferEngine:
        return CudaTransferEngine(
            kv_caches, layout, arena, streams=self.streams, driver=CudaDriver(self.library)
        )

    def pinning_worker(self) -> tuple[WorkerConnector, dict[str, torch.Tensor]]:
        caches = {name: torch.zeros_like(cache) for name, cache in self.caches.items()}
        with engine_override("cpu", self.engine):
            worker = _worker(self.server, caches)
        self.workers.append(worker)
        return worker, caches

    def hit(self) -> LoadJob:
        hashes = tuple(b"pin-%d" % (self.hashes + i) for i in range(len(SOURCES)))
        self.hashes += len(SOURCES)
        hit = store_and_lock(self.feeder, self.server, SOURCES, hashes)
        return LoadJob("r", TARGETS, (tuple(hit.pages[0]),), hit.lock_id, hit.boot_id)

    def active_locks(self) -> int:
        with self.server.client() as client:
            return client.stats()["active_locks"]

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()


@pytest.fixture
def rig() -> Iterator[Rig]:
    with ServerProcess(l1_size_gb=1 / 16) as server:
        made = Rig(server)
        try:
            yield made
        finally:
            made.close()


def _eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _step(worker: WorkerConnector, job: LoadJob) -> set[int]:
    """One step with one load, as the connector drives it: the failed blocks it reports."""
    worker.start_loads([job])
    for name in ("layer0", "layer1"):
        worker.wait_for_layer(name)
    worker.finish_loads()
    return worker.take_load_errors()


def test_a_refused_registration_leaves_no_error_behind_and_the_worker_serves_uncached(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def runtime(*args: object) -> None:
        raise AssertionError("the CUDA runtime was called: its per-thread error may be set")

    monkeypatch.setattr(torch.cuda, "cudart", runtime)
    rig.library.refuse_all = True
    with caplog.at_level(logging.WARNING, logger="kvshelf"):
        worker, _ = rig.pinning_worker()
        assert _eventually(lambda: len(rig.library.calls_to("cuMemHostRegister_v2")) == 1)
        assert _step(worker, rig.hit()) == set(TARGETS)  # a miss: vLLM recomputes
        assert rig.active_locks() == 0
        for i in range(2):
            worker.submit_stores([StoreJob("s", (4, 5), (b"s4%d" % i, b"s5%d" % i), 0)])
            worker.flush_stores()
    assert worker.counters["stores_dropped"] == 2
    # One WARNING for the refused chunk (never asked again), no ERROR: the cache is optional.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    refusals = [r.getMessage() for r in caplog.records if "ulimit -l" in r.getMessage()]
    assert len(refusals) == 1 and "CUDA_ERROR_OUT_OF_MEMORY" in refusals[0], refusals
    assert len(rig.library.calls_to("cuMemHostRegister_v2")) == 1
    with rig.server.client() as client:
        assert client.lookup(worker.pool, [b"s40"], world_size=1, lock=False).num_hit_blocks == 0
    assert rig.library.registered == {}


def test_a_load_into_pages_not_pinned_yet_is_a_miss_without_a_wait(rig: Rig) -> None:
    rig.library.gate.clear()  # the background registration of chunk 0 takes its time
    worker, caches = rig.pinning_worker()
    assert rig.library.entered.wait(10)
    started = time.monotonic()
    assert _step(worker, rig.hit()) == set(TARGETS)
    assert time.monotonic() - started < 5  # the registration still runs: no wait for it
    assert rig.active_locks() == 0
    assert worker.counters["blocks_load_failed"] == len(TARGETS)
    rig.library.gate.set()
    assert _eventually(lambda: len(rig.library.registered) == 1)
    assert _step(worker, rig.hit()) == set()
    for name, cache in caches.items():
        assert torch.equal(cache[list(TARGETS)], rig.caches[name][list(SOURCES)])
    assert worker.counters["blocks_loaded"] == len(TARGETS)


def test_every_engine_call_from_the_workers_threads_runs_in_the_device_scope(rig: Rig) -> None:
    worker, _ = rig.pinning_worker()
    assert _eventually(lambda: len(rig.library.registered) == 1)
    assert _step(worker, rig.hit()) == set()
    worker.submit_stores([StoreJob("s", (4,), (b"scoped",), 0)])
    worker.flush_stores()
    assert worker.counters["blocks_stored"] == 1
    worker.shutdown()
    assert {c[0] for c in rig.streams.calls} >= {"record", "wait", "copy", "synchronize"}
    assert rig.streams.unscoped == []
    assert rig.library.registered == {}
    registrations = rig.library.calls_to("cuMemHostRegister_v2")
    assert registrations and all(call.device == 0 for call in registrations)


def test_an_alias_that_cannot_be_made_unpins_and_disables_the_cache_with_one_error(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_numpy(pages: torch.Tensor, device: torch.device) -> torch.Tensor:
        raise RuntimeError("Numpy is not available")  # what torch.as_tensor raised without it

    monkeypatch.setattr("kvshelf.transfer.cuda.host_alias", no_numpy)
    with caplog.at_level(logging.ERROR, logger="kvshelf"):
        worker, _ = rig.pinning_worker()
        assert _step(worker, rig.hit()) == set(TARGETS)
        worker.submit_stores([StoreJob("s", (4,), (b"s4",), 0)])
        worker.flush_stores()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "Numpy is not available" in errors[0], errors
    assert "serving without the cache" in errors[0]
    time.sleep(0.2)
    assert rig.library.registered == {}
    registered = len(rig.library.calls_to("cuMemHostRegister_v2"))
    assert registered == len(rig.library.calls_to("cuMemHostUnregister"))
    assert rig.active_locks() == 0


def test_an_engine_attached_by_the_store_thread_makes_no_cuda_call_until_the_next_step() -> None:
    """vLLM captures CUDA graphs after registering its KV caches, in torch's global capture
    mode, where a CUDA call of another thread can invalidate the capture. A server that comes
    up then is attached by the store thread: the engine it builds makes no CUDA call (no
    stream, no alias, no pinning, no pin thread) until vLLM's next step starts it."""
    library = FakeCudaDriver()
    driver = CudaDriver(library)  # cuInit, here and now
    streams = FakeCudaStreams()
    built: list[str] = []

    def engine(kv_caches, layout, arena) -> CudaTransferEngine:
        built.append(threading.current_thread().name)
        return CudaTransferEngine(
            kv_caches, layout, arena, streams=streams, driver=driver, defer_start=True
        )

    port = free_port()
    caches = {f"layer{i}": torch.zeros(NUM_BLOCKS, 2, 16, 64) for i in range(2)}
    with engine_override("cpu", engine):
        worker = WorkerConnector(
            client_factory=lambda: KVShelfClient("127.0.0.1", port, timeout_s=1.0),
            model_fingerprint="m",
            layout_fingerprint="l",
            rank=0,
            world_size=1,
            retry_interval_s=0.05,
        )
        worker.register_kv_caches(caches, NUM_BLOCKS)  # no server yet: nothing attached
    before = len(library.calls)
    try:
        with ServerProcess(l1_size_gb=1 / 16, port=port) as server:
            assert _eventually(lambda: built == ["kvshelf-store"])
            time.sleep(0.3)  # what a pin thread or a stream would have done by now
            assert library.calls[before:] == [] and streams.calls == []
            assert "kvshelf-pin" not in {t.name for t in threading.enumerate()}
            # vLLM's next step: the engine starts on the step loop, chunk 0 is asked for.
            worker.start_loads([])
            worker.finish_loads()
            assert _eventually(lambda: len(library.registered) == 1)
            step_loop = threading.current_thread().name
            threads = {call.thread for call in library.calls[before:]}
            assert threads <= {step_loop, "kvshelf-pin"}, threads
            worker.submit_stores([StoreJob("s", (4,), (b"after-start",), 0)])
            worker.flush_stores()
            assert worker.counters["blocks_stored"] == 1
            with server.client() as client:
                hit = client.lookup(worker.pool, [b"after-start"], world_size=1, lock=False)
            assert hit.num_hit_blocks == 1
    finally:
        worker.shutdown()
    assert library.registered == {}
