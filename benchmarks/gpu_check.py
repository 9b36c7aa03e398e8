"""``make gpu-check``: the CUDA copy engine on one GPU, against a real kvshelf server.

For each KV cache layout (``LBNHC``, vLLM's GPU default, and the block-compact ``BLNHC``):

1. correctness through the worker role (``kvshelf.roles.worker.WorkerConnector``, no vLLM):
   a simulated forward pass (a matmul per layer on the compute stream) writes nothing the
   check reads but keeps the device busy; random blocks are stored, looked up, loaded layer by
   layer into other blocks (each layer's wait, then that layer's matmul), and every loaded
   block is compared bit for bit;
2. bandwidth: store and load GB/s of the engine for batches of several sizes, against a pinned
   ``cudaMemcpy`` (D2H for stores, H2D for loads) of the same bytes in the same run;
3. overlap: a 16-layer layer-wise load beside compute that takes about as long as the copy:
   ``hidden_fraction`` = the share of the copy time the overlap saved.

4. probes (:mod:`benchmarks.gpu_probes`), one question of the engine's review each: the
   copy path per layout, copy launches of 64 hits in one step, a registration the driver
   refuses (712), nothing left pinned after close; and beside the forward pass
   (:mod:`benchmarks.gpu_step_probes`): a load ordered before the blocks' reads under FULL
   and PIECEWISE graphs with a negative control that does not wait, an engine attaching
   during a global-mode graph capture, the forward pass's slowdown beside kvshelf's copies
   against a DMA of the same bytes.

Writes ``bench/results/gpu.json``: ``{"meta", "rows", "probes", "targets"}``, each row with
``layout``, ``direction`` (``store``, ``load``, ``layerwise_load``), ``batch_bytes``, ``gbps``,
``pinned_memcpy_gbps``, ``ratio``, ``hidden_fraction``; each probe with ``layout``, ``probe``,
``ok``, ``detail``. It exits 1 unless every block is bit-exact and every probe ok.

``--device cpu`` (the default without CUDA) dry-runs the same flow on CPU tensors, the CUDA
engine's streams and the CUDA driver it pins the arena through faked
(:class:`~kvshelf.transfer.streams.FakeCudaStreams`,
:class:`~testbed.cuda_driver.FakeCudaDriver`): it checks the flow and the bytes, and
runs every probe on the fakes; its figures are labelled dry-run and never written as GPU
results (only where ``--out`` says). Imports torch and kvshelf, never vLLM (the GPU machine
has none); the wheels it needs besides torch are :data:`benchmarks.gpu_wheels.WHEELS`,
checked first.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.gpu_probes import ProbeResult, Probes
from benchmarks.gpu_step_probes import StepProbes
from benchmarks.gpu_wheels import require_wheels
from kvshelf.plan import LoadJob
from kvshelf.protocol import PageLayout
from kvshelf.roles.worker import WorkerConnector
from kvshelf.transfer import (
    CudaTransferEngine,
    KVCacheLayout,
    TransferEngine,
    engine_for,
    engine_override,
    map_arena,
)
from kvshelf.transfer.pinned import CudaDriver
from kvshelf.transfer.streams import FakeCudaStreams
from testbed.cuda_driver import FakeCudaDriver
from testbed.kv_layouts import make_kv_caches
from testbed.server import ServerProcess
from testbed.worker import store_and_lock

LAYOUTS = ("LBNHC", "BLNHC")
DEFAULT_OUT = Path("bench/results/gpu.json")
TARGET_RATIO = 0.8
TARGET_HIDDEN = 0.8
TARGET_MIN_BATCH = 64 << 20


@dataclass(frozen=True)
class Geometry:
    """The KV cache and the batches of one run."""

    layers: int
    heads: int
    tokens: int
    content: int
    num_blocks: int
    batch_mib: tuple[float, ...]
    arena_gb: float
    repeats: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


# 16 layers of 8 KV heads x 128 (K||V: 256) in bf16, 16 tokens per block: 1 MiB pages.
GPU = Geometry(16, 8, 16, 256, 1024, (16, 64, 256), 2.0, 5, "bfloat16")
DRY_RUN = Geometry(16, 2, 16, 32, 96, (0.25, 0.5), 0.25, 2, "float16")
# The server grows each pool (one per layout here) by 64 MiB extents of its arena.


@dataclass
class Row:
    layout: str
    direction: str
    batch_bytes: int
    gbps: float
    pinned_memcpy_gbps: float
    ratio: float
    hidden_fraction: float | None


class Device:
    """The device's clock, stream sync and simulated compute (or their CPU stand-ins)."""

    def __init__(self, name: str) -> None:
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"
        side = 2048 if self.cuda else 128
        dtype = torch.bfloat16 if self.cuda else torch.float32
        self._a = torch.randn(side, side, device=self.device, dtype=dtype)
        self._b = torch.randn(side, side, device=self.device, dtype=dtype)
        self.matmuls_per_layer = 1

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed(self, work: Callable[[], None]) -> float:
        """Seconds ``work`` takes until the device is idle again."""
        self.sync()
        start = time.perf_counter()
        work()
        self.sync()
        return time.perf_counter() - start

    def layer_compute(self) -> None:
        """One layer of the simulated forward pass, on the current (compute) stream."""
        for _ in range(self.matmuls_per_layer):
            torch.mm(self._a, self._b)

    def calibrate(self, seconds_per_layer: float) -> None:
        """Make :meth:`layer_compute` take about ``seconds_per_layer``."""
        self.matmuls_per_layer = 1
        one = min(self.timed(self.layer_compute) for _ in range(3))
        self.matmuls_per_layer = max(1, round(seconds_per_layer / max(one, 1e-7)))

    def pinned_memcpy_gbps(self, nbytes: int, repeats: int) -> tuple[float, float]:
        """GB/s of one D2H and one H2D copy of ``nbytes`` between pinned host and device."""
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        d2h = _median(repeats, lambda: self.timed(lambda: host.copy_(dev, non_blocking=True)))
        h2d = _median(repeats, lambda: self.timed(lambda: dev.copy_(host, non_blocking=True)))
        return nbytes / d2h / 1e9, nbytes / h2d / 1e9


