"""Stores of KV caches whose block is not one contiguous run (vLLM's default ``LBNHC``):
gathered into pages in a device staging buffer, then sent to the pinned arena with one DMA per
run of consecutive pages, so that the copy engine, not SM kernels writing host memory over
PCIe, moves the bytes across the bus.

Per staging chunk (at most :data:`STAGING_BYTES` of pages): one gather and one device-to-device
copy per layer into the chunk's pages (device memory only), then one ``copy_(non_blocking)``
per run. Used by :class:`~kvshelf.transfer.cuda.CudaTransferEngine` inside its store stream's
work; the staging buffer is allocated there, on that stream, so torch's caching allocator
reuses it only after the stream's DMA. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

STAGING_BYTES = 64 << 20
"""The most device memory one staging chunk takes (at least one page): vLLM leaves little."""


class StoreStaging:
    """The layers' geometry a staged store needs, and the arena pages it sends to.

    Args:
        layers: per layer, the ``[num_blocks, ...]`` KV cache view and the ``[num_pages, ...]``
            page view over ``pages_dev`` (:func:`~kvshelf.transfer.views.layer_views`).
        pages_dev: the arena as ``[num_pages, page_bytes]`` the page views were made over.
        pages_host: the same arena pages as a CPU tensor (the DMAs' destination).
        device: the KV caches' device (the staging buffer's).
    """

    def __init__(
        self,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        pages_dev: torch.Tensor,
        pages_host: torch.Tensor,
        device: torch.device,
    ) -> None:
        self._pages_host = pages_host
        self._page_bytes = pages_host.shape[1]
        self._device = device
        # Per layer: its cache view, and where its slice sits in a page (as a strided view of
        # the page buffer: the same strides and offset in a staging buffer of whole pages).
        self._layers = [
            (
                blocks,
                pages.dtype,
                tuple(pages.shape[1:]),
                tuple(pages.stride()),
                (pages.data_ptr() - pages_dev.data_ptr()) // pages.element_size(),
            )
            for blocks, pages in layers
        ]

    def store(
        self,
        src: torch.Tensor,
        dst: list[int],
        runs: list[tuple[int, int]],
        note_copy: Callable[[str], None],
    ) -> None:
        """Copy blocks ``src`` (device indices, one per row) to pages ``dst`` (sorted), whose
        consecutive runs are ``runs`` (``(start, end)`` rows), on the current stream."""
        max_rows = max(1, STAGING_BYTES // self._page_bytes)
        for chunk in _chunks(runs, max_rows):
            first, last = chunk[0][0], chunk[-1][1]
            # Zeroed: the bytes between layers' slices (alignment) go to the arena too.
            staging = torch.zeros(
                (last - first, self._page_bytes), dtype=torch.uint8, device=self._device
            )
            for layer, (blocks, dtype, shape, stride, offset) in enumerate(self._layers):
                note_copy(f"stage layer {layer} x{last - first}")
                staged = staging.view(dtype).as_strided((last - first, *shape), stride, offset)
                staged.copy_(torch.index_select(blocks, 0, src[first:last]))
            for start, end in chunk:
                note_copy(f"pages x{end - start}")
                self._pages_host.narrow(0, dst[start], end - start).copy_(
                    staging.narrow(0, start - first, end - start), non_blocking=True
                )


def _chunks(runs: list[tuple[int, int]], max_rows: int) -> list[list[tuple[int, int]]]:
    """Runs (contiguous, in order) split and grouped so that each group spans at most
    ``max_rows`` rows."""
    pieces = [
        (piece, min(end, piece + max_rows))
        for start, end in runs
        for piece in range(start, end, max_rows)
    ]
    chunks: list[list[tuple[int, int]]] = []
    for piece in pieces:
        if chunks and piece[1] - chunks[-1][0][0] <= max_rows:
            chunks[-1].append(piece)
        else:
            chunks.append([piece])
    return chunks
