"""Pinning the arena through the CUDA driver, with a fake driver library (``FakeCudaDriver``:
``cuda.h``'s ctypes signatures): chunks registered as copies need them, in the rank's device
context from every thread, never on the step loop's time, nothing after close, every chunk
unregistered on close; and the arena's alias made without numpy."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from kvshelf.transfer.pinned import _DL_ALIVE, CudaDriver, PinnedArena, PinningError, host_alias
from testbed.cuda_driver import FakeCudaDriver

PAGE = 4096
DEVICE = 3


def _arena(library: FakeCudaDriver) -> tuple[torch.Tensor, PinnedArena]:
    arena = torch.zeros(10 * PAGE, dtype=torch.uint8)
    pinned = PinnedArena(arena, PAGE, CudaDriver(library), DEVICE, chunk_bytes=4 * PAGE)
    return arena, pinned


def _offsets(library: FakeCudaDriver, name: str, base: int) -> list[int]:
    return [call.arg - base for call in library.calls_to(name)]


def test_chunks_are_registered_on_first_use_and_unregistered_on_close() -> None:
    library = FakeCudaDriver()
    arena, pinned = _arena(library)
    base = arena.data_ptr()
    pinned.ensure([1, 2])
    pinned.ensure([3, 0])  # same chunk: nothing new
    assert library.registered == {base: 4 * PAGE}
    pinned.ensure([9])  # the last chunk is short: 2 pages
    assert library.registered[base + 8 * PAGE] == 2 * PAGE
    assert pinned.registered_chunks == {0, 2}
    pinned.close()
    assert library.registered == {}
    assert _offsets(library, "cuMemHostUnregister", base) == [0, 8 * PAGE]
    assert pinned.registered_chunks == frozenset()
    assert all(count == 0 for count in library.retained.values())


def test_every_registration_runs_in_the_ranks_device_context_from_every_thread() -> None:
    library = FakeCudaDriver()
    _, pinned = _arena(library)
    pinned.ensure([0])  # the calling thread (the store thread, in a worker)
    store = threading.Thread(target=pinned.ensure, args=([4],), name="kvshelf-store")
    store.start()
    store.join()
    assert not pinned.pinned([8])  # the step loop only asks: the pin thread registers
    deadline = time.monotonic() + 10
    while pinned.registered_chunks != {0, 1, 2} and time.monotonic() < deadline:
        time.sleep(0.01)
    pinned.close()
    registrations = library.calls_to("cuMemHostRegister_v2")
    assert {call.thread for call in registrations} == {"MainThread", "kvshelf-store", "kvshelf-pin"}
    # Each in device 3's primary context; no context of any other device was ever retained.
    assert {call.device for call in library.calls if call.name.startswith("cuMem")} == {DEVICE}
    assert {call.arg for call in library.calls_to("cuDevicePrimaryCtxRetain")} == {DEVICE}
    assert set(library.retained) == {DEVICE}


def test_a_refused_registration_raises_leaves_nothing_registered_and_is_not_retried() -> None:
    library = FakeCudaDriver()
    arena, pinned = _arena(library)
    library.refuse.add(arena.data_ptr() + 4 * PAGE)
    with pytest.raises(PinningError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        pinned.ensure([5])
    assert pinned.registered_chunks == frozenset()
    assert library.registered == {}
    assert not pinned.pinned([5])  # a miss, and never asked again in the background
    pinned.ensure([0])
    assert pinned.registered_chunks == {0}
    pinned.close()
    assert len(library.calls_to("cuMemHostRegister_v2")) == 2


def test_the_step_loop_never_waits_for_a_registration() -> None:
    library = FakeCudaDriver()
    _, pinned = _arena(library)
    library.gate.clear()  # registrations take as long as the test wants
    started = time.monotonic()
    assert not pinned.pinned([0])
    assert library.entered.wait(10)
    assert not pinned.pinned([1])  # asked again while registering: still a miss, no wait
    assert time.monotonic() - started < 5
    library.gate.set()
    deadline = time.monotonic() + 10
    while not pinned.pinned([1]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pinned.pinned([0, 1, 2, 3])
    pinned.close()
    assert len(library.calls_to("cuMemHostRegister_v2")) == 1


def test_close_racing_a_registration_waits_for_it_and_registers_nothing_after() -> None:
    library = FakeCudaDriver()
    arena, pinned = _arena(library)
    library.gate.clear()
    store = threading.Thread(target=pinned.ensure, args=([0],), name="kvshelf-store")
    store.start()
    assert library.entered.wait(10)
    closer = threading.Thread(target=pinned.close)
    closer.start()
    time.sleep(0.1)
    assert closer.is_alive()  # close waits for the registration in flight
    library.gate.set()
    closer.join(10)
    store.join(10)
    registrations = len(library.calls_to("cuMemHostRegister_v2"))
    # The chunk registered while close waited is unregistered by it; nothing registers after.
    assert library.registered == {}
    with pytest.raises(PinningError, match="unmapped"):
        pinned.ensure([5])
    assert not pinned.pinned([9])
    time.sleep(0.1)
    assert len(library.calls_to("cuMemHostRegister_v2")) == registrations == 1
    assert _offsets(library, "cuMemHostUnregister", arena.data_ptr()) == [0]


def test_the_alias_is_made_without_numpy_and_freed_with_the_tensor() -> None:
    pages = torch.arange(64, dtype=torch.uint8).view(4, 16)
    before = len(_DL_ALIVE)
    alias = host_alias(pages, torch.device("cpu"))
    assert alias.data_ptr() == pages.data_ptr() and alias.shape == pages.shape
    alias[0, 0] = 200
    assert int(pages[0, 0]) == 200
    del alias
    gc.collect()
    assert len(_DL_ALIVE) == before
