"""The CUDA engine's code on CPU tensors, its streams faked (`FakeCudaStreams`): bytes and the
stream/event order (stores after the forward fence, one event per loaded layer, a layer's wait
on that layer's event only, DMA runs for block-compact caches); with a fake CUDA driver
(`FakeCudaDriver`), pinning: close racing a store, loads into pages not pinned yet."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from kvshelf.transfer import (
    CudaTransferEngine,
    KVCacheLayout,
    NotReady,
    UnsupportedKVCache,
    staging,
)
from kvshelf.transfer.cuda import NotPinned
from kvshelf.transfer.pinned import CudaDriver
from kvshelf.transfer.streams import (
    HIGH_PRIORITY,
    LOW_PRIORITY,
    CudaStreams,
    FakeCudaStreams,
    FakeEvent,
)
from testbed.cuda_driver import FakeCudaDriver
from testbed.kv_layouts import STRIDE_ORDERS, make_kv_caches

NUM_BLOCKS = 16
LAYERS = 3


def _engine(name: str, fill: bool = True):
    caches = make_kv_caches(
        name, num_layers=LAYERS, num_blocks=NUM_BLOCKS, heads=2, tokens=8, content=32, fill=fill
    )
    layout = KVCacheLayout.from_kv_caches(caches, NUM_BLOCKS)
    streams = FakeCudaStreams()
    return caches, layout, streams


def _bytes(caches, block: int) -> list[torch.Tensor]:
    return [t[block].contiguous().view(torch.uint8) for t in caches.values()]


@pytest.mark.parametrize("name", sorted(STRIDE_ORDERS))
@pytest.mark.parametrize("blocks", [[3, 4, 5, 6], [9, 1, 14, 6, 2, 11]], ids=["run", "random"])
def test_round_trip_bit_exact_through_the_cuda_engine_code(name: str, blocks: list[int]) -> None:
    caches, layout, streams = _engine(name)
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    engine = CudaTransferEngine(caches, layout, arena, streams=streams)
    pages = [p + 4 for p in range(len(blocks))]
    engine.store(blocks, pages, after=engine.forward_fence()).wait()
    restored, _, _ = _engine(name, fill=False)
    back = CudaTransferEngine(restored, layout, arena, streams=streams)
    targets = list(range(len(blocks)))
    copying = back.begin_loads([(pages, targets)])
    copying.run()
    copying.wait_all()
    assert copying.failures() == {}
    for source, target in zip(blocks, targets, strict=True):
        assert all(
            torch.equal(a, b)
            for a, b in zip(_bytes(caches, source), _bytes(restored, target), strict=True)
        )
    engine.close()
    back.close()


def test_a_store_waits_on_the_forward_fence_and_its_event_says_when_to_commit() -> None:
    caches, layout, streams = _engine("LBNHC")
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    engine = CudaTransferEngine(caches, layout, arena, streams=streams)
    fence = engine.forward_fence()
    handle = engine.store([1, 5, 2], [0, 7, 3], after=fence)
    handle.wait()
    calls = streams.calls
    assert calls[0] == ("record", "compute", fence)
    assert calls[1] == ("wait", "store", fence)
    copies = [c for c in calls if c[0] == "copy"]
    assert [c[1] for c in copies] == ["store"] * LAYERS  # one kernel pair per layer, no loop
    done = calls[-2]
    assert done[:2] == ("record", "store") and calls[-1] == ("synchronize", done[2])
    assert calls.index(copies[-1]) < calls.index(done)


def test_a_store_without_fence_waits_for_the_whole_device() -> None:
    caches, layout, streams = _engine("LBNHC")
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    CudaTransferEngine(caches, layout, arena, streams=streams).store([1], [0])
    assert streams.calls[0] == ("synchronize_device",)


def test_layer_waits_wait_on_their_own_layer_event_only() -> None:
    caches, layout, streams = _engine("LBNHC")
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    engine = CudaTransferEngine(caches, layout, arena, streams=streams)
    copying = engine.begin_loads([([0, 1], [4, 5]), ([2], [9])])
    began = streams.calls[-1][2]
    assert streams.calls[-1] == ("record", "compute", began)
    copying.run()
    events = [c[2] for c in streams.calls if c[:2] == ("record", "load")]
    assert len(events) == LAYERS
    # Layer 0 first waits for the compute stream's work issued before the loads began.
    loads = [c for c in streams.calls if c[1] == "load"]
    assert loads[0] == ("wait", "load", began)
    # Per layer: one copy for both loads (merged), then that layer's event.
    assert [c[0] for c in loads[1:]] == ["copy", "record"] * LAYERS
    before = len(streams.calls)
    for layer in (2, 0, 1):
        copying.wait_layer(layer)
    assert streams.calls[before:] == [("wait", "compute", events[i]) for i in (2, 0, 1)]
    copying.wait_all()
    assert streams.calls[-2:] == [("wait", "compute", events[-1]), ("synchronize", events[-1])]


def test_a_step_of_many_loads_launches_one_copy_per_layer_bit_exact() -> None:
    """64 hits of a step are one index pair: a gather/scatter per layer, not per hit and
    layer (80 layers x 64 hits were 5,120 kernel pairs a step); a refused load fails alone."""
    caches, layout, streams = _engine("LBNHC")
    num_pages = 2 * NUM_BLOCKS
    arena = torch.zeros(num_pages * layout.page_bytes, dtype=torch.uint8)
    engine = CudaTransferEngine(caches, layout, arena, streams=streams)
    engine.store(list(range(NUM_BLOCKS)), list(range(NUM_BLOCKS)), after=None).wait()
    restored, _, _ = _engine("LBNHC", fill=False)
    back = CudaTransferEngine(restored, layout, arena, streams=streams)
    # 15 one-block hits, page p into block 15 - p, and one hit out of range.
    loads = [([p], [NUM_BLOCKS - 1 - p]) for p in range(NUM_BLOCKS - 1)]
    loads.insert(3, ([num_pages], [NUM_BLOCKS - 1]))
    streams.calls.clear()
    copying = back.begin_loads(loads)
    copying.run()
    copying.wait_all()
    copies = [c for c in streams.calls if c[0] == "copy"]
    assert copies == [("copy", "load", f"layer {i} x{NUM_BLOCKS - 1}") for i in range(LAYERS)]
    assert set(copying.failures()) == {3}
    for page in range(NUM_BLOCKS - 1):
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                _bytes(caches, page), _bytes(restored, NUM_BLOCKS - 1 - page), strict=True
            )
        )
    engine.close()
    back.close()


def test_loads_of_a_step_writing_the_same_block_fail_after_the_first() -> None:
    caches, layout, streams = _engine("LBNHC")
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    engine = CudaTransferEngine(caches, layout, arena, streams=streams)
    copying = engine.begin_loads([([0, 1], [4, 5]), ([2], [5]), ([3], [6])])
    copying.run()
    copying.wait_all()
    failures = copying.failures()
    assert set(failures) == {1}
    assert "another load of the step" in str(failures[1])
    engine.close()


def test_a_wait_before_the_load_thread_runs_enqueues_the_layers_itself() -> None:
    caches, layout, streams = _engine("LBHNC")
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    engine = CudaTransferEngine(caches, layout, arena, streams=streams)
    copying = engine.begin_loads([([0], [4])])
    copying.wait_layer(1)
    records = [c for c in streams.calls if c[:2] == ("record", "load")]
    assert len(records) == 2  # layers 0 and 1 only
    assert streams.calls[-1] == ("wait", "compute", records[1][2])
    copying.run()  # the load thread, late: enqueues the last layer only
    assert len([c for c in streams.calls if c[:2] == ("record", "load")]) == LAYERS


def test_block_compact_caches_copy_runs_as_one_dma_each_and_random_blocks_by_kernel() -> None:
    caches, layout, streams = _engine("BLNHC")
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    engine = CudaTransferEngine(caches, layout, arena, streams=streams)
    assert engine.block_compact
    engine.store([2, 3, 4, 10, 11], [5, 6, 7, 0, 1], after=None)
    assert [c[2] for c in streams.calls if c[0] == "copy"] == ["pages x2", "pages x3"]
    streams.calls.clear()
    scattered = list(range(0, NUM_BLOCKS, 2))
    engine.store(scattered, list(range(len(scattered)))[::-1], after=None)
    assert [c[2] for c in streams.calls if c[0] == "copy"] == [f"pages x{len(scattered)} (kernel)"]
    assert not CudaTransferEngine(*_engine("LBNHC")[:2], arena, streams=streams).block_compact


def test_bad_loads_fail_alone_and_bad_stores_raise() -> None:
    caches, layout, streams = _engine("LBNHC")
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    engine = CudaTransferEngine(caches, layout, arena, streams=streams)
    copying = engine.begin_loads([([0], [NUM_BLOCKS]), ([1], [2])])
    copying.wait_all()
    assert list(copying.failures()) == [0]
    with pytest.raises(ValueError, match="duplicate"):
        engine.store([1, 2], [3, 3])
    engine.close()
    with pytest.raises(ValueError, match="closed"):
        engine.store([1], [3])
    late = engine.begin_loads([([0], [1])])
    late.wait_all()
    assert list(late.failures()) == [0]
    assert isinstance(streams.calls[0][2], FakeEvent)


def test_close_racing_a_store_waits_for_its_registration_and_registers_nothing_after() -> None:
    caches, layout, streams = _engine("LBNHC")
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    library = FakeCudaDriver()
    library.gate.clear()  # the registration of chunk 0 (asked at construction) takes its time
    engine = CudaTransferEngine(caches, layout, arena, streams=streams, driver=CudaDriver(library))
    assert library.entered.wait(10)
    outcome: list[BaseException | None] = []

    def store() -> None:
        try:
            engine.store([1], [0], after=engine.forward_fence())
            outcome.append(None)
        except ValueError as exc:
            outcome.append(exc)

    storing = threading.Thread(target=store, name="kvshelf-store")
    storing.start()
    threading.Timer(0.2, library.gate.set).start()
    engine.close()  # waits for the registration in flight, then unregisters it
    storing.join(10)
    assert isinstance(outcome[0], ValueError)  # the store found the arena closing
    assert library.registered == {}
    assert len(library.calls_to("cuMemHostRegister_v2")) == 1


def test_a_load_whose_pages_are_not_pinned_yet_fails_at_once_and_pins_in_the_background() -> None:
    caches, layout, streams = _engine("LBNHC")
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    library = FakeCudaDriver()
    library.gate.clear()
    engine = CudaTransferEngine(caches, layout, arena, streams=streams, driver=CudaDriver(library))
    copying = engine.begin_loads([([0, 1], [4, 5])])
    copying.wait_all()
    assert isinstance(copying.failures()[0], NotPinned)
    library.gate.set()
    deadline = time.monotonic() + 10
    while not library.registered and time.monotonic() < deadline:
        time.sleep(0.01)
    copying = engine.begin_loads([([0, 1], [4, 5])])
    copying.wait_all()
    assert copying.failures() == {}
    engine.close()
    assert library.registered == {}


def test_the_late_fake_device_runs_work_after_it_is_queued_and_compute_runs_ahead() -> None:
    streams = FakeCudaStreams(late=True)
    data = torch.zeros(4)
    streams.open({"load": 0})
    copied = streams.enqueue("load", None, lambda: data.fill_(1))
    assert not streams.query(copied)  # queued, not run
    seen: list[torch.Tensor] = []
    streams.launch(lambda: seen.append(data.clone()))  # a read not ordered after the copy
    streams.compute_wait(copied)
    streams.launch(lambda: seen.append(data.clone()))  # a read that waits for it
    streams.run_device()
    assert streams.query(copied)
    assert seen[0].sum() == 0 and seen[1].sum() == 4


def test_a_deferred_engine_copies_nothing_until_started_and_remembers_a_failed_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Built with ``defer_start`` (the worker's engines), the engine makes no CUDA call until
    ``start``: stores and loads before it are refused as not ready (dropped, missed); a start
    that fails fails the same way every time, and nothing stays pinned."""
    caches, layout, streams = _engine("LBNHC")
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    library = FakeCudaDriver()
    driver = CudaDriver(library)
    calls = len(library.calls)
    engine = CudaTransferEngine(
        caches, layout, arena, streams=streams, driver=driver, defer_start=True
    )
    assert engine.forward_fence() is None
    with pytest.raises(NotReady, match="next step"):
        engine.store([1], [0])
    copying = engine.begin_loads([([0], [2])])
    assert isinstance(copying.failures()[0], NotReady)
    assert streams.calls == [] and library.calls[calls:] == []
    engine.start()
    engine.start()  # once only
    engine.store([1], [3], after=engine.forward_fence()).wait()
    assert library.calls_to("cuMemHostRegister_v2") and streams.calls
    engine.close()
    assert library.registered == {}

    def no_alias(pages: torch.Tensor, device: torch.device) -> torch.Tensor:
        raise RuntimeError("no alias here")

    monkeypatch.setattr("kvshelf.transfer.cuda.host_alias", no_alias)
    failing = CudaTransferEngine(
        caches, layout, arena, streams=streams, driver=driver, defer_start=True
    )
    for _ in range(2):
        with pytest.raises(UnsupportedKVCache, match="no alias here"):
            failing.start()
    with pytest.raises(NotReady, match="no alias here"):
        failing.store([1], [0])
    failing.close()
    assert library.registered == {}


