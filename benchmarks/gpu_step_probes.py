"""The probes of ``make gpu-check`` that put kvshelf's copies beside vLLM's forward pass
(:mod:`benchmarks.gpu_probes` holds those about the copies alone), run through the same
code on the CPU fakes by the dry run:

- ``ordering``: a load, then a forward pass that reads every loaded block, as vLLM runs it
  under FULL CUDA graphs (the compute stream waits for the last layer's copies, then one graph
  replays the whole pass) and under PIECEWISE graphs (the load thread enqueues every layer;
  before each layer's piece, the compute stream waits for that layer's copies), each against
  what the pass reads once the load has completed; and a negative control, the same pass with
  no wait, which must read stale blocks (else the probe could not see a missing wait);
- ``quiet_during_capture``: vLLM captures its graphs in global capture mode right after
  ``register_kv_caches``, when a server that just appeared makes the store thread attach: an
  engine built and asked to load on another thread during the capture refuses without a CUDA
  call, the capture succeeds, and started afterwards on the step loop the engine copies; the
  GPU run also tries the old mistake (the arena's pinning during the capture) and reports
  what CUDA made of it;
- ``forward_slowdown``: the forward pass (the check's simulated compute) alone, beside a
  kvshelf load of the same bytes as a plain pinned DMA, and beside that DMA: target within
  ``TARGET_SLOWDOWN`` x alone.

On the dry run the streams are :class:`~kvshelf.transfer.streams.FakeCudaStreams` whose device
runs the forward pass ahead of the copies wherever its waits allow (``late``), and a capture
is only the window it would span. Imports torch and kvshelf only.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial

import torch

from benchmarks.gpu_probes import ProbeResult, Probes, run_probes
from kvshelf.transfer import CudaTransferEngine, NotReady
from kvshelf.transfer.pinned import CHUNK_BYTES
from kvshelf.transfer.streams import FakeCudaStreams

TARGET_SLOWDOWN = 1.25
"""The forward pass beside kvshelf's copies takes at most this many times its time alone."""
SENTINEL = 7
"""What the destination blocks hold before each load: any page's bytes differ from it."""
ORDERING_BLOCKS = 256
"""Blocks of the ordering probe's load (at most half the caches): a load long enough that a
forward pass which does not wait reads blocks not copied yet."""
SLOWDOWN_BYTES = 64 << 20
"""Bytes of the forward slowdown probe's load and DMA (fewer if the caches hold fewer)."""


