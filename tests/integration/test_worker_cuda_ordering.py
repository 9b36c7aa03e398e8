"""The worker role with the CUDA engine's code (its streams faked on CPU tensors) against a real
server: a store copies after the step's forward fence (a batch of several steps' stores after
the last step's fence) and is committed only after its copy event; loads wait per layer on
that layer's event; a full-graph step has every layer in place before the forward pass; every
loaded block is bit-exact."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvshelf.client import KVShelfClient
from kvshelf.plan import LoadJob, StoreJob
from kvshelf.roles.worker import WorkerConnector
from kvshelf.transfer import CudaTransferEngine, engine_override
from kvshelf.transfer.streams import FakeCudaStreams
from testbed.kv_layouts import make_kv_caches
from testbed.server import ServerProcess
from testbed.worker import store_and_lock

NUM_BLOCKS = 32
LAYERS = 4


class _Gate:
    """Holds the store thread in its reserve call while ``opened`` is clear."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.opened.set()
        self.reached = threading.Event()


class _LoggingClient(KVShelfClient):
    """A real client that also logs its commits among the fake streams' calls; each reserve
    waits for its gate to be open (it is, unless a test closes it)."""

    calls: list[tuple[object, ...]]
    gate: _Gate

    def reserve(self, *args: object, **kwargs: object):
        self.gate.reached.set()
        self.gate.opened.wait(timeout=10.0)
        return super().reserve(*args, **kwargs)

    def commit_nowait(self, reservation_id: int) -> None:
        self.calls.append(("commit", reservation_id))
        super().commit_nowait(reservation_id)


@pytest.fixture
def reserve_gate() -> _Gate:
    return _Gate()


@pytest.fixture
def rig(
    reserve_gate: _Gate,
) -> Iterator[tuple[WorkerConnector, FakeCudaStreams, dict[str, torch.Tensor], object]]:
    streams = FakeCudaStreams()

    def engine(kv_caches, layout, arena):
        return CudaTransferEngine(kv_caches, layout, arena, streams=streams)

    def client() -> KVShelfClient:
        made = _LoggingClient(server.host, server.port, timeout_s=5.0)
        made.calls = streams.calls
        made.gate = reserve_gate
        return made

    caches = make_kv_caches(
        "LBNHC", num_layers=LAYERS, num_blocks=NUM_BLOCKS, heads=2, tokens=16, content=64
    )
    with ServerProcess(l1_size_gb=1 / 16) as server, engine_override("cpu", engine):
        worker = WorkerConnector(client, "m", "l", rank=0, world_size=1, retry_interval_s=0.1)
        worker.register_kv_caches(caches, NUM_BLOCKS)
        try:
            yield worker, streams, caches, server
        finally:
            worker.shutdown()


def _store(worker: WorkerConnector, server: ServerProcess, blocks: tuple[int, ...]) -> LoadJob:
    hit = store_and_lock(worker, server, blocks)
    return LoadJob("r", (), (tuple(hit.pages[0]),), hit.lock_id, hit.boot_id)


def _bytes(caches: dict[str, torch.Tensor], block: int) -> list[torch.Tensor]:
    return [t[block].contiguous().view(torch.uint8) for t in caches.values()]


def test_store_copies_after_the_forward_fence_and_commits_after_its_event(rig) -> None:
    worker, streams, _, server = rig
    _store(worker, server, (3, 4, 9))
    calls = streams.calls
    fence = next(c[2] for c in calls if c[:2] == ("record", "compute"))
    wait = calls.index(("wait", "store", fence))
    done = next(i for i, c in enumerate(calls) if c[:2] == ("record", "store"))
    synchronized = calls.index(("synchronize", calls[done][2]))
    commit = next(i for i, c in enumerate(calls) if c[0] == "commit")
    copies = [i for i, c in enumerate(calls) if c[0] == "copy"]
    assert calls.index(("record", "compute", fence)) < wait < min(copies)
    assert max(copies) < done < synchronized < commit


