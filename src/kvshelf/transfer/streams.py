"""The stream and event ordering an asynchronous copy engine relies on, behind one interface.

A CUDA engine never blocks the forward pass: it enqueues copies on side streams and orders them
against the compute stream with events. :class:`Streams` is the handful of operations that
ordering needs; :class:`CudaStreams` implements them with ``torch.cuda`` streams and events,
and :class:`FakeCudaStreams` fakes them on the CPU (work runs at once, in enqueue order) and
records every call, so that CPU tests and the GPU check's dry run drive the very same engine
code and can check the order: a store's copies wait on the event recorded after the forward
pass, pages are committed only after the copy's event, a layer's wait waits on that layer's
event only.

Streams are named: ``"store"`` and ``"load"`` are the engine's own; the compute stream is the
caller's current stream. No vLLM import; ``torch.cuda`` is touched only by :class:`CudaStreams`.
"""

from __future__ import annotations

import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

STORE = "store"
LOAD = "load"
COMPUTE = "compute"


class Event:
    """A point on one stream's timeline (opaque to the engine)."""


class Streams(ABC):
    """Streams of one device and the ordering operations the copy engines use."""

    @abstractmethod
    def record_compute(self) -> Event:
        """Record an event on the calling thread's current stream (the forward pass's)."""

    @abstractmethod
    def enqueue(self, stream: str, after: Event | None, work: Callable[[], None]) -> Event:
        """Make ``stream`` wait for ``after`` (if any), enqueue ``work`` on it (``work`` runs
        now on the host and issues its copies onto ``stream``), and record an event after it.

        Returns:
            The event recorded on ``stream`` after ``work``'s copies.
        """

    @abstractmethod
    def compute_wait(self, event: Event) -> None:
        """Make the calling thread's current stream wait for ``event``; never blocks the host."""

    @abstractmethod
    def synchronize(self, event: Event) -> None:
        """Block the host until ``event`` has completed."""

    @abstractmethod
    def query(self, event: Event) -> bool:
        """Whether ``event`` has completed (never blocks)."""

    @abstractmethod
    def synchronize_device(self) -> None:
        """Block the host until all work on the device, every stream, has completed."""

    def note_copy(self, label: str) -> None:  # noqa: B027 (a hook only a fake overrides)
        """Called by engines for each copy they issue inside :meth:`enqueue`'s work."""


@dataclass(frozen=True, eq=False)
class _CudaEvent(Event):
    event: torch.cuda.Event


class CudaStreams(Streams):
    """:class:`Streams` on one CUDA device: a store stream and a load stream of its own.

    Args:
        device: the KV caches' CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams = {STORE: torch.cuda.Stream(device), LOAD: torch.cuda.Stream(device)}

    def record_compute(self) -> Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return _CudaEvent(event)

    def enqueue(self, stream: str, after: Event | None, work: Callable[[], None]) -> Event:
        side = self._streams[stream]
        with torch.cuda.device(self.device), torch.cuda.stream(side):
            if after is not None:
                side.wait_event(_cuda(after))
            work()
            done = torch.cuda.Event()
            done.record(side)
        return _CudaEvent(done)

    def compute_wait(self, event: Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(_cuda(event))

    def synchronize(self, event: Event) -> None:
        _cuda(event).synchronize()

    def query(self, event: Event) -> bool:
        return _cuda(event).query()

    def synchronize_device(self) -> None:
        torch.cuda.synchronize(self.device)


def _cuda(event: Event) -> torch.cuda.Event:
    assert isinstance(event, _CudaEvent), event
    return event.event


@dataclass(frozen=True, eq=False)
class FakeEvent(Event):
    """An event of :class:`FakeCudaStreams`: ``stream`` and a number unique in the run."""

    stream: str
    number: int

    def __str__(self) -> str:
        return f"{self.stream}#{self.number}"


class FakeCudaStreams(Streams):
    """Fakes :class:`CudaStreams` on the CPU, for tests and the GPU check's dry run.

    Work runs at once on the calling thread (so every event has completed when it is
    returned), and :attr:`calls` records each operation as a tuple, in order:

    - ``("record", stream, event)``: an event recorded (``stream`` is ``"compute"`` for
      :meth:`record_compute`);
    - ``("wait", stream, event)``: ``stream`` made to wait for ``event``;
    - ``("copy", stream, label)``: a copy issued by work on ``stream`` (see :meth:`note_copy`);
    - ``("synchronize", event)``, ``("synchronize_device",)``.

    Engines call :meth:`note_copy` for each copy they issue, on every implementation (a no-op
    on CUDA streams); it is how the fake sees copies.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._current: dict[int, str] = {}

    def _log(self, *call: object) -> None:
        with self._lock:
            self.calls.append(call)

    def _event(self, stream: str) -> FakeEvent:
        event = FakeEvent(stream, next(self._numbers))
        self._log("record", stream, event)
        return event

    def record_compute(self) -> Event:
        return self._event(COMPUTE)

    def enqueue(self, stream: str, after: Event | None, work: Callable[[], None]) -> Event:
        if after is not None:
            self._log("wait", stream, after)
        self._current[threading.get_ident()] = stream
        try:
            work()
        finally:
            del self._current[threading.get_ident()]
        return self._event(stream)

    def note_copy(self, label: str) -> None:
        self._log("copy", self._current.get(threading.get_ident(), COMPUTE), label)

    def compute_wait(self, event: Event) -> None:
        self._log("wait", COMPUTE, event)

    def synchronize(self, event: Event) -> None:
        self._log("synchronize", event)

    def query(self, event: Event) -> bool:
        return True

    def synchronize_device(self) -> None:
        self._log("synchronize_device")
