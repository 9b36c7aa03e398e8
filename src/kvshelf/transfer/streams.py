"""The stream and event ordering an asynchronous copy engine relies on, behind one interface.

A CUDA engine never blocks the forward pass: it enqueues copies on side streams and orders them
against the compute stream with events. :class:`Streams` is the handful of operations that
ordering needs; :class:`CudaStreams` implements them with ``torch.cuda`` streams and events,
and :class:`FakeCudaStreams` fakes them on the CPU and records every call, so that CPU tests
and the GPU check's dry run drive the very same engine code and can check the order: a store's
copies wait on the event recorded after the forward pass, pages are committed only after the
copy's event, a layer's wait waits on that layer's event only.

The fake models a device: each stream is a queue of work, waits and event records that the
fake runs in stream order. By default it runs everything as soon as it is queued; with
``late=True`` it runs nothing until the host synchronizes (or a test calls
:meth:`FakeCudaStreams.run_device`), and then runs the compute stream as far ahead of the side
streams as its waits allow, so that a read the compute stream was not made to wait for reads
stale bytes, as it could on a GPU.

Streams are named: ``"store"`` and ``"load"`` are the engine's own, opened by the engine at the
priority it asks for (:data:`STREAM_PRIORITIES`); the compute stream is the caller's current
stream. No vLLM import; ``torch.cuda`` is touched only by :class:`CudaStreams`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

STORE = "store"
LOAD = "load"
COMPUTE = "compute"

HIGH_PRIORITY = -1
"""torch's priority (lower is higher) for the load stream: the next layer's attention waits on
its copies, so they go before the forward pass's own kernels (priority 0) where both are
ready. -1 is high on every torch version (newer ones map any negative value into the
device's range)."""

LOW_PRIORITY = 0
"""The store stream's priority: CUDA's lowest (the default). Nothing in the forward pass waits
on a store; its copies take what the forward pass and the loads leave."""

STREAM_PRIORITIES: dict[str, int] = {LOAD: HIGH_PRIORITY, STORE: LOW_PRIORITY}
"""The priority a copy engine opens each of its streams at."""


class Event:
    """A point on one stream's timeline (opaque to the engine)."""


class Streams(ABC):
    """Streams of one device and the ordering operations the copy engines use.

    Every call an engine makes, on any thread, is made inside :meth:`device_scope`: a thread
    of kvshelf's own (the store or load thread) otherwise talks to CUDA's default device, and
    its first call would create a context on GPU 0 in every tensor-parallel rank.
    """

    @abstractmethod
    def device_scope(self) -> contextlib.AbstractContextManager[None]:
        """A context in which the calling thread's CUDA calls go to this device."""

    @abstractmethod
    def open(self, priorities: Mapping[str, int]) -> None:
        """Make the engine's streams, each at its priority (torch's: lower is higher); they
        are used only once opened."""

    @abstractmethod
    def record_compute(self) -> Event:
        """Record an event on the calling thread's current stream (the forward pass's)."""

    @abstractmethod
    def enqueue(self, stream: str, after: Event | None, work: Callable[[], None]) -> Event:
        """Make ``stream`` wait for ``after`` (if any), enqueue ``work`` on it, and record an
        event after it. ``work`` issues its copies onto ``stream``: on CUDA it runs now, on the
        host; the fake runs it when its simulated device gets there.

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
    """:class:`Streams` on one CUDA device: a store stream and a load stream of its own, made
    by :meth:`open` (this constructor makes no CUDA call).

    Args:
        device: the KV caches' CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams: dict[str, torch.cuda.Stream] = {}

    def open(self, priorities: Mapping[str, int]) -> None:
        with torch.cuda.device(self.device):
            self._streams = {
                name: torch.cuda.Stream(self.device, priority=priority)
                for name, priority in priorities.items()
            }

    def device_scope(self) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.device(self.device)

    def record_compute(self) -> Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return _CudaEvent(event)

    def enqueue(self, stream: str, after: Event | None, work: Callable[[], None]) -> Event:
        side = self._streams[stream]
        with torch.cuda.stream(side):
            if after is not None:
                side.wait_event(_cuda(after))
            work()
            # Blocking: the store thread's host wait for it sleeps instead of spinning a core.
            done = torch.cuda.Event(blocking=True)
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


_Op = tuple[str, object]
"""A queued operation of the fake device: ``("wait", event)``, ``("run", work)`` or
``("record", event)``."""

_DEVICE_ORDER = (COMPUTE, STORE, LOAD)
"""The fake device runs the first stream in this order that can make progress: the compute
stream races ahead of the copies unless a wait holds it back."""


class FakeCudaStreams(Streams):
    """Fakes :class:`CudaStreams` on the CPU, for tests and the GPU check's dry run.

    Args:
        late: False: work runs as soon as it is queued (every event has completed when it is
            returned). True: queued work runs only when the host synchronizes on an event
            (until that event), synchronizes the device, or calls :meth:`run_device`, and
            :meth:`query` is False until then; the compute stream then runs ahead of the copies
            wherever its waits allow.

    :attr:`calls` records each operation as a tuple, in order:

    - ``("record", stream, event)``: an event recorded (``stream`` is ``"compute"`` for
      :meth:`record_compute`);
    - ``("wait", stream, event)``: ``stream`` made to wait for ``event``;
    - ``("copy", stream, label)``: a copy issued by work on ``stream`` (see :meth:`note_copy`),
      when the fake device runs it;
    - ``("synchronize", event)``, ``("synchronize_device",)``.

    :attr:`priorities` records the priority each stream was opened at (:meth:`open`; a stream
    used before it is opened raises). :attr:`unscoped` records every operation called outside
    :meth:`device_scope` (an engine must make none), queries and opens included (:attr:`calls`
    leaves them out: they change nothing, and the settle thread polls), :attr:`host_waits` the
    thread and event of every host wait (``None``: the whole device). Engines call
    :meth:`note_copy` for each copy they issue, on every implementation (a no-op on CUDA
    streams); it is how the fake sees copies.
    """

    def __init__(self, *, late: bool = False) -> None:
        self.late = late
        self.calls: list[tuple[object, ...]] = []
        self.unscoped: list[tuple[str, str]] = []
        self.host_waits: list[tuple[str, FakeEvent | None]] = []
        self.priorities: dict[str, int] = {}
        self._numbers = itertools.count()
        self._log_lock = threading.Lock()
        # The fake device: one operation at a time, from whichever host thread drives it.
        self._device = threading.RLock()
        self._queues: dict[str, deque[_Op]] = {name: deque() for name in _DEVICE_ORDER}
        self._completed: set[int] = set()
        self._running = COMPUTE
        self._scopes: dict[int, int] = {}

    @contextlib.contextmanager
    def device_scope(self) -> Iterator[None]:
        ident = threading.get_ident()
        with self._log_lock:
            self._scopes[ident] = self._scopes.get(ident, 0) + 1
        try:
            yield
        finally:
            with self._log_lock:
                self._scopes[ident] -= 1

    def _log(self, *call: object) -> None:
        with self._log_lock:
            self.calls.append(call)
        if call[0] != "copy":
            self._check_scope(str(call[0]))

    def _check_scope(self, operation: str) -> None:
        with self._log_lock:
            if not self._scopes.get(threading.get_ident()):
                self.unscoped.append((operation, threading.current_thread().name))

    def _queue(self, stream: str, *ops: _Op) -> None:
        with self._device:
            self._queues[stream].extend(ops)
            if not self.late:
                self._advance()

    def _record(self, stream: str) -> FakeEvent:
        event = FakeEvent(stream, next(self._numbers))
        self._queue(stream, ("record", event))
        self._log("record", stream, event)
        return event

    def open(self, priorities: Mapping[str, int]) -> None:
        self._check_scope("open")
        self.priorities.update(priorities)

    def record_compute(self) -> Event:
        return self._record(COMPUTE)

    def enqueue(self, stream: str, after: Event | None, work: Callable[[], None]) -> Event:
        if stream not in self.priorities:
            raise RuntimeError(f"fake stream {stream!r} used before it was opened")
        if after is not None:
            self._log("wait", stream, after)
            self._queue(stream, ("wait", after))
        self._queue(stream, ("run", work))
        return self._record(stream)

    def launch(self, work: Callable[[], None]) -> None:
        """Queue ``work`` on the compute stream: a kernel of the forward pass (for tests)."""
        self._queue(COMPUTE, ("run", work))

    def note_copy(self, label: str) -> None:
        self._log("copy", self._running, label)

    def compute_wait(self, event: Event) -> None:
        self._log("wait", COMPUTE, event)
        self._queue(COMPUTE, ("wait", event))

    def synchronize(self, event: Event) -> None:
        self._log("synchronize", event)
        assert isinstance(event, FakeEvent)
        self.host_waits.append((threading.current_thread().name, event))
        with self._device:
            self._advance(until=event)
            if event.number not in self._completed:
                raise RuntimeError(f"fake device stuck before {event}: a wait never completes")

    def query(self, event: Event) -> bool:
        assert isinstance(event, FakeEvent)
        self._check_scope("query")
        with self._device:
            return event.number in self._completed

    def synchronize_device(self) -> None:
        self._log("synchronize_device")
        self.host_waits.append((threading.current_thread().name, None))
        self.run_device()

    def run_device(self) -> None:
        """Run every queued operation the waits allow (what a GPU does in its own time)."""
        with self._device:
            self._advance()

    def _advance(self, until: FakeEvent | None = None) -> None:
        """Run operations, compute stream first, until ``until`` completed or none can run."""
        while until is None or until.number not in self._completed:
            for name in _DEVICE_ORDER:
                queue = self._queues[name]
                if not queue:
                    continue
                kind, arg = queue[0]
                if kind == "wait":
                    assert isinstance(arg, FakeEvent)
                    if arg.number not in self._completed:
                        continue
                queue.popleft()
                if kind == "run":
                    self._running = name
                    try:
                        arg()  # type: ignore[operator]
                    finally:
                        self._running = COMPUTE
                elif kind == "record":
                    assert isinstance(arg, FakeEvent)
                    self._completed.add(arg.number)
                break
            else:
                return
