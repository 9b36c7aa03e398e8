"""The CUDA copy engine: KV blocks between CUDA KV cache tensors and the pinned shared arena.

The arena stays where the server put it (host shared memory); the engine registers the chunks
it uses as pinned memory through the CUDA driver, in the background
(:mod:`kvshelf.transfer.pinned`), and reaches them two ways:

- a CUDA tensor aliasing the arena's device address (unified addressing): gather/scatter
  kernels (``index_select``, ``index_copy_``) move every block of a batch in one or two kernel
  launches per layer, whatever the order of blocks and pages;
- a CPU tensor over the same pinned memory: when the KV cache is block-compact (one block of
  every layer is one run of ``page_bytes``, :meth:`KVCacheLayout.whole_page_view`) and a batch
  is a few runs of consecutive blocks and pages, each run is one DMA (``copy_(non_blocking)``).

Ordering (all of it through :class:`~kvshelf.transfer.streams.Streams`, so that CPU tests
drive it with :class:`~kvshelf.transfer.streams.FakeCudaStreams`):

- a store runs on the engine's store stream, which first waits on the fence the worker
  recorded on the compute stream after the step's forward pass (:meth:`forward_fence`); its
  handle is the event recorded after the copies, and the worker commits the pages only once
  that handle is done (the blocks stay held until then);
- one step's loads are merged into one batch (:mod:`kvshelf.transfer.cuda_loads`) and run on
  the load stream, which first waits on an event recorded when they began, then copies layer
  0 of all of them (one gather/scatter), records event 0, layer 1, event 1, ...; the wait
  for layer ``i`` makes the compute stream wait on event ``i`` only, never blocking the host;
  :meth:`CudaLayerwiseLoad.finished` says, without blocking, when the arena may be released.
- the load stream is opened at high priority, above the forward pass's kernels (the next
  layer waits on it), the store stream at CUDA's lowest (:data:`STREAM_PRIORITIES`);
- a load whose pages are not pinned yet fails at once (a miss for the step: vLLM recomputes);
  their chunk is registered in the background for the next request.

Every entry point runs inside the streams' device scope: the store and load threads are
kvshelf's own, and their CUDA calls must go to the rank's device, not to GPU 0.

Registers itself with :mod:`kvshelf.transfer.factory` for ``cuda`` tensors. No vLLM import.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from kvshelf.transfer.base import IndexLike, NotReady, TransferEngine, TransferHandle
from kvshelf.transfer.cuda_loads import CopyBatch, CudaLayerwiseLoad, RefusedLoads
from kvshelf.transfer.factory import UnsupportedKVCache, register_engine
from kvshelf.transfer.layout import KVCacheLayout
from kvshelf.transfer.pinned import CudaDriver, PinnedArena, PinningError, host_alias
from kvshelf.transfer.staging import StoreStaging
from kvshelf.transfer.streams import (
    LOAD,
    STORE,
    STREAM_PRIORITIES,
    CudaStreams,
    Event,
    Streams,
)
from kvshelf.transfer.views import arena_pages, layer_views, sorted_batch, sorted_by


class NotPinned(NotReady):
    """The pages are in a chunk of the arena that is not pinned: not yet (it is being
    registered in the background: a load is a miss for this step), or CUDA refused it."""


class _EventHandle(TransferHandle):
    def __init__(self, streams: Streams, event: Event) -> None:
        self._streams = streams
        self._event = event

    def done(self) -> bool:
        with self._streams.device_scope():
            return self._streams.query(self._event)

    def wait(self) -> None:
        with self._streams.device_scope():
            self._streams.synchronize(self._event)

    def order_compute(self) -> None:
        with self._streams.device_scope():
            self._streams.compute_wait(self._event)


class CudaTransferEngine(TransferEngine):
    """Asynchronous block copies between CUDA KV caches and the server's arena.

    Args:
        kv_caches: layer name -> KV cache tensor, all on one CUDA device.
        layout: the page layout computed from these tensors.
        arena: the arena as a 1-D uint8 CPU tensor (``ArenaMapping.buffer``).
        streams: None on a GPU (the engine makes :class:`CudaStreams`); a fake
            (:class:`~kvshelf.transfer.streams.FakeCudaStreams`) with CPU KV caches for tests
            and the GPU check's dry run: the kernels then run on the CPU.
        driver: the CUDA driver the arena is pinned through. None: ``libcuda.so.1`` on a GPU,
            nothing pinned with fake streams. Tests pass a fake driver with fake streams to
            drive the pinning code on the CPU.

    Raises:
        UnsupportedKVCache: CUDA is not usable here, the arena cannot be pinned or reached at
            its own address, the tensors are not on one device, or they do not match
            ``layout``; nothing stays pinned.
    """

    DMA_MAX_RUNS = 16
    """Batches of at most this many runs of pages (and runs of 4 blocks on average, or at most
    2 runs) are sent one DMA per run (block-compact caches: blocks and pages both in runs;
    other stores: staged, :mod:`kvshelf.transfer.staging`); others by kernels, so that the
    number of copy calls never grows with the number of blocks."""

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layout: KVCacheLayout,
        arena: torch.Tensor,
        *,
        streams: Streams | None = None,
        driver: CudaDriver | None = None,
        defer_start: bool = False,
    ) -> None:
        super().__init__(layout)
        devices = {tensor.device for tensor in kv_caches.values()}
        if len(devices) != 1:
            raise UnsupportedKVCache(f"KV caches on {sorted(map(str, devices))}: one device needed")
        self.device = devices.pop()
        if streams is not None and self.device != arena.device:
            raise UnsupportedKVCache("fake streams copy CPU KV caches only")
        self._kv_caches = dict(kv_caches)
        self._arena = arena
        self._streams: Streams | None = streams
        self._driver = driver
        self._pinned: PinnedArena | None = None
        self.num_blocks = layout.num_blocks
        self.num_pages = 0
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pages_host = torch.empty(0, 0, dtype=torch.uint8)
        # Block-compact: whole pages, as bytes for DMA runs and as 8-byte words for kernels.
        self._whole_pages: torch.Tensor | None = None
        self._whole_words: tuple[torch.Tensor, torch.Tensor] | None = None
        # Not block-compact: stores staged on the device, then one DMA per run of pages.
        self._staging: StoreStaging | None = None
        # Guards _closed and _pending: the events of copies the engine must outlive.
        self._state = threading.Lock()
        self._closed = False
        self._pending: list[Event] = []
        # start() runs once (on the step loop); its failure is remembered and raised again.
        self._start_lock = threading.Lock()
        self._started = False
        self._failure: str | None = None
        if not defer_start:
            self.start()

    def start(self) -> None:
        """Make the engine's CUDA objects: its streams, the arena's pinning (chunk 0 asked for
        in the background) and device alias, the views its copies use. See
        :meth:`TransferEngine.start`: the worker's engines are built with ``defer_start``, so
        that none of this runs while vLLM may be capturing CUDA graphs.

        Raises:
            UnsupportedKVCache: CUDA is not usable here, the arena cannot be pinned or reached
                at its own address, or the tensors do not match the layout; nothing stays
                pinned, and every later call raises the same.
        """
        if self._started:
            return
        with self._start_lock:
            if self._started:
                return
            if self._failure is None:
                try:
                    self._start()
                except UnsupportedKVCache as exc:
                    self._failure = str(exc)
            if self._failure is not None:
                raise UnsupportedKVCache(self._failure)
            self._started = True
            # The engine keeps what it copies with, not what it was built from.
            self._kv_caches = {}

    def _start(self) -> None:
        if self._streams is None:
            self._streams = _cuda_streams(self.device)
            if self._driver is None:
                self._driver = _load_driver()
        streams, driver, arena, layout = self._streams, self._driver, self._arena, self.layout
        kv_caches = self._kv_caches
        failure: str | None = None
        try:
            with streams.device_scope():
                streams.open(STREAM_PRIORITIES)
                pages_host = arena_pages(arena, layout, kv_caches)
                pages_dev = pages_host
                if driver is not None:
                    self._pinned = _pin_arena(arena, layout, driver, self.device)
                    pages_dev = host_alias(pages_host, self.device)
                layers = [
                    layer_views(kv_caches[layer.name], layer, layout, pages_dev)
                    for layer in layout.layers
                ]
                whole = layout.whole_page_view(kv_caches)
        except Exception as exc:
            # Nothing may stay pinned: the worker unmaps the arena and serves uncached.
            if self._pinned is not None:
                self._pinned.close()
            if isinstance(exc, UnsupportedKVCache):
                raise
            failure = (
                f"the CUDA copy engine cannot use the kvshelf arena on {self.device}: "
                f"{type(exc).__name__}: {exc}"
            )
        if failure is not None:
            # Raised here, not chained: the failure's frames would keep views of the arena
            # alive, and the worker unmaps it next.
            raise UnsupportedKVCache(failure)
        self._layers = layers
        self.num_pages = pages_host.shape[0]
        self._pages_host = pages_host
        # page_bytes is a multiple of 64, and vLLM's buffers are aligned.
        if whole is not None and whole.is_contiguous() and whole.data_ptr() % 8 == 0:
            self._whole_pages = whole
            self._whole_words = (whole.view(torch.int64), pages_dev.view(torch.int64))
        else:
            self._staging = StoreStaging(layers, pages_dev, pages_host, self.device)

    def _require_started(self) -> None:
        if not self._started:
            raise NotReady(self._failure or "the CUDA copy engine starts with vLLM's next step")

    @property
    def streams(self) -> Streams:
        """The streams the engine orders its copies with (made by :meth:`start` on a GPU)."""
        assert self._streams is not None, "start() first"
        return self._streams

    @property
    def block_compact(self) -> bool:
        """Whether each block is one contiguous run laid out as a page (DMA per run)."""
        return self._whole_pages is not None

    def forward_fence(self) -> Event | None:
        """An event on the caller's current stream: call it after the step's forward pass.
        None before :meth:`start` (a store is then refused anyway)."""
        if not self._started:
            return None
        with self.streams.device_scope():
            return self.streams.record_compute()

    def store(
        self, block_ids: IndexLike, page_indices: IndexLike, *, after: object | None = None
    ) -> TransferHandle:
        """See :meth:`TransferEngine.store`; registers the pages' chunks first if needed (the
        store thread's time, never the step loop's).

        Raises:
            NotReady: the engine has not started (:meth:`start`).
        """
        self._require_started()
        batch = self._batch(block_ids, self.num_blocks, page_indices, self.num_pages)
        streams = self.streams
        with streams.device_scope():
            self._pin(batch.dst)
            if after is None:
                # No fence: whatever may still write these blocks must finish first.
                streams.synchronize_device()
            assert after is None or isinstance(after, Event)
            event = self.submit(STORE, after, lambda: self._copy_all(True, batch))
        return _EventHandle(streams, event)

    def load(self, page_indices: IndexLike, block_ids: IndexLike) -> TransferHandle:
        """See :meth:`TransferEngine.load`; registers the pages' chunks first if needed (for
        benchmarks and tests: the worker loads through :meth:`begin_loads`)."""
        self._require_started()
        batch = self._batch(page_indices, self.num_pages, block_ids, self.num_blocks)
        streams = self.streams
        with streams.device_scope():
            self._pin(batch.src)
            fence = streams.record_compute()
            event = self.submit(LOAD, fence, lambda: self._copy_all(False, batch))
        return _EventHandle(streams, event)

    def begin_loads(
        self, loads: Sequence[tuple[IndexLike, IndexLike]]
    ) -> CudaLayerwiseLoad | RefusedLoads:
        """Validate every load now and merge them into one batch; the copies are enqueued by
        whoever runs or waits first, one gather/scatter per layer for the whole step.

        A load whose pages are not pinned yet fails with :class:`NotPinned` (the step
        loop never waits for a registration; the chunk is registered in the background), one
        writing a block an earlier load of the step writes with ``ValueError``. Before
        :meth:`start`, every load fails with :class:`NotReady`.
        """
        if not self._started:
            return RefusedLoads(len(loads), self._failure or "the CUDA copy engine has not started")
        merged: list[int] = []
        failures: dict[int, BaseException] = {}
        src: list[int] = []
        dst: list[int] = []
        written: set[int] = set()
        for index, (page_indices, block_ids) in enumerate(loads):
            try:
                batch = self._batch(page_indices, self.num_pages, block_ids, self.num_blocks)
                if self._pinned is not None and not self._pinned.pinned(batch.src):
                    raise NotPinned("the load's arena pages are not pinned (yet)")
                if not written.isdisjoint(batch.dst):
                    raise ValueError("a load writes blocks another load of the step writes")
                written.update(batch.dst)
                src += batch.src
                dst += batch.dst
                merged.append(index)
            except Exception as exc:
                failures[index] = exc
        # One index pair for the whole step: per layer, one gather and one scatter however
        # many requests hit (launches grow with layers, not with loads x layers).
        dst, src = sorted_by(dst, src)
        with self.streams.device_scope():
            began = self.streams.record_compute()
        return CudaLayerwiseLoad(
            self, self.layout.num_layers, CopyBatch(src, dst), merged, failures, began
        )

    def close(self) -> None:
        with self._state:
            self._closed = True
            pending, self._pending = self._pending, []
        try:
            if pending:
                with self.streams.device_scope():
                    for event in pending:
                        self.streams.synchronize(event)
        finally:
            # Even when a wait raised (a sticky CUDA error): nothing may stay pinned once the
            # worker unmaps the arena.
            if self._pinned is not None:
                # Kept (closed) rather than dropped: a store racing close finds it refusing.
                self._pinned.close()
            # No view of the arena may outlive close: the worker unmaps it next.
            self._arena = torch.empty(0, dtype=torch.uint8)
            self._kv_caches = {}
            self._layers = []
            self._whole_pages = None
            self._whole_words = None
            self._staging = None
            self._pages_host = torch.empty(0, 0, dtype=torch.uint8)

    def submit(self, stream: str, after: Event | None, work: Callable[[], None]) -> Event:
        """Enqueue ``work`` on ``stream`` after ``after``; the engine outlives its copies."""
        with self._state:
            if self._closed:
                raise NotReady("transfer engine is closed")
            event = self.streams.enqueue(stream, after, work)
            self._pending = [e for e in self._pending if not self.streams.query(e)]
            self._pending.append(event)
        return event

    # ------------------------------------------------------------------ internals

    def _batch(self, src: IndexLike, src_rows: int, dst: IndexLike, dst_rows: int) -> CopyBatch:
        with self._state:
            if self._closed:
                raise NotReady("transfer engine is closed")
        return CopyBatch(*sorted_batch(src, src_rows, dst, dst_rows))

    def _pin(self, page_indices: list[int]) -> None:
        if self._pinned is not None:
            try:
                self._pinned.ensure(page_indices)
            except PinningError as exc:
                raise NotPinned(str(exc)) from exc

    def _copy_all(self, to_pages: bool, batch: CopyBatch) -> None:
        """Copy every layer of a batch (inside :meth:`submit`'s work)."""
        if not batch.dst:
            return
        if self._whole_pages is not None:
            self._copy_whole(to_pages, batch)
            return
        if to_pages and self._staging is not None:
            breaks = _run_breaks(batch.dst, batch.dst, batch.dst, self._pages_per_chunk())
            if self._few_runs(len(breaks) + 1, len(batch.dst)):
                starts, ends = [0, *breaks], [*breaks, len(batch.dst)]
                src, _ = batch.on(self.device)
                runs = list(zip(starts, ends, strict=True))
                self._staging.store(src, batch.dst, runs, self.streams.note_copy)
                return
        for layer in range(len(self._layers)):
            self.copy_layer(to_pages, layer, batch)

    def copy_layer(self, to_pages: bool, layer: int, batch: CopyBatch) -> None:
        """Copy one layer of a batch: a gather and a scatter kernel."""
        if not batch.dst:
            return
        blocks, pages = self._layers[layer]
        src_view, dst_view = (blocks, pages) if to_pages else (pages, blocks)
        src, dst = batch.on(self.device)
        self.streams.note_copy(f"layer {layer} x{len(batch.dst)}")
        _gather_scatter(src_view, src, dst_view, dst)

    def _pages_per_chunk(self) -> int:
        """Pages per pinned registration: one DMA stays inside one."""
        return self._pinned.pages_per_chunk if self._pinned is not None else self.num_pages

    def _few_runs(self, num_runs: int, rows: int) -> bool:
        """Whether a batch of ``rows`` in ``num_runs`` runs is sent one DMA per run."""
        return num_runs <= 2 or (num_runs <= self.DMA_MAX_RUNS and 4 * num_runs <= rows)

    def _copy_whole(self, to_pages: bool, batch: CopyBatch) -> None:
        """Copy whole pages: one DMA per run of consecutive rows, or one gather/scatter."""
        assert self._whole_pages is not None and self._whole_words is not None
        pages_col = batch.dst if to_pages else batch.src
        breaks = _run_breaks(batch.src, batch.dst, pages_col, self._pages_per_chunk())
        if not self._few_runs(len(breaks) + 1, len(batch.dst)):
            blocks, pages = self._whole_words
            src_view, dst_view = (blocks, pages) if to_pages else (pages, blocks)
            src, dst = batch.on(self.device)
            self.streams.note_copy(f"pages x{len(batch.dst)} (kernel)")
            _gather_scatter(src_view, src, dst_view, dst)
            return
        starts = [0, *breaks]
        ends = [*breaks, len(batch.dst)]
        src_view = self._whole_pages if to_pages else self._pages_host
        dst_view = self._pages_host if to_pages else self._whole_pages
        for start, end in zip(starts, ends, strict=True):
            first_src, first_dst = batch.src[start], batch.dst[start]
            self.streams.note_copy(f"pages x{end - start}")
            dst_view.narrow(0, first_dst, end - start).copy_(
                src_view.narrow(0, first_src, end - start), non_blocking=True
            )


def _gather_scatter(
    src_view: torch.Tensor, src: torch.Tensor, dst_view: torch.Tensor, dst: torch.Tensor
) -> None:
    """``dst_view[dst] = src_view[src]``, row-wise, for any order of rows."""
    dst_view.index_copy_(0, dst, torch.index_select(src_view, 0, src))


def _run_breaks(
    src: list[int], dst: list[int], pages: list[int], pages_per_chunk: int
) -> list[int]:
    """Positions where a run of consecutive sources and destinations ends, or where the pages
    cross into another pinned chunk (one DMA must stay inside one registration)."""
    return [
        i
        for i in range(1, len(dst))
        if src[i] != src[i - 1] + 1
        or dst[i] != dst[i - 1] + 1
        or pages[i] // pages_per_chunk != pages[i - 1] // pages_per_chunk
    ]


def _cuda_streams(device: torch.device) -> Streams:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise UnsupportedKVCache(f"KV caches on {device}, but CUDA is not usable in this process")
    return CudaStreams(device)


def _load_driver() -> CudaDriver:
    try:
        return CudaDriver.load()
    except PinningError as exc:
        raise UnsupportedKVCache(str(exc)) from exc


def _pin_arena(
    arena: torch.Tensor, layout: KVCacheLayout, driver: CudaDriver, device: torch.device
) -> PinnedArena:
    """The arena's pinning, its first chunk asked for in the background right away."""
    index = device.index or 0
    if not driver.reaches_host_pointers(index):
        raise UnsupportedKVCache(
            f"{device} reaches pinned host memory at another address (no unified addressing)"
        )
    pinned = PinnedArena(arena, layout.page_bytes, driver, index)
    pinned.pinned([0])
    return pinned


def _make(
    kv_caches: Mapping[str, torch.Tensor], layout: KVCacheLayout, arena: torch.Tensor
) -> CudaTransferEngine:
    # The worker may attach (build this) on its store thread while vLLM captures CUDA graphs:
    # every CUDA call waits for the step loop's start().
    return CudaTransferEngine(kv_caches, layout, arena, defer_start=True)


register_engine("cuda", _make)