def test_a_batch_of_several_steps_copies_after_the_last_fence_and_commits_once(
    rig, reserve_gate: _Gate
) -> None:
    worker, streams, _, server = rig
    reserve_gate.opened.clear()
    reserve_gate.reached.clear()
    worker.submit_stores([StoreJob("a", (1,), (b"a1",), 0)])
    # The store thread holds "a" alone in its reserve while "b" and "c" queue up.
    assert reserve_gate.reached.wait(timeout=10.0)
    worker.submit_stores([StoreJob("b", (2,), (b"b2",), 0)])
    worker.submit_stores([StoreJob("c", (3,), (b"c3",), 0)])
    before = len(streams.calls)
    reserve_gate.opened.set()
    worker.flush_stores()
    fences = [c[2] for c in streams.calls[:before] if c[:2] == ("record", "compute")]
    assert len(fences) == 3
    calls = streams.calls[before:]
    # "a" alone, then "b" and "c" as one batch, after "c"'s fence only: staged (one copy per
    # layer), then sent (one DMA for their run of pages).
    assert [c[2] for c in calls if c[:2] == ("wait", "store")] == [fences[0], fences[2]]
    second = calls.index(("wait", "store", fences[2]))
    copies = [i for i, c in enumerate(calls) if c[0] == "copy" and i > second]
    staged = [f"stage layer {i} x2" for i in range(LAYERS)]
    assert [calls[i][2] for i in copies] == [*staged, "pages x2"]
    done = next(i for i, c in enumerate(calls) if c[:2] == ("record", "store") and i > second)
    commits = [i for i, c in enumerate(calls) if c[0] == "commit"]
    assert len(commits) == 2 and max(copies) < done < commits[1]
    assert calls.index(("synchronize", calls[done][2])) < commits[1]
    with server.client(timeout_s=30.0) as client:
        hit = client.lookup(worker.pool, [b"a1", b"b2", b"c3"], world_size=1, lock=False)
    assert hit.num_hit_blocks == 3


def test_the_next_batch_is_copying_before_the_store_thread_waits_for_the_first(
    rig, reserve_gate: _Gate
) -> None:
    """Two store batches in flight: the second batch's copy is issued (its event recorded)
    before the store thread waits on the host for the first batch's copy, so the device has
    the next copy queued behind the one it runs; commits stay in order, each after its own
    copy's event, and every page is stored."""
    worker, streams, _, server = rig
    streams.late = True  # a copy runs only once the host waits for it
    reserve_gate.opened.clear()
    reserve_gate.reached.clear()
    worker.submit_stores([StoreJob("a", (1, 2), (b"a1", b"a2"), 0)])
    # The store thread holds "a" in its reserve while "b" queues up: two batches.
    assert reserve_gate.reached.wait(timeout=10.0)
    worker.submit_stores([StoreJob("b", (3,), (b"b3",), 0)])
    before = len(streams.calls)
    reserve_gate.opened.set()
    worker.flush_stores()
    calls = streams.calls[before:]
    events = [c[2] for c in calls if c[:2] == ("record", "store")]
    assert len(events) == 2
    first_done, second_done = (calls.index(("record", "store", e)) for e in events)
    first_waited, second_waited = (calls.index(("synchronize", e)) for e in events)
    commits = [i for i, c in enumerate(calls) if c[0] == "commit"]
    assert first_done < second_done < first_waited < commits[0] < second_waited < commits[1]
    with server.client(timeout_s=30.0) as client:
        hit = client.lookup(worker.pool, [b"a1", b"a2", b"b3"], world_size=1, lock=False)
    assert hit.num_hit_blocks == 3


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "full-graph"])
def test_loads_are_bit_exact_and_wait_per_layer(rig, layerwise: bool) -> None:
    worker, streams, caches, server = rig
    sources = (1, 2, 3, 7, 9)
    job = _store(worker, server, sources)
    targets = (20, 21, 25, 26, 30)
    job = LoadJob("r", targets, job.pages, job.lock_id, job.boot_id)
    before = len(streams.calls)
    worker.start_loads([job], layerwise=layerwise)
    if layerwise:
        for name in caches:
            worker.wait_for_layer(name)
    worker.finish_loads()
    assert worker.take_load_errors() == set()
    calls = streams.calls[before:]
    events = [c[2] for c in calls if c[:2] == ("record", "load")]
    waits = [c[2] for c in calls if c[:2] == ("wait", "compute")]
    # Layer-wise: one wait per layer, each on its own layer's event; a full-graph step: the
    # compute stream waits for the last layer (so for all) before the forward pass.
    assert waits[: len(events) if layerwise else 1] == (events if layerwise else events[-1:])
    for source, target in zip(sources, targets, strict=True):
        assert all(
            torch.equal(a, b)
            for a, b in zip(_bytes(caches, source), _bytes(caches, target), strict=True)
        )


