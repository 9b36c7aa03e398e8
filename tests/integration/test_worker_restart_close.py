"""After a server restart, the worker closes the old boot's arena in the background (its
engine's wait for running copies, the unpinning of every chunk, the unmapping): the step loop
that attached the new boot never waits for it, a close whose wait raises still unpins and
unmaps everything, and an arena retired while vLLM idles (the store thread attached the new
boot) is closed without a step. The CUDA engine's code on CPU tensors, its streams and CUDA
driver faked (a driver library per engine, one device's streams for all); a real server,
restarted (new boot, same port)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch

from kvshelf.plan import LoadJob, StoreJob
from kvshelf.roles.worker import WorkerConnector
from kvshelf.transfer import CudaTransferEngine, engine_override
from kvshelf.transfer.pinned import CudaDriver
from kvshelf.transfer.streams import FakeCudaStreams
from testbed.cuda_driver import FakeCudaDriver
from testbed.server import ServerProcess
from testbed.worker import store_and_lock

NUM_BLOCKS = 32
SOURCES = (1, 2, 3)
TARGETS = (20, 21, 22)


@dataclass
class _Built:
    """One engine the worker built, with its own fake driver library."""

    engine: CudaTransferEngine
    streams: FakeCudaStreams
    library: FakeCudaDriver


@dataclass
class Rig:
    server: ServerProcess
    worker: WorkerConnector
    caches: dict[str, torch.Tensor]
    built: list[_Built] = field(default_factory=list)

    def step(self, job: LoadJob) -> set[int]:
        """One step with one load, as the connector drives it: the failed blocks."""
        self.worker.start_loads([job])
        for name in self.caches:
            self.worker.wait_for_layer(name)
        self.worker.finish_loads()
        return self.worker.take_load_errors()


@pytest.fixture
def rig() -> Iterator[Rig]:
    built: list[_Built] = []
    streams = FakeCudaStreams()

    def engine(kv_caches, layout, arena) -> CudaTransferEngine:
        library = FakeCudaDriver()
        made = CudaTransferEngine(
            kv_caches, layout, arena, streams=streams, driver=CudaDriver(library)
        )
        built.append(_Built(made, streams, library))
        return made

    caches = {f"layer{i}": torch.randn(NUM_BLOCKS, 2, 16, 64) for i in range(2)}
    with ServerProcess(l1_size_gb=1 / 16) as server, engine_override("cpu", engine):
        worker = WorkerConnector(
            client_factory=lambda: server.client(timeout_s=2.0),
            model_fingerprint="m",
            layout_fingerprint="l",
            rank=0,
            world_size=1,
            retry_interval_s=0.05,
        )
        worker.register_kv_caches(caches, NUM_BLOCKS)
        try:
            yield Rig(server, worker, caches, built)
        finally:
            worker.shutdown()


def _eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _restart_after_copies(rig: Rig) -> None:
    """Store and load through the first boot's engine (chunks pinned, copies issued), then
    restart the server."""
    hit = store_and_lock(rig.worker, rig.server, SOURCES)
    job = LoadJob("r", TARGETS, (tuple(hit.pages[0]),), hit.lock_id, hit.boot_id)
    assert rig.step(job) == set()
    assert len(rig.built) == 1 and rig.built[0].library.registered
    rig.server.restart()


def test_the_step_loop_never_waits_for_the_old_arenas_close_and_a_failing_close_unpins_all(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    released, waiting = threading.Event(), threading.Event()

    def stuck_then_failing(event: object) -> None:
        # The old engine's wait for its last copy: seconds on a GPU, then a sticky error.
        if released.is_set():
            return synchronize(event)
        waiting.set()
        released.wait(timeout=30.0)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    _restart_after_copies(rig)
    old = rig.built[0]
    synchronize = old.streams.synchronize
    old.streams.synchronize = stuck_then_failing  # type: ignore[method-assign]
    with rig.server.client() as client:
        client.ping()
        boot = client.boot_id
    assert boot is not None
    # A step whose load names the new boot (the step loop attaches it, retiring the old),
    # and the next step (where the step loop closed the old arena before).
    job = LoadJob("r2", TARGETS, ((0, 1, 2),), 1, boot)
    stepping = threading.Thread(target=lambda: [rig.step(job), rig.step(job)])
    try:
        stepping.start()
        stepping.join(timeout=10.0)
        assert not stepping.is_alive(), "the step loop waited for the old arena's close"
        assert len(rig.built) == 2
        assert waiting.wait(timeout=10.0), "the old arena is not being closed"
        assert old.library.registered, "unpinned before its copies' wait returned"
    finally:
        released.set()
        stepping.join(timeout=10.0)
    with caplog.at_level(logging.ERROR, logger="kvshelf.roles.server_link"):
        assert _eventually(lambda: not old.library.registered), "still pinned"
        assert _eventually(lambda: "could not close the arena" in caplog.text)
    assert old.engine._arena.numel() == 0  # no view of the unmapped arena left


def test_an_arena_retired_while_vllm_idles_is_closed_without_a_step(rig: Rig) -> None:
    _restart_after_copies(rig)
    old = rig.built[0]
    # No step: the store thread attaches the new boot for a store of the last step.
    rig.worker.submit_stores([StoreJob("s", (5,), (b"after-restart",), 0)])
    rig.worker.flush_stores()
    assert len(rig.built) == 2
    assert _eventually(lambda: not old.library.registered), "pinned until the next step"