class StepProbes:
    """The forward-pass probes of one layout's KV caches on one mapped arena.

    Args:
        probes: the copy probes of the same caches and arena (their layout name, caches,
            page layout, arena, driver and dry-run flag are these probes' too).
        compute: one simulated forward pass on the current (compute) stream.
        repeats: timings per figure (the median is kept).
    """

    def __init__(self, probes: Probes, *, compute: Callable[[], None], repeats: int) -> None:
        self.layout_name = probes.layout_name
        self.caches = probes.caches
        self.layout = probes.layout
        self.arena = probes.arena
        self.driver = probes.driver
        self.dry_run = probes.dry_run
        self.device = probes.device
        self.compute = compute
        self.repeats = repeats
        self.cuda = self.device.type == "cuda"

    def _streams(self) -> FakeCudaStreams | None:
        """The dry run's fake streams (None on a GPU: the engine makes its own). Their device
        runs queued work only when a host waits, compute first: a forward pass that does not
        wait for a copy runs before it, as a GPU may."""
        return FakeCudaStreams(late=True) if self.dry_run else None

    def _engine(
        self, streams: FakeCudaStreams | None = None, *, defer_start: bool = False
    ) -> CudaTransferEngine:
        streams = streams or self._streams()
        return CudaTransferEngine(
            self.caches,
            self.layout,
            self.arena,
            streams=streams,
            driver=self.driver,
            defer_start=defer_start,
        )

    def _settle(self, engine: CudaTransferEngine) -> None:
        """Wait until the device (the fake one included) has run everything queued."""
        if isinstance(engine.streams, FakeCudaStreams):
            engine.streams.run_device()
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _result(self, probe: str, ok: bool, detail: str) -> ProbeResult:
        return ProbeResult(self.layout_name, probe, ok, detail)

    def _loads(self, count: int) -> list[tuple[list[int], list[int]]]:
        """One load of ``count`` pages into the caches' last ``count`` blocks (nothing the
        check reads later)."""
        count = min(count, self.layout.num_blocks // 2)
        first = self.layout.num_blocks - count
        return [(list(range(count)), list(range(first, self.layout.num_blocks)))]

    def ordering(self) -> ProbeResult:
        loads = self._loads(ORDERING_BLOCKS)
        blocks = loads[0][1]
        engine = self._engine()
        try:
            # Pins what the loads read (a step's loads never wait for a registration).
            engine.load(*loads[0]).wait()
            forward = _Forward(self.caches, blocks, engine)
            index = torch.tensor(blocks, device=self.device)
            reads: dict[str, list[int]] = {}
            for name in ("stale", "loaded", "full", "piecewise", "no wait"):
                for tensor in self.caches.values():
                    tensor.index_fill_(0, index, SENTINEL)
                self._settle(engine)
                copying = engine.begin_loads(loads)
                if name == "stale":
                    forward.whole()
                elif name == "loaded":
                    copying.wait_all()
                    forward.whole()
                elif name == "full":
                    copying.wait_layer(self.layout.num_layers - 1)
                    forward.whole()
                else:
                    copying.run()  # the load thread
                    for layer in range(self.layout.num_layers):
                        if name == "piecewise":
                            copying.wait_layer(layer)
                        forward.layer(layer)
                self._settle(engine)
                copying.wait_all()
                assert not copying.failures(), copying.failures()
                reads[name] = forward.out.tolist()
        finally:
            engine.close()
        if reads["stale"] == reads["loaded"]:
            return self._result("ordering", False, "inconclusive: the pages hold the sentinel")
        right = {name: reads[name] == reads["loaded"] for name in ("full", "piecewise")}
        stale_layers = sum(a != b for a, b in zip(reads["no wait"], reads["loaded"], strict=True))
        layers = self.layout.num_layers
        detail = (
            f"{len(blocks)} blocks; FULL read the loaded blocks: {right['full']}; PIECEWISE: "
            f"{right['piecewise']}; control without a wait read stale blocks in "
            f"{stale_layers}/{layers} layers"
        )
        return self._result("ordering", all(right.values()) and stale_layers > 0, detail)

    def quiet_during_capture(self) -> ProbeResult:
        loads = self._loads(8)
        fake = self._streams()
        engine: list[CudaTransferEngine] = []
        refused: list[str] = []

        def attach() -> None:
            # What the store thread does when a server appears: build the engine, use it.
            built = self._engine(fake, defer_start=True)
            engine.append(built)
            try:
                built.load(*loads[0]).wait()
            except NotReady as exc:
                refused.append(str(exc))

        try:
            captured = self._capture_around(partial(_on_thread, attach))
            # On a GPU the capture's success tells; dry, the fake streams saw no call.
            quiet = fake is None or not (fake.calls or fake.priorities or fake.unscoped)
            engine[0].start()  # the step loop's call, once vLLM has captured
            engine[0].load(*loads[0]).wait()
            self._settle(engine[0])
        finally:
            for built in engine:
                built.close()
        control = self._pinning_during_capture()
        ok = captured.startswith("ok") and bool(refused) and quiet
        detail = (
            f"capture: {captured}; engine during it: "
            f"{'refused: ' + refused[0] if refused else 'copied'}, no CUDA call: {quiet}; "
            f"after start: copies; control, the arena pinned during a capture: {control}"
        )
        return self._result("quiet_during_capture", ok, detail)

    def _capture_around(self, work: Callable[[], None]) -> str:
        """Run ``work`` while this thread captures a CUDA graph in global mode (vLLM's); on
        the dry run, just run it. Returns ``ok...`` or what the capture raised."""
        if not self.cuda:
            work()
            return "ok (dry run: no capture)"
        a = torch.ones(256, 256, device=self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with _side_stream(self.device):
                torch.mm(a, a)  # warm-up outside the capture, as vLLM does
            with torch.cuda.graph(graph, capture_error_mode="global"):
                out = torch.mm(a, a)
                work()
            graph.replay()
            torch.cuda.synchronize(self.device)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok" if out[0, 0].item() == 256.0 else "replay wrong"

    def _pinning_during_capture(self) -> str:
        """The mistake the deferred start avoids: the arena's first chunk registered on
        another thread during a global-mode capture."""
        if not self.cuda:
            return "n/a (dry run)"
        address, nbytes = self.arena.data_ptr(), min(CHUNK_BYTES, self.arena.numel())
        index = self.device.index or 0
        registered: list[str] = []

        def pin() -> None:
            try:
                with self.driver.on_device(index):
                    self.driver.register(address, nbytes)
                registered.append("registered")
            except Exception as exc:
                registered.append(f"refused ({exc})")

        captured = self._capture_around(partial(_on_thread, pin))
        if registered and registered[0] == "registered":
            with self.driver.on_device(index):
                self.driver.unregister(address)
        return f"capture {captured}; registration {registered[0] if registered else 'none'}"

    def forward_slowdown(self) -> ProbeResult:
        count = max(1, SLOWDOWN_BYTES // self.layout.page_bytes)
        loads = self._loads(count)
        nbytes = len(loads[0][0]) * self.layout.page_bytes
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        engine = self._engine()
        try:
            engine.load(*loads[0]).wait()  # pins what the loads read

            def kvshelf() -> Callable[[], None]:
                copying = engine.begin_loads(loads)
                copying.run()  # the load thread: every layer enqueued
                return copying.wait_all

            def dma() -> Callable[[], None]:
                if not self.cuda:
                    dev.copy_(host)
                    return lambda: None
                # Its own stream, not ordered before the forward pass: it runs beside it.
                stream = torch.cuda.Stream(self.device)
                with torch.cuda.stream(stream):
                    dev.copy_(host, non_blocking=True)
                return stream.synchronize

            seconds = {
                name: self._median(lambda beside=beside: self._forward_beside(engine, beside))
                for name, beside in (("alone", None), ("kvshelf", kvshelf), ("dma", dma))
            }
        finally:
            engine.close()
        ratio = seconds["kvshelf"] / seconds["alone"]
        detail = (
            f"forward {seconds['alone'] * 1e3:.2f} ms alone, {ratio:.2f} x beside a kvshelf "
            f"load of {nbytes / 2**20:.0f} MiB, {seconds['dma'] / seconds['alone']:.2f} x "
            f"beside a pinned DMA of the same bytes (target <= {TARGET_SLOWDOWN:g} x"
            f"{'; dry run: not judged' if self.dry_run else ''})"
        )
        return self._result("forward_slowdown", self.dry_run or ratio <= TARGET_SLOWDOWN, detail)

    def _forward_beside(
        self, engine: CudaTransferEngine, beside: Callable[[], Callable[[], None]] | None
    ) -> float:
        """Seconds of one forward pass on the compute stream, with ``beside`` started just
        before it (its returned wait called after)."""
        self._settle(engine)
        finish = beside() if beside is not None else None
        start = time.perf_counter()
        self.compute()
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        took = time.perf_counter() - start
        if finish is not None:
            finish()
        self._settle(engine)
        return took

    def _median(self, measure: Callable[[], float]) -> float:
        return statistics.median(measure() for _ in range(self.repeats))

    def run(self, *, once: bool) -> list[ProbeResult]:
        """Every probe of this layout; ``once``: also those that do not depend on the layout."""
        probes = [self.ordering]
        if once:
            probes += [self.quiet_during_capture, self.forward_slowdown]
        return run_probes(self.layout_name, probes)


class _Forward:
    """The forward pass's reads of the loaded blocks: per layer, a checksum of the blocks'
    bytes into ``out``. On a GPU, CUDA graphs: one per layer (PIECEWISE's pieces) and one of
    every layer (FULL); dry, work queued on the fake compute stream."""

    def __init__(
        self, caches: dict[str, torch.Tensor], blocks: list[int], engine: CudaTransferEngine
    ) -> None:
        tensors = list(caches.values())
        device = tensors[0].device
        self.out = torch.zeros(len(tensors), dtype=torch.int64, device=device)
        index = torch.tensor(blocks, device=device)
        self._reads = [partial(_checksum, self.out[i], t, index) for i, t in enumerate(tensors)]
        streams = engine.streams
        self._fake = streams if isinstance(streams, FakeCudaStreams) else None
        if self._fake is None:
            self._pieces = [_graph(read) for read in self._reads]
            self._whole = _graph(self._all)

    def _all(self) -> None:
        for read in self._reads:
            read()

    def layer(self, layer: int) -> None:
        if self._fake is not None:
            self._fake.launch(self._reads[layer])
        else:
            self._pieces[layer].replay()

    def whole(self) -> None:
        if self._fake is not None:
            self._fake.launch(self._all)
        else:
            self._whole.replay()


def _checksum(out: torch.Tensor, tensor: torch.Tensor, index: torch.Tensor) -> None:
    # Bytes, not values: random KV bytes hold NaNs, which no float comparison finds equal.
    out.copy_(tensor.index_select(0, index).view(torch.uint8).sum(dtype=torch.int64))


def _graph(work: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """``work`` captured as a CUDA graph (warmed up on a side stream first, as torch asks)."""
    with _side_stream(torch.device("cuda", torch.cuda.current_device())):
        work()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    return graph


@contextlib.contextmanager
def _side_stream(device: torch.device) -> Iterator[torch.cuda.Stream | None]:
    """A side stream ordered after the current one (None on the CPU)."""
    if device.type != "cuda":
        yield None
        return
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield stream
    torch.cuda.current_stream(device).wait_stream(stream)


def _on_thread(work: Callable[[], None]) -> None:
    """Run ``work`` on another thread (the store thread's place) and wait for it."""
    thread = threading.Thread(target=work, name="kvshelf-store")
    thread.start()
    thread.join()
