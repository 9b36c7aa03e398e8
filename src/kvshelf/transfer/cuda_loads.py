"""One step's loads on the CUDA engine's load stream: a batch's index pair
(:class:`CopyBatch`), the merged loads of a step copied layer by layer
(:class:`CudaLayerwiseLoad`), and the loads of an engine that has not started
(:class:`RefusedLoads`).

The engine (:mod:`kvshelf.transfer.cuda`) validates and merges the loads; this module orders
their copies: one event per layer, each enqueued by whichever thread needs it first. It sees the
engine only through :class:`LayerCopier`, and imports neither the engine's module (which imports
this one) nor vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from kvshelf.transfer.base import LayerwiseLoad, NotReady
from kvshelf.transfer.streams import LOAD, Event, Streams
from kvshelf.transfer.views import index_tensor


class CopyBatch:
    """One batch's rows, sorted by destination (lists of ints, planned on the host); its index
    tensors made once, on first use, on the device the kernels run on."""

    def __init__(self, src: list[int], dst: list[int]) -> None:
        self.src, self.dst = src, dst
        self._on_device: tuple[torch.Tensor, torch.Tensor] | None = None

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The indices on ``device``, copied on the caller's current stream (no host wait)."""
        if self._on_device is None:
            both = index_tensor([*self.src, *self.dst]).view(2, -1)
            if device.type == "cuda":
                both = both.pin_memory().to(device, non_blocking=True)
            self._on_device = (both[0], both[1])
        return self._on_device


class RefusedLoads(LayerwiseLoad):
    """The loads of a step the engine cannot copy (it has not started): every one a miss."""

    def __init__(self, count: int, why: str) -> None:
        self._failures: dict[int, BaseException] = {i: NotReady(why) for i in range(count)}

    def run(self) -> None:
        return None

    def wait_layer(self, layer: int) -> None:
        return None

    def wait_all(self) -> None:
        return None

    def failures(self) -> dict[int, BaseException]:
        return dict(self._failures)


class LayerCopier(Protocol):
    """What a layer-wise load needs of the engine that copies it (the CUDA engine is one)."""

    @property
    def streams(self) -> Streams:
        """The streams the copies are ordered on."""
        ...

    def submit(self, stream: str, after: Event | None, work: Callable[[], None]) -> Event:
        """Enqueue ``work`` on ``stream`` after ``after``; raise if the engine is closed."""
        ...

    def copy_layer(self, to_pages: bool, layer: int, batch: CopyBatch) -> None:
        """Copy one layer of ``batch`` (inside a submitted work)."""
        ...


class CudaLayerwiseLoad(LayerwiseLoad):
    """One step's loads, merged into one batch, on the load stream, one event per layer.

    Enqueuing is cheap and never waits for the device, so whichever thread comes first (the
    load thread's :meth:`run`, or a :meth:`wait_layer` for a layer not enqueued yet) enqueues
    the layers up to the one it needs, in order, under a lock taken per layer. Layer 0 waits on
    the event recorded when the loads began (earlier work on the compute stream may still use
    the destination blocks).

    Args:
        engine: the engine copying.
        num_layers: the layers of the engine's KV caches.
        batch: every load of the step that was accepted, merged (sorted by destination).
        merged: the indices of the loads in ``batch``: a copy that fails fails them all.
        failures: the loads refused at once, by index.
        began: the event the first layer's copy waits on.
    """

    def __init__(
        self,
        engine: LayerCopier,
        num_layers: int,
        batch: CopyBatch,
        merged: Sequence[int],
        failures: Mapping[int, BaseException],
        began: Event,
    ) -> None:
        self._engine = engine
        self._batch = batch
        self._merged = list(merged)
        self._failures: dict[int, BaseException] = dict(failures)
        self._copy_failed = False
        self.num_layers = num_layers
        self._began = began
        self._events: list[Event | None] = []
        self._lock = threading.Lock()

    def run(self) -> None:
        with self._engine.streams.device_scope():
            self._enqueue_through(self.num_layers - 1)

    def wait_layer(self, layer: int) -> None:
        streams = self._engine.streams
        with streams.device_scope():
            self._enqueue_through(layer)
            event = self._events[layer]
            if event is not None:
                streams.compute_wait(event)

    def wait_all(self) -> None:
        streams = self._engine.streams
        with streams.device_scope():
            self._enqueue_through(self.num_layers - 1)
            last = self._events[-1]
            if last is not None:
                streams.compute_wait(last)
                streams.synchronize(last)

    def finished(self) -> bool:
        """Whether the last layer's copies have completed on the device (never blocks)."""
        if len(self._events) < self.num_layers:
            return False
        last = self._events[-1]
        if last is None:
            return True
        streams = self._engine.streams
        with streams.device_scope():
            return streams.query(last)

    def failures(self) -> dict[int, BaseException]:
        with self._lock:
            return dict(self._failures)

    def _enqueue_through(self, layer: int) -> None:
        # The lock is taken per layer, and not at all for a layer already enqueued (events
        # are only appended): the step loop's wait for layer i never waits for the load
        # thread's enqueuing of later layers.
        while len(self._events) <= layer:
            with self._lock:
                index = len(self._events)
                if index > layer:
                    return
                after = self._began if index == 0 else None
                try:
                    event: Event | None = self._engine.submit(
                        LOAD, after, lambda index=index: self._copy(index)
                    )
                except Exception as exc:
                    # The engine closed under us: every load still going fails.
                    self._fail_merged(exc)
                    event = None
                self._events.append(event)

    def _copy(self, layer: int) -> None:
        """One layer of every merged load: one gather and one scatter."""
        if self._copy_failed:
            return
        try:
            self._engine.copy_layer(False, layer, self._batch)
        except Exception as exc:
            self._fail_merged(exc)

    def _fail_merged(self, exc: BaseException) -> None:
        self._copy_failed = True
        for index in self._merged:
            self._failures.setdefault(index, exc)