def _median(repeats: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(repeats))


def _block_bytes(caches: dict[str, torch.Tensor], blocks: list[int]) -> list[torch.Tensor]:
    index = torch.tensor(blocks, device=next(iter(caches.values())).device)
    return [t.index_select(0, index).contiguous().view(torch.uint8).cpu() for t in caches.values()]


def _same(caches: dict[str, torch.Tensor], blocks: list[int], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(_block_bytes(caches, blocks), want, strict=True))


def _zero(caches: dict[str, torch.Tensor], blocks: list[int]) -> None:
    index = torch.tensor(blocks, device=next(iter(caches.values())).device)
    for tensor in caches.values():
        tensor.index_fill_(0, index, 0)


class Check:
    """One run: a server, then every layout."""

    def __init__(self, device: Device, geometry: Geometry, server: ServerProcess) -> None:
        self.device = device
        self.geometry = geometry
        self.server = server
        self.rows: list[Row] = []
        self.bit_exact: dict[str, bool] = {}
        self.probes: list[ProbeResult] = []
        # The driver the probes pin through: libcuda on a GPU, over a fake library dry.
        self.driver = CudaDriver(FakeCudaDriver()) if not device.cuda else CudaDriver.load()
        self._gen = torch.Generator().manual_seed(0)
        self._hash = 0

    def _hashes(self, n: int) -> tuple[bytes, ...]:
        self._hash += n
        return tuple(b"gpu-check-%d" % i for i in range(self._hash - n, self._hash))

    def _random_blocks(self, n: int, exclude: set[int] = frozenset()) -> list[int]:
        order = torch.randperm(self.geometry.num_blocks, generator=self._gen).tolist()
        return [b for b in order if b not in exclude][:n]

    def run_layout(self, name: str) -> None:
        g = self.geometry
        caches = make_kv_caches(
            name,
            num_layers=g.layers,
            num_blocks=g.num_blocks,
            heads=g.heads,
            tokens=g.tokens,
            content=g.content,
            dtype=g.torch_dtype,
            device=self.device.device,
        )
        layout = KVCacheLayout.from_kv_caches(caches, g.num_blocks)
        worker = WorkerConnector(
            client_factory=lambda: self.server.client(timeout_s=30.0),
            model_fingerprint="gpu-check",
            layout_fingerprint=f"gpu-check-{name}",
            rank=0,
            world_size=1,
        )
        worker.register_kv_caches(caches, g.num_blocks)
        try:
            self.bit_exact[name] = self._through_worker(worker, caches)
            self._bandwidth(name, worker.pool, caches, layout)
        finally:
            worker.shutdown()

    def _through_worker(self, worker: WorkerConnector, caches: dict[str, torch.Tensor]) -> bool:
        """Store random blocks after a forward pass, load them layer by layer into others."""
        n = min(self.geometry.num_blocks // 4, 64)
        sources = self._random_blocks(n)
        targets = self._random_blocks(n, exclude=set(sources))
        want = _block_bytes(caches, sources)
        hashes = self._hashes(n)
        for _ in caches:
            self.device.layer_compute()
        try:
            hit = store_and_lock(worker, self.server, tuple(sources), hashes, "gpu-check")
        except AssertionError as exc:
            print(f"  not every block was stored: {exc}", file=sys.stderr)
            return False
        _zero(caches, targets)
        worker.start_loads(
            [LoadJob("gpu-check", tuple(targets), (tuple(hit.pages[0]),), hit.lock_id, hit.boot_id)]
        )
        for layer in caches:
            worker.wait_for_layer(layer)
            self.device.layer_compute()
        worker.finish_loads()
        errors = worker.take_load_errors()
        self.device.sync()
        return not errors and _same(caches, targets, want)

    def _bandwidth(
        self, name: str, pool: str, caches: dict[str, torch.Tensor], layout: KVCacheLayout
    ) -> None:
        g = self.geometry
        with self.server.client(timeout_s=30.0) as client:
            registration = client.register(
                PageLayout(
                    model_fingerprint="gpu-check",
                    layout_fingerprint=f"gpu-check-{name}",
                    page_bytes=layout.page_bytes,
                    world_size=1,
                    rank=0,
                )
            )
            mapping = map_arena(registration.shm_name, registration.arena_bytes)
            engine = engine_for(caches)(caches, layout, mapping.buffer)
            try:
                for mib in g.batch_mib:
                    n = min(g.num_blocks // 2, max(1, round(mib * 2**20 / layout.page_bytes)))
                    reservation = client.reserve(pool, 0, list(self._hashes(n)))
                    pages = [p for p in reservation.pages if p is not None]
                    try:
                        self._measure(name, engine, caches, pages, mib == g.batch_mib[-1])
                    finally:
                        client.abort(reservation.reservation_id)
            finally:
                engine.close()
            try:
                self.probes += self._probes(name, caches, layout, mapping.buffer)
            finally:
                mapping.close()

    def _probes(
        self,
        name: str,
        caches: dict[str, torch.Tensor],
        layout: KVCacheLayout,
        arena: torch.Tensor,
    ) -> list[ProbeResult]:
        """The review's questions on this layout (the layout-independent ones once); no view of
        the arena outlives this call (the caller unmaps it next)."""
        dry_run, once = not self.device.cuda, not self.probes
        probes = Probes(
            name, caches, layout, arena, self.driver, dry_run=dry_run, sync=self.device.sync
        )
        step = StepProbes(probes, compute=self._forward_pass, repeats=self.geometry.repeats)
        return probes.run(once=once) + step.run(once=once)

    def _forward_pass(self) -> None:
        """The simulated forward pass: one layer's compute per layer."""
        for _ in range(self.geometry.layers):
            self.device.layer_compute()

    def _measure(
        self,
        name: str,
        engine: TransferEngine,
        caches: dict[str, torch.Tensor],
        pages: list[int],
        overlap: bool,
    ) -> None:
        g, dev = self.geometry, self.device
        n = len(pages)
        nbytes = n * engine.layout.page_bytes
        sources = self._random_blocks(n)
        targets = self._random_blocks(n, exclude=set(sources))
        want = _block_bytes(caches, sources)
        d2h, h2d = dev.pinned_memcpy_gbps(nbytes, g.repeats)

        def store() -> None:
            engine.store(sources, pages, after=engine.forward_fence()).wait()

        def load() -> None:
            engine.load(pages, targets).wait()

        store_s = _median(g.repeats, lambda: dev.timed(store))
        load_s = _median(g.repeats, lambda: dev.timed(load))
        self.bit_exact[name] = self.bit_exact.get(name, True) and _same(caches, targets, want)
        for direction, seconds, pinned in (("store", store_s, d2h), ("load", load_s, h2d)):
            gbps = nbytes / seconds / 1e9
            self.rows.append(Row(name, direction, nbytes, gbps, pinned, gbps / pinned, None))
        if overlap:
            self.rows.append(self._overlap(name, engine, pages, targets, nbytes, h2d))

    def _overlap(
        self,
        name: str,
        engine: TransferEngine,
        pages: list[int],
        targets: list[int],
        nbytes: int,
        h2d: float,
    ) -> Row:
        """A layer-wise load beside compute as long as the copy: the share of it hidden."""
        g, dev = self.geometry, self.device

        def load_alone() -> None:
            copying = engine.begin_loads([(pages, targets)])
            copying.run()
            copying.wait_all()

        load_s = _median(g.repeats, lambda: dev.timed(load_alone))
        dev.calibrate(load_s / g.layers)

        def both() -> None:
            copying = engine.begin_loads([(pages, targets)])
            copying.run()  # the worker's load thread; on CUDA it only enqueues
            for layer in range(g.layers):
                copying.wait_layer(layer)
                dev.layer_compute()
            copying.wait_all()

        compute_s = _median(g.repeats, lambda: dev.timed(self._forward_pass))
        both_s = _median(g.repeats, lambda: dev.timed(both))
        hidden = max(0.0, min(1.0, (load_s + compute_s - both_s) / load_s))
        gbps = nbytes / load_s / 1e9
        return Row(name, "layerwise_load", nbytes, gbps, h2d, gbps / h2d, hidden)


@contextlib.contextmanager
def _engines(dry_run: bool) -> Iterator[None]:
    """On a dry run, the CUDA engine's code copies the CPU tensors, its streams and driver
    faked (the arena is pinned through the fake driver and aliased through DLPack)."""
    if not dry_run:
        yield
        return

    def fake(kv_caches, layout, arena):
        driver = CudaDriver(FakeCudaDriver())
        return CudaTransferEngine(
            kv_caches, layout, arena, streams=FakeCudaStreams(), driver=driver
        )

    with engine_override("cpu", fake):
        yield


def _targets(rows: list[Row], bit_exact: dict[str, bool]) -> dict[str, bool]:
    big = [r for r in rows if r.batch_bytes >= TARGET_MIN_BATCH and r.direction != "layerwise_load"]
    overlap = [r for r in rows if r.hidden_fraction is not None]
    return {
        "bit_exact": all(bit_exact.values()),
        "store_load_ratio_at_least_0.8_for_64MiB_batches": bool(big)
        and all(r.ratio >= TARGET_RATIO for r in big),
        "layerwise_load_hidden_at_least_0.8": bool(overlap)
        and all((r.hidden_fraction or 0) >= TARGET_HIDDEN for r in overlap),
    }


def _fit_shared_memory(geometry: Geometry) -> Geometry:
    """Shrink the arena (and the batches with it) to what /dev/shm can hold."""
    stats = os.statvfs("/dev/shm")
    free_gb = stats.f_bavail * stats.f_frsize / 2**30
    arena_gb = min(geometry.arena_gb, 0.8 * free_gb)
    batches = tuple(m for m in geometry.batch_mib if m * 4 <= arena_gb * 1024)
    if not batches:
        raise SystemExit(f"/dev/shm has {free_gb:.2f} GiB free: too little for the GPU check")
    if arena_gb < geometry.arena_gb:
        print(f"/dev/shm has {free_gb:.2f} GiB free: arena {arena_gb:.2f} GiB, batches {batches}")
    return dataclasses.replace(geometry, arena_gb=arena_gb, batch_mib=batches)


def output_path(out: Path | None, *, dry_run: bool) -> Path | None:
    """Where the JSON goes: ``--out``, else the GPU results file, never for a dry run."""
    if out is not None:
        return out
    return None if dry_run else DEFAULT_OUT


def main(argv: list[str] | None = None) -> int:
    # The server this check starts imports wheels the check itself does not.
    require_wheels()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check",
        description="Check the CUDA copy engine on one GPU (or dry-run it on the CPU).",
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda: measure on GPU 0; cpu: dry run, CUDA engine code with faked streams "
        "(default: cuda when available)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"where to write the JSON (default: {DEFAULT_OUT} on a GPU; nothing on a dry run)",
    )
    args = parser.parse_args(argv)
    dry_run = args.device == "cpu"
    if not dry_run and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    geometry = _fit_shared_memory(DRY_RUN if dry_run else GPU)
    device = Device("cpu" if dry_run else "cuda:0")
    started = time.time()
    with ServerProcess(l1_size_gb=geometry.arena_gb) as server, _engines(dry_run):
        check = Check(device, geometry, server)
        for name in LAYOUTS:
            check.run_layout(name)
    mode = "dry-run" if dry_run else "gpu"
    result = {
        "meta": {
            "command": "python -m benchmarks.gpu_check " + " ".join(argv or sys.argv[1:]),
            "mode": mode,
            "device": torch.cuda.get_device_name(0) if not dry_run else "cpu (dry run)",
            "torch": torch.__version__,
            "machine": f"{platform.machine()}, {platform.node()}",
            "geometry": asdict(geometry),
            "wall_s": round(time.time() - started, 2),
            "bit_exact": check.bit_exact,
        },
        "rows": [asdict(row) for row in check.rows],
        "probes": [asdict(probe) for probe in check.probes],
        "targets": _targets(check.rows, check.bit_exact),
    }
    for row in check.rows:
        hidden = "" if row.hidden_fraction is None else f" hidden {row.hidden_fraction:.2f}"
        print(
            f"[{mode}] {row.layout} {row.direction:15s} {row.batch_bytes / 2**20:8.2f} MiB "
            f"{row.gbps:8.2f} GB/s  pinned memcpy {row.pinned_memcpy_gbps:8.2f} GB/s  "
            f"ratio {row.ratio:5.2f}{hidden}"
        )
    for probe in check.probes:
        verdict = "ok  " if probe.ok else "FAIL"
        print(f"[{mode}] {verdict} {probe.layout} {probe.probe}: {probe.detail}")
    print(f"[{mode}] bit exact: {check.bit_exact}; targets: {result['targets']}")
    out = output_path(args.out, dry_run=dry_run)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"[{mode}] wrote {out}")
    probes_ok = all(probe.ok for probe in check.probes)
    return 0 if all(check.bit_exact.values()) and probes_ok else 1


if __name__ == "__main__":
    sys.exit(main())
