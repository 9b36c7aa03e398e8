"""The CPU copy engine: whole KV blocks (all layers of one rank) between CPU KV cache tensors
and the shared-memory arena, and its layer-by-layer load of one step's loads.

The arena is viewed as ``[arena_bytes // page_bytes, page_bytes]`` bytes: a page is named by
its page index, and one layer's slice of every page is a strided view of the same shape as that
layer's KV cache with its block dimension moved to the front. A batch is then one gather (or
scatter) per layer, never a Python loop per block or per token.

Registers itself with :mod:`kvshelf.transfer.factory` for ``cpu`` tensors. No vLLM import.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from kvshelf.transfer.base import (
    COMPLETED,
    IndexLike,
    LayerwiseLoad,
    NotReady,
    TransferEngine,
    TransferHandle,
)
from kvshelf.transfer.factory import register_engine
from kvshelf.transfer.layout import KVCacheLayout, LayerLayout
from kvshelf.transfer.views import (
    arena_pages,
    index_tensor,
    layer_views,
    runs,
    sorted_batch,
    sorted_by,
)


class CpuTransferEngine(TransferEngine):
    """Synchronous block copies between CPU KV cache tensors and a CPU (shared-memory) arena.

    For every layer it keeps two views of the same shape ``[rows, *block_shape]``: the layer's
    KV cache with the block dimension moved to the front (``rows`` = blocks), and that layer's
    slice of every arena page (``rows`` = pages), both reinterpreted as the widest element type
    the alignment allows. A batch is sorted by destination and copied in one of three ways:

    - destinations form few consecutive runs: per run, one ``index_select`` per layer straight
      into the destination run (a gather, one copy);
    - sources form few consecutive runs: per run, one ``index_copy_`` per layer straight from
      the source run (a scatter, one copy);
    - otherwise: per layer, a gather into a scratch buffer then a scatter (two copies), in
      chunks of about ``scratch_bytes`` (and at least :attr:`SCRATCH_MIN_ROWS` blocks).

    "Few runs" means at most 2, or an average run of at least :attr:`MIN_MEAN_RUN` blocks that
    also saves more than the extra calls cost, so the number of copy calls per layer is never
    proportional to the number of blocks.

    The engine is thread-safe, and copies in different threads run at the same time (each
    thread has its own scratch buffer), so a load never waits for a store in another thread,
    and two threads can split the layers of one load. ``close`` waits for running copies.

    Args:
        kv_caches: layer name -> KV cache tensor (CPU), the same layers as ``layout``.
        layout: the page layout computed from these tensors.
        arena: the arena as a 1-D uint8 CPU tensor (for example ``ArenaMapping.buffer``).
        scratch_bytes: target size of a scratch chunk, used when neither side has long runs
            (small enough to stay in cache between the gather and the scatter).

    Raises:
        ValueError: tensors that do not match ``layout``, non-CPU tensors, or an arena that is
            not a 1-D uint8 tensor of at least one page.
    """

    RUN_CALL_BYTES = 64 * 1024
    """Cost of one extra copy call, in bytes copied: runs are used while they cost less than
    the second copy of the scratch path."""

    MIN_MEAN_RUN = 4
    """Runs shorter than this on average are never copied run by run."""

    SCRATCH_MIN_ROWS = 32
    """A scratch chunk holds at least this many blocks of a layer, however large they are."""

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layout: KVCacheLayout,
        arena: torch.Tensor,
        *,
        scratch_bytes: int = 1024 * 1024,
    ) -> None:
        super().__init__(layout)
        pages = arena_pages(arena, layout, kv_caches)
        self.num_pages = pages.shape[0]
        self._block_views: list[torch.Tensor] = []
        self._page_views: list[torch.Tensor] = []
        for layer in layout.layers:
            if kv_caches[layer.name].device.type != "cpu":
                raise ValueError(
                    f"layer {layer.name!r} is on {kv_caches[layer.name].device}, not the CPU"
                )
            block_view, page_view = layer_views(kv_caches[layer.name], layer, layout, pages)
            self._block_views.append(block_view)
            self._page_views.append(page_view)
        self.num_blocks = layout.num_blocks
        self._mean_layer_bytes = layout.page_bytes // layout.num_layers
        self._scratch_bytes = scratch_bytes
        self._thread_scratch = threading.local()
        # Guards _closed, _copies_running and the views. Invariant: the views are only
        # dropped (by close) while no copy is running.
        self._state = threading.Condition()
        self._copies_running = 0
        self._closed = False

    def store(
        self, block_ids: IndexLike, page_indices: IndexLike, *, after: object | None = None
    ) -> TransferHandle:
        src, dst = self._indices(block_ids, self.num_blocks, page_indices, self.num_pages)
        if dst:
            self._copy_every_layer(self._layer_copier(src, dst), to_pages=True)
        return COMPLETED

    def load(self, page_indices: IndexLike, block_ids: IndexLike) -> TransferHandle:
        src, dst = self._indices(page_indices, self.num_pages, block_ids, self.num_blocks)
        if dst:
            self._copy_every_layer(self._layer_copier(src, dst), to_pages=False)
        return COMPLETED

    def begin_loads(self, loads: Sequence[tuple[IndexLike, IndexLike]]) -> CpuLayerwiseLoad:
        """Plan every load now (:meth:`prepare_load`); the copies happen in the threads that
        run and wait on the returned :class:`CpuLayerwiseLoad`."""
        copies: list[Callable[[int], None] | BaseException] = []
        for page_indices, block_ids in loads:
            try:
                copies.append(self.prepare_load(page_indices, block_ids))
            except Exception as exc:
                copies.append(exc)
        return CpuLayerwiseLoad(copies, self.layout.num_layers)

    def prepare_load(self, page_indices: IndexLike, block_ids: IndexLike) -> Callable[[int], None]:
        """Validate a load and plan its copy, so that its layers can be copied one by one.

        Lets callers hand each layer to the model as soon as it is in place, and split the
        layers of one load between threads (which copy at the same time).

        Args:
            page_indices: arena page indices to read.
            block_ids: vLLM block ids to write, as many as ``page_indices``, distinct.

        Returns:
            A function copying layer ``i`` (in layout order) of the load; each layer must be
            copied once.

        Raises:
            ValueError, IndexError: as :meth:`load`, from this call (nothing is copied).
        """
        src, dst = self._indices(page_indices, self.num_pages, block_ids, self.num_blocks)
        return self._layer_copy(False, src, dst)

    def close(self) -> None:
        with self._state:
            self._closed = True
            self._state.wait_for(lambda: self._copies_running == 0)
            self._block_views = []
            self._page_views = []
            self._thread_scratch = threading.local()

    def _indices(
        self, src: IndexLike, src_rows: int, dst: IndexLike, dst_rows: int
    ) -> tuple[list[int], list[int]]:
        """Validate a batch and return it sorted by destination, as lists of ints
        (:func:`~kvshelf.transfer.views.sorted_batch`)."""
        if self._closed:
            raise NotReady("transfer engine is closed")
        return sorted_batch(src, src_rows, dst, dst_rows)

    def _copy_every_layer(
        self,
        copy_layer: Callable[[torch.Tensor, torch.Tensor, LayerLayout], None],
        *,
        to_pages: bool,
    ) -> None:
        """Copy a whole batch, every layer, taking the engine's lock once rather than twice a
        layer as :meth:`_copy_layer` does (layers copied apart need that)."""
        with self._state:
            if self._closed:
                raise NotReady("transfer engine is closed")
            self._copies_running += 1
        try:
            finished = self._copy_layers(copy_layer, to_pages)
        finally:
            with self._state:
                self._copies_running -= 1
                if self._copies_running == 0:
                    self._state.notify_all()
        if not finished:
            # Raised here, where no view of the arena is alive: a traceback keeps its frames.
            raise NotReady("transfer engine is closed")

    def _copy_layers(
        self, copy_layer: Callable[[torch.Tensor, torch.Tensor, LayerLayout], None], to_pages: bool
    ) -> bool:
        """Copy every layer; False when :meth:`close` began first (a store it interrupts must
        fail, so that its pages are never committed). The caller counts this as a running
        copy."""
        for blocks, pages, layer in zip(
            self._block_views, self._page_views, self.layout.layers, strict=True
        ):
            if self._closed:
                return False
            if to_pages:
                copy_layer(blocks, pages, layer)
            else:
                copy_layer(pages, blocks, layer)
        return True

    def _layer_copy(
        self, to_pages: bool, src_idx: list[int], dst_idx: list[int]
    ) -> Callable[[int], None]:
        """Return a function copying rows ``src_idx[i]`` to rows ``dst_idx[i]`` in one layer.

        ``dst_idx`` is sorted and distinct (see :meth:`_indices`).
        """
        if not dst_idx:
            return _copy_nothing
        # No view of the arena may live in the returned function (it would keep the arena
        # from being unmapped after close): views are looked up per call.
        return functools.partial(
            self._copy_layer, self._layer_copier(src_idx, dst_idx), to_pages=to_pages
        )

    def _copy_layer(
        self,
        copy_layer: Callable[[torch.Tensor, torch.Tensor, LayerLayout], None],
        index: int,
        *,
        to_pages: bool,
    ) -> None:
        with self._state:
            if self._closed:
                raise NotReady("transfer engine is closed")
            blocks, pages = self._block_views[index], self._page_views[index]
            self._copies_running += 1
        try:
            layer = self.layout.layers[index]
            if to_pages:
                copy_layer(blocks, pages, layer)
            else:
                copy_layer(pages, blocks, layer)
        finally:
            with self._state:
                self._copies_running -= 1
                if self._copies_running == 0:
                    self._state.notify_all()

    def _layer_copier(
        self, src_idx: list[int], dst_idx: list[int]
    ) -> Callable[[torch.Tensor, torch.Tensor, LayerLayout], None]:
        """Choose how the batch is copied (the same way in every layer); see the class doc.

        ``dst_idx`` is sorted and distinct, ``src_idx`` in the same order (:meth:`_indices`).

        Returns:
            A function copying the batch in one layer: ``(source view, destination view,
            layer)``.
        """
        n = len(dst_idx)
        dst_runs = runs(dst_idx)
        if self._runs_pay(len(dst_runs), n):
            gathers = [
                (index_tensor(src_idx[start : start + length]), dst_idx[start], length)
                for start, length in dst_runs
            ]

            def gather_runs(src: torch.Tensor, dst: torch.Tensor, layer: LayerLayout) -> None:
                for rows, first, length in gathers:
                    torch.index_select(src, 0, rows, out=dst.narrow(0, first, length))

            return gather_runs
        src_sorted, dst_by_src = sorted_by(src_idx, dst_idx)
        src_runs = runs(src_sorted)
        if self._runs_pay(len(src_runs), n):
            scatters = [
                (index_tensor(dst_by_src[start : start + length]), src_sorted[start], length)
                for start, length in src_runs
            ]

            def scatter_runs(src: torch.Tensor, dst: torch.Tensor, layer: LayerLayout) -> None:
                for rows, first, length in scatters:
                    dst.index_copy_(0, rows, src.narrow(0, first, length))

            return scatter_runs

        # Sorted by destination: the scatter of each chunk then writes in address order.
        src_t, dst_t = index_tensor(src_idx), index_tensor(dst_idx)

        def via_scratch(src: torch.Tensor, dst: torch.Tensor, layer: LayerLayout) -> None:
            self._copy_via_scratch(src, dst, layer, src_t, dst_t)

        return via_scratch

    def _copy_via_scratch(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        layer: LayerLayout,
        src_idx: torch.Tensor,
        dst_idx: torch.Tensor,
    ) -> None:
        """Gather one layer's rows into a scratch buffer, then scatter them, chunk by chunk."""
        n = dst_idx.numel()
        chunk = min(n, max(self.SCRATCH_MIN_ROWS, self._scratch_bytes // layer.block_bytes))
        scratch = self._scratch_buffer(chunk * layer.block_bytes)
        rows_shape = src.shape[1:]
        for start in range(0, n, chunk):
            length = min(chunk, n - start)
            tmp = scratch[: length * layer.block_bytes].view(src.dtype).view(length, *rows_shape)
            torch.index_select(src, 0, src_idx[start : start + length], out=tmp)
            dst.index_copy_(0, dst_idx[start : start + length], tmp)

    def _scratch_buffer(self, nbytes: int) -> torch.Tensor:
        """Return this thread's scratch buffer, grown to at least ``nbytes``."""
        scratch: torch.Tensor | None = getattr(self._thread_scratch, "buffer", None)
        if scratch is None or scratch.numel() < nbytes:
            scratch = torch.empty(nbytes, dtype=torch.uint8)
            self._thread_scratch.buffer = scratch
        return scratch

    def _runs_pay(self, num_runs: int, num_rows: int) -> bool:
        """Whether copying run by run beats the two-copy scratch path."""
        if num_runs <= 2:
            return True
        return num_runs * self.MIN_MEAN_RUN <= num_rows and (
            (num_runs - 2) * self.RUN_CALL_BYTES <= num_rows * self._mean_layer_bytes
        )


class CpuLayerwiseLoad(LayerwiseLoad):
    """One step's loads, copied one layer at a time (layer 0 of every load, then layer 1, ...)
    so that the forward pass can run layer ``i`` while later layers copy.

    Two threads copy: the load thread (:meth:`run`) runs ahead from layer 0, and the step loop,
    when the forward pass needs a layer that is not in place, copies it itself if nobody has
    started it (the load thread is behind, e.g. waiting for its core), or else copies the next
    layer nobody has started while the load thread finishes it. A load is thus mostly hidden
    behind the forward pass, and when it is not, both threads copy (each with its own scratch
    buffer, see :class:`CpuTransferEngine`).

    Invariant: each layer is claimed by exactly one thread, which marks it done after copying
    it; the failures (indices into ``copies``) no longer change once every layer is done.

    Args:
        copies: per load, the function copying one of its layers
            (:meth:`CpuTransferEngine.prepare_load`), or why the load could not be planned.
        num_layers: the number of layers.
    """

    _PENDING, _CLAIMED, _DONE = range(3)

    def __init__(
        self, copies: Sequence[Callable[[int], None] | BaseException], num_layers: int
    ) -> None:
        self._copies = list(copies)
        self.num_layers = num_layers
        self._failures: dict[int, BaseException] = {
            i: copy for i, copy in enumerate(self._copies) if isinstance(copy, BaseException)
        }
        self._layers = [self._PENDING] * num_layers
        # Layers [0, _ready) are done, as far as the step loop has seen.
        self._ready = 0
        self._progress = threading.Condition()

    def run(self) -> None:
        """Copy every layer nobody has claimed yet, in order."""
        for layer in range(self.num_layers):
            if self._claim(layer):
                self._copy(layer)

    def wait_layer(self, layer: int) -> None:
        """Return once layers ``0..layer`` of every load are in place (or failed); copy any of
        them that nobody has started, and later layers while waiting for the load thread."""
        for earlier in range(self._ready, layer + 1):
            if self._claim(earlier):
                self._copy(earlier)
            while not self._done(earlier):
                ahead = self._claim_first_pending(earlier + 1)
                if ahead is not None:
                    self._copy(ahead)
                    continue
                with self._progress:
                    while not self._done(earlier):
                        self._progress.wait()
        self._ready = max(self._ready, layer + 1)

    def wait_all(self) -> None:
        self.wait_layer(self.num_layers - 1)

    def failures(self) -> dict[int, BaseException]:
        with self._progress:
            return dict(self._failures)

    def _done(self, layer: int) -> bool:
        return self._layers[layer] == self._DONE

    def _claim(self, layer: int) -> bool:
        with self._progress:
            if self._layers[layer] != self._PENDING:
                return False
            self._layers[layer] = self._CLAIMED
            return True

    def _claim_first_pending(self, start: int) -> int | None:
        """Claim the first layer from ``start`` on that nobody has claimed; None if none."""
        return next((layer for layer in range(start, self.num_layers) if self._claim(layer)), None)

    def _copy(self, layer: int) -> None:
        try:
            for index, copy in enumerate(self._copies):
                if index in self._failures:
                    continue
                assert not isinstance(copy, BaseException)
                try:
                    copy(layer)
                except Exception as exc:
                    with self._progress:
                        self._failures[index] = exc
        finally:
            with self._progress:
                self._layers[layer] = self._DONE
                self._progress.notify_all()


def _copy_nothing(index: int) -> None:
    """The per-layer copy of an empty batch."""


register_engine("cpu", CpuTransferEngine)
