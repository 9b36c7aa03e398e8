"""The probes of ``make gpu-check``: one question of the CUDA engine's review each, answered on
the GPU, and run through the very same code on the CPU fakes by the dry run (so that the GPU
run executes no line the CPU has not).

Each probe builds its own :class:`~kvshelf.transfer.CudaTransferEngine` on the server's arena
(mapped by the caller) and only reads the arena (loads), or is refused before it writes:

- ``copy_path``: which copies a load of runs of consecutive blocks and pages, and one of
  random blocks, issue (one DMA per run for block-compact caches, else one gather/scatter per
  layer), from the labels the engine gives every copy (:meth:`Streams.note_copy`);
- ``launches_per_step``: 64 one-block hits of one step against one 64-block hit: copy launches
  (the layers, both) and the time of each;
- ``forced_refusal``: a chunk of the arena registered beforehand, so that the engine's own
  registration is refused by the driver (``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED``, 712,
  whatever ``ulimit -l`` says): its store is refused, its load is a miss, and the device's
  next kernel runs;
- ``nothing_left_pinned``: after an engine's close, its chunk registers again (the driver
  would say 712 if anything were left pinned).

On the dry run the streams are :class:`~kvshelf.transfer.streams.FakeCudaStreams` and the driver
wraps :class:`~testbed.cuda_driver.FakeCudaDriver`. Imports torch and kvshelf only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvshelf.transfer import CudaTransferEngine, KVCacheLayout
from kvshelf.transfer.cuda import NotPinned
from kvshelf.transfer.pinned import CHUNK_BYTES, CudaDriver, PinningError
from kvshelf.transfer.streams import FakeCudaStreams

HITS = 64
"""Hits of one step in ``launches_per_step`` (the review's example: 64 hits x 80 layers)."""


@dataclass
class ProbeResult:
    layout: str
    probe: str
    ok: bool
    detail: str


class Probes:
    """The probes of one layout's KV caches on one mapped arena.

    Args:
        layout_name: the caches' layout (``LBNHC``, ``BLNHC``).
        caches, layout: the KV caches (CUDA, or CPU on the dry run) and their page layout.
        arena: the server's arena, mapped (``ArenaMapping.buffer``).
        driver: the CUDA driver (``CudaDriver.load()``, or over a fake library on the dry run).
        dry_run: fake streams (CPU caches).
        sync: waits until the device is idle (the timings' clock).
    """

    def __init__(
        self,
        layout_name: str,
        caches: dict[str, torch.Tensor],
        layout: KVCacheLayout,
        arena: torch.Tensor,
        driver: CudaDriver,
        *,
        dry_run: bool,
        sync: Callable[[], None],
    ) -> None:
        self.layout_name = layout_name
        self.caches = caches
        self.layout = layout
        self.arena = arena
        self.driver = driver
        self.dry_run = dry_run
        self.sync = sync
        self.device = next(iter(caches.values())).device

    def engine(self) -> CudaTransferEngine:
        streams = FakeCudaStreams() if self.dry_run else None
        return CudaTransferEngine(
            self.caches, self.layout, self.arena, streams=streams, driver=self.driver
        )

    def _blocks(self, n: int) -> list[int]:
        """Destination blocks of the probes' loads: the caches' last ``n`` (nothing the check
        reads later)."""
        return list(range(self.layout.num_blocks - n, self.layout.num_blocks))

    def _result(self, probe: str, ok: bool, detail: str) -> ProbeResult:
        return ProbeResult(self.layout_name, probe, ok, detail)

    def copy_path(self) -> ProbeResult:
        engine = self.engine()
        runs_of_four = [0, 1, 2, 3, 8, 9, 10, 11]
        scattered = list(range(0, 32, 2))
        compact = engine.block_compact
        try:
            runs = _labels(engine, lambda: engine.load(runs_of_four, self._blocks(8)).wait())
            random = _labels(engine, lambda: engine.load(scattered, self._blocks(16)[::-1]).wait())
        finally:
            engine.close()
        layers = self.layout.num_layers
        if compact:
            ok = runs == ["pages x4", "pages x4"] and random == ["pages x16 (kernel)"]
        else:
            ok = len(runs) == len(random) == layers and all("layer" in x for x in runs + random)
        return self._result("copy_path", ok, f"runs: {_summary(runs)}; random: {_summary(random)}")

    def launches_per_step(self) -> ProbeResult:
        engine = self.engine()
        try:
            blocks = self._blocks(HITS)
            engine.load(list(range(HITS)), blocks).wait()  # pins what the loads read
            many = [([page], [block]) for page, block in zip(range(HITS), blocks, strict=True)]
            one = [(list(range(HITS)), blocks)]
            counts, seconds = {}, {}
            for name, loads in (("64 hits", many), ("1 hit", one)):
                counts[name] = len(_labels(engine, lambda loads=loads: _step(engine, loads)))
                seconds[name] = _median(5, lambda loads=loads: self._timed(engine, loads))
        finally:
            engine.close()
        layers = self.layout.num_layers
        ok = counts["64 hits"] == counts["1 hit"] == layers
        detail = "; ".join(
            f"{name}: {counts[name]} copy launches, {seconds[name] * 1e3:.3f} ms" for name in counts
        )
        return self._result("launches_per_step", ok, f"{layers} layers; {detail}")

    def _timed(self, engine: CudaTransferEngine, loads: list) -> float:
        self.sync()
        start = time.perf_counter()
        _step(engine, loads)
        self.sync()
        return time.perf_counter() - start

    def forced_refusal(self) -> ProbeResult:
        """Chunk 0 registered by the probe first: the engine's own registration is refused."""
        address, nbytes = self.arena.data_ptr(), min(CHUNK_BYTES, self.arena.numel())
        index = self.device.index or 0
        with self.driver.on_device(index):
            self.driver.register(address, nbytes)
        try:
            engine = self.engine()
            try:
                refused = ""
                try:
                    engine.store(self._blocks(2), [0, 1], after=engine.forward_fence())
                except NotPinned as exc:
                    refused = str(exc)
                copying = engine.begin_loads([([0, 1], self._blocks(2))])
                copying.run()
                copying.wait_all()
                missed = isinstance(copying.failures().get(0), NotPinned)
            finally:
                engine.close()
            after = torch.ones(4, device=self.device).sum().item() == 4.0
        finally:
            with self.driver.on_device(index):
                self.driver.unregister(address)
        # The refusal's CUresult (712) is in the message when the store's own registration
        # was refused; when the background one (chunk 0, asked at start) was first, the store
        # is told the chunk was refused (its WARNING line names 712).
        ok = bool(refused) and missed and after
        return self._result(
            "forced_refusal",
            ok,
            f"store refused: {refused or 'no'}; load missed: {missed}; next kernel ran: {after}",
        )

    def nothing_left_pinned(self) -> ProbeResult:
        engine = self.engine()
        try:
            engine.load([0, 1], self._blocks(2)).wait()
        finally:
            engine.close()
        address, nbytes = self.arena.data_ptr(), min(CHUNK_BYTES, self.arena.numel())
        index = self.device.index or 0
        try:
            with self.driver.on_device(index):
                self.driver.register(address, nbytes)
                self.driver.unregister(address)
        except PinningError as exc:
            return self._result("nothing_left_pinned", False, f"chunk 0 still pinned: {exc}")
        return self._result("nothing_left_pinned", True, "chunk 0 registers again after close")

    def run(self, *, once: bool) -> list[ProbeResult]:
        """Every probe of this layout; ``once``: also those that do not depend on the layout."""
        probes = [self.copy_path]
        if once:
            probes += [self.launches_per_step, self.forced_refusal, self.nothing_left_pinned]
        return run_probes(self.layout_name, probes)


def run_probes(layout_name: str, probes: list[Callable[[], ProbeResult]]) -> list[ProbeResult]:
    """Each probe's result; a probe that raises is a failed result naming the exception."""
    results = []
    for probe in probes:
        try:
            results.append(probe())
        except Exception as exc:  # a probe that breaks is a finding, not the check's end
            detail = f"{type(exc).__name__}: {exc}"
            results.append(ProbeResult(layout_name, probe.__name__, False, detail))
    return results


def _step(engine: CudaTransferEngine, loads: list) -> None:
    copying = engine.begin_loads(loads)
    copying.run()
    copying.wait_all()
    assert not copying.failures(), copying.failures()


def _labels(engine: CudaTransferEngine, work: Callable[[], None]) -> list[str]:
    """The labels of the copies ``work`` issues on ``engine``'s streams."""
    streams = engine.streams
    labels: list[str] = []
    note = streams.note_copy

    def noting(label: str) -> None:
        labels.append(label)
        note(label)

    streams.note_copy = noting  # type: ignore[method-assign]
    try:
        work()
    finally:
        del streams.note_copy
    return labels


def _summary(labels: list[str]) -> str:
    return f"{len(labels)} copies ({', '.join(sorted(set(labels))[:3])}...)"


def _median(repeats: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(repeats))
