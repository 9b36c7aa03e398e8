"""The yardsticks of ``kvshelf bench transfer``: the copies a store and a load make, alone.

vLLM's blocks are scattered over its KV cache, so a store is a gather of block rows into arena
pages and a load is the scatter back; a contiguous memcpy of the same bytes is faster than
either can be. `gather` and `scatter` make exactly those copies with plain torch calls on the
calling thread (no server, no copy engine, no kvshelf code but the layout's views), so that a
store's or load's time can be read against the copy it cannot avoid.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvshelf.transfer import KVCacheLayout


def _rows(view: torch.Tensor) -> torch.Tensor:
    """A ``[rows, *block_shape]`` view as ``[rows, elements]`` of the widest element type the
    row's bytes allow (no copy): copy kernels move one element per step, so a copy moves 16
    bytes at a time where it can, as kvshelf's engine does."""
    rows = view.flatten(1).view(torch.uint8)
    for width, dtype in ((16, torch.complex128), (8, torch.int64), (4, torch.int32)):
        if rows.shape[1] % width == 0 and rows.data_ptr() % width == 0:
            return rows.view(dtype)
    return rows


def gather(
    kv_caches: dict[str, torch.Tensor],
    layout: KVCacheLayout,
    pages_2d: torch.Tensor,
    blocks: Sequence[int],
    pages: Sequence[int],
) -> float:
    """Copy block ``blocks[i]`` of every layer into page ``pages[i]`` with plain torch calls
    (per layer, one ``index_select`` per run of consecutive pages); return the seconds taken.

    The yardstick of a store: the copy it makes, with nothing else (no server, no engine).
    """
    page_runs, views = _plan(kv_caches, layout, pages_2d, pages, blocks)
    t0 = time.perf_counter()
    for block_rows, page_rows in views:
        for first, rows in page_runs:
            torch.index_select(block_rows, 0, rows, out=page_rows.narrow(0, first, rows.numel()))
    return time.perf_counter() - t0


def scatter(
    kv_caches: dict[str, torch.Tensor],
    layout: KVCacheLayout,
    pages_2d: torch.Tensor,
    pages: Sequence[int],
    blocks: Sequence[int],
) -> float:
    """Copy page ``pages[i]`` into block ``blocks[i]`` of every layer with plain torch calls
    (per layer, one ``index_copy_`` per run of consecutive pages); return the seconds taken.

    The yardstick of a load: the mirror of `gather`.
    """
    page_runs, views = _plan(kv_caches, layout, pages_2d, pages, blocks)
    t0 = time.perf_counter()
    for block_rows, page_rows in views:
        for first, rows in page_runs:
            block_rows.index_copy_(0, rows, page_rows.narrow(0, first, rows.numel()))
    return time.perf_counter() - t0


def _plan(
    kv_caches: dict[str, torch.Tensor],
    layout: KVCacheLayout,
    pages_2d: torch.Tensor,
    pages: Sequence[int],
    blocks: Sequence[int],
) -> tuple[list[tuple[int, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """What `gather` and `scatter` copy, made before their clock starts: the page-sorted
    pairs' runs of consecutive pages, and per layer its block rows and page rows."""
    order = sorted(range(len(pages)), key=pages.__getitem__)
    page_runs = _page_runs([pages[i] for i in order], [blocks[i] for i in order])
    views = [
        (_rows(layer.block_view(kv_caches[layer.name])), _rows(layer.page_view(pages_2d)))
        for layer in layout.layers
    ]
    return page_runs, views


def _page_runs(pages: list[int], blocks: list[int]) -> list[tuple[int, torch.Tensor]]:
    """Split page-sorted ``(page, block)`` pairs into runs of consecutive pages: per run, its
    first page and its blocks as an index tensor."""
    found: list[tuple[int, torch.Tensor]] = []
    start = 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[i - 1] + 1:
            found.append((pages[start], torch.tensor(blocks[start:i], dtype=torch.int64)))
            start = i
    return found