def test_a_step_of_many_hits_copies_each_layer_once(rig) -> None:
    """Eight requests' hits loaded in one step: one copy launch per layer for all of them
    (their index pairs merged), not one per hit and layer; every block bit-exact."""
    worker, streams, caches, server = rig
    sources = tuple(range(8))
    hits = [_store(worker, server, (block,)) for block in sources]
    targets = tuple(range(16, 24))
    jobs = [
        LoadJob(f"r{i}", (target,), hit.pages, hit.lock_id, hit.boot_id)
        for i, (target, hit) in enumerate(zip(targets, hits, strict=True))
    ]
    before = len(streams.calls)
    worker.start_loads(jobs, layerwise=True)
    for name in caches:
        worker.wait_for_layer(name)
    worker.finish_loads()
    assert worker.take_load_errors() == set()
    copies = [c for c in streams.calls[before:] if c[:2] == ("copy", "load")]
    assert [c[2] for c in copies] == [f"layer {i} x8" for i in range(LAYERS)]
    for source, target in zip(sources, targets, strict=True):
        assert all(
            torch.equal(a, b)
            for a, b in zip(_bytes(caches, source), _bytes(caches, target), strict=True)
        )


def test_a_step_reusing_a_block_a_store_is_copying_waits_on_the_device(
    rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that reuses a block whose store copy is issued but not finished makes the
    compute stream wait for the copy's event: the step loop never waits on the host."""
    worker, streams, _, _ = rig
    streams.late = True  # the copy finishes when the store thread synchronizes, not before
    held, reached = threading.Event(), threading.Event()
    synchronize = streams.synchronize

    def held_synchronize(event: object) -> None:
        if threading.current_thread().name == "kvshelf-store":
            reached.set()
            held.wait(timeout=10.0)
        synchronize(event)

    monkeypatch.setattr(streams, "synchronize", held_synchronize)
    worker.submit_stores([StoreJob("a", (5,), (b"a5",), 0)])
    try:
        assert reached.wait(timeout=10.0), "the store thread never waited for its copy"
        before = len(streams.calls)
        assert worker.before_reuse([5])
        copied = next(c[2] for c in streams.calls if c[:2] == ("record", "store"))
        assert streams.calls[before:] == [("wait", "compute", copied)]
        assert not worker.before_reuse([6])
    finally:
        held.set()
    worker.flush_stores()
    assert [name for name, _ in streams.host_waits] == ["kvshelf-store"]
    assert streams.unscoped == []


def test_finish_loads_puts_every_layer_in_place_whatever_the_forward_pass_waited_for(
    rig,
) -> None:
    """``finish_loads`` (vLLM's ``wait_for_save``) enqueues every layer's copies and makes
    the compute stream wait for the last one, even for layers the forward pass never waited
    for and the load thread has not reached (it gets no CPU): the blocks then hold every
    layer's bytes for the next step, and the load's lock is released once they are copied."""
    worker, streams, caches, server = rig
    sources = (1, 2, 3)
    job = _store(worker, server, sources)
    targets = (20, 21, 22)
    job = LoadJob("r", targets, job.pages, job.lock_id, job.boot_id)
    release = threading.Event()

    class _Stalled:
        def run(self) -> None:
            release.wait(timeout=10.0)

    worker._loads._batches.put(_Stalled())
    try:
        before = len(streams.calls)
        worker.start_loads([job], layerwise=True)
        worker.wait_for_layer(next(iter(caches)))  # the forward pass waits for layer 0 only
        worker.finish_loads()
        calls = streams.calls[before:]
        events = [c[2] for c in calls if c[:2] == ("record", "load")]
        assert len(events) == LAYERS
        assert ("wait", "compute", events[-1]) in calls
        for source, target in zip(sources, targets, strict=True):
            assert all(
                torch.equal(a, b)
                for a, b in zip(_bytes(caches, source), _bytes(caches, target), strict=True)
            )
        assert worker.take_load_errors() == set()
        assert worker.counters["blocks_loaded"] == len(targets)
    finally:
        release.set()
