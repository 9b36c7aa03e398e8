"""How the load thread and the step loop share the layers of one step's loads
(`CpuLayerwiseLoad`)."""

from __future__ import annotations

import threading
import time

from kvshelf.transfer import CpuLayerwiseLoad

NUM_LAYERS = 5


class RecordedLayerCopies:
    """Stands in for a prepared load (`CpuTransferEngine.prepare_load`): records which thread
    copied each layer, and holds the copy of ``stall_layer`` until ``release`` is set."""

    def __init__(self, stall_layer: int | None = None) -> None:
        self.stall_layer = stall_layer
        self.stalled = threading.Event()
        self.release = threading.Event()
        self.copied_by: dict[int, str] = {}
        self._lock = threading.Lock()

    def __call__(self, layer: int) -> None:
        with self._lock:
            assert layer not in self.copied_by, f"layer {layer} copied twice"
            self.copied_by[layer] = threading.current_thread().name
        if layer == self.stall_layer:
            self.stalled.set()
            assert self.release.wait(10)


def test_while_the_load_thread_copies_a_layer_the_step_loop_copies_later_ones() -> None:
    copies = RecordedLayerCopies(stall_layer=0)
    batch = CpuLayerwiseLoad([copies], NUM_LAYERS)
    load_thread = threading.Thread(target=batch.run, name="load")
    load_thread.start()
    assert copies.stalled.wait(10)
    step_loop = threading.Thread(target=batch.wait_layer, args=(0,), name="step")
    step_loop.start()
    # The step loop needs layer 0, which the load thread holds: it copies the rest meanwhile.
    deadline = time.monotonic() + 10
    while len(copies.copied_by) < NUM_LAYERS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(copies.copied_by) == NUM_LAYERS
    step_loop.join(0.2)
    assert step_loop.is_alive()  # layer 0 is still not in place
    copies.release.set()
    step_loop.join(10)
    load_thread.join(10)
    assert not step_loop.is_alive() and not load_thread.is_alive()
    assert copies.copied_by == {0: "load", **{layer: "step" for layer in range(1, NUM_LAYERS)}}
    batch.wait_all()
    assert batch.failures() == {}


def test_the_step_loop_copies_what_nobody_started_and_stops_at_the_layer_it_needs() -> None:
    copies = RecordedLayerCopies()
    batch = CpuLayerwiseLoad([copies], NUM_LAYERS)
    batch.wait_layer(1)  # no load thread at all
    assert copies.copied_by == {0: "MainThread", 1: "MainThread"}
    batch.run()
    assert set(copies.copied_by) == set(range(NUM_LAYERS))


def test_a_failing_load_fails_alone_and_every_layer_still_completes() -> None:
    def broken(layer: int) -> None:
        raise ValueError("transfer engine is closed")

    copies = RecordedLayerCopies()
    unplanned = IndexError("page index out of range")
    batch = CpuLayerwiseLoad([broken, copies, unplanned], NUM_LAYERS)
    batch.wait_all()
    assert batch.failures().keys() == {0, 2}
    assert batch.failures()[2] is unplanned
    assert str(batch.failures()[0]) == "transfer engine is closed"
    assert set(copies.copied_by) == set(range(NUM_LAYERS))