def test_a_close_whose_wait_fails_still_unpins_every_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wait for a copy still running that raises in close (a sticky CUDA error, say) still
    unregisters every chunk and drops every view of the arena: the worker unmaps it next."""
    caches, layout, _ = _engine("LBNHC")
    streams = FakeCudaStreams(late=True)
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    library = FakeCudaDriver()
    engine = CudaTransferEngine(caches, layout, arena, streams=streams, driver=CudaDriver(library))
    engine.store([1], [0], after=engine.forward_fence())  # its copy has not run yet
    assert library.registered

    def failing(event: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(streams, "synchronize", failing)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.close()
    assert library.registered == {}


def test_a_layer_wait_does_not_wait_for_the_layers_the_load_thread_enqueues_after_it() -> None:
    """The load thread enqueues layer after layer; the step loop's wait for layer 0 returns
    once layer 0 is enqueued, even while the load thread is held enqueuing layer 1 (before,
    it held the load's lock across every layer, and the first attention layer waited for
    them all)."""
    caches, layout, streams = _engine("LBNHC")
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    engine = CudaTransferEngine(caches, layout, arena, streams=streams)
    engine.store([1, 2], [0, 1], after=engine.forward_fence()).wait()
    copying = engine.begin_loads([([0, 1], [5, 6])])
    submit = engine.submit
    layer_1, hold = threading.Event(), threading.Event()
    calls = 0

    def held_submit(*args, **kwargs):
        nonlocal calls
        calls += 1
        if threading.current_thread().name == "loader" and calls == 2:
            layer_1.set()
            hold.wait(timeout=10.0)
        return submit(*args, **kwargs)

    engine.submit = held_submit
    loader = threading.Thread(target=copying.run, name="loader")
    loader.start()
    try:
        assert layer_1.wait(timeout=10.0)
        waiter = threading.Thread(target=copying.wait_layer, args=(0,))
        waiter.start()
        waiter.join(timeout=5.0)
        assert not waiter.is_alive(), "the wait for layer 0 waited for layer 1's enqueue"
    finally:
        hold.set()
        loader.join(timeout=10.0)
    copying.wait_all()
    assert copying.failures() == {}
    engine.close()


def test_loads_run_on_a_high_priority_stream_and_stores_on_a_low_priority_one() -> None:
    """The load stream outranks the forward pass's kernels (priority 0; the next layer waits
    on the load), the store stream has CUDA's lowest priority; both opened in device scope."""
    caches, layout, streams = _engine("LBNHC")
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    engine = CudaTransferEngine(caches, layout, arena, streams=streams, defer_start=True)
    assert streams.priorities == {}  # nothing made before start (vLLM may be capturing)
    engine.start()
    assert streams.priorities == {"load": HIGH_PRIORITY, "store": LOW_PRIORITY}
    assert HIGH_PRIORITY < 0 == LOW_PRIORITY  # torch's order: lower is higher
    assert streams.unscoped == []
    engine.close()


def test_cuda_streams_open_each_torch_stream_at_the_priority_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.cuda.Stream is faked (no CUDA here): the priority reaches its constructor."""
    made: list[tuple[object, int]] = []

    class Stream:
        def __init__(self, device: object = None, priority: int = 0) -> None:
            made.append((device, priority))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    device = torch.device("cuda", 1)
    CudaStreams(device).open({"load": HIGH_PRIORITY, "store": LOW_PRIORITY})
    assert made == [(device, HIGH_PRIORITY), (device, LOW_PRIORITY)]


@pytest.mark.parametrize("staging_pages", [64, 2], ids=["one-chunk", "chunks-of-2-pages"])
def test_stores_of_non_compact_caches_are_staged_then_sent_one_dma_per_page_run(
    monkeypatch: pytest.MonkeyPatch, staging_pages: int
) -> None:
    """LBNHC (vLLM's GPU default): a store's blocks are gathered into whole pages in a device
    staging buffer (device memory only), then each run of consecutive pages is one DMA, not
    SM kernels writing host memory; the staging buffer is bounded (chunks); bit-exact."""
    caches, layout, streams = _engine("LBNHC")
    monkeypatch.setattr(staging, "STAGING_BYTES", staging_pages * layout.page_bytes)
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    engine = CudaTransferEngine(caches, layout, arena, streams=streams)
    assert not engine.block_compact
    blocks, pages = [9, 1, 14, 6, 2], [3, 4, 5, 10, 11]
    engine.store(blocks, pages, after=engine.forward_fence()).wait()
    labels = [c[2] for c in streams.calls if c[0] == "copy"]
    if staging_pages == 64:
        stage = [f"stage layer {i} x5" for i in range(LAYERS)]
        assert labels == [*stage, "pages x3", "pages x2"]
    else:
        dmas = [x for x in labels if x.startswith("pages")]
        assert dmas == ["pages x2", "pages x1", "pages x2"]
        assert len([x for x in labels if x.startswith("stage")]) == 3 * LAYERS
    restored, _, _ = _engine("LBNHC", fill=False)
    back = CudaTransferEngine(restored, layout, arena, streams=streams)
    back.load(pages, blocks).wait()
    for block in blocks:
        assert all(
            torch.equal(a, b)
            for a, b in zip(_bytes(caches, block), _bytes(restored, block), strict=True)
        )
    # Scattered pages (a run per block): per-layer kernels, never a DMA per block.
    streams.calls.clear()
    engine.store(list(range(8)), list(range(0, 16, 2)), after=None)
    assert [c[2] for c in streams.calls if c[0] == "copy"] == [
        f"layer {i} x8" for i in range(LAYERS)
    ]
    engine.close()
    back.close()
