"""Copy views shared by the copy engines: per layer, the KV cache and the arena's pages as
tensors of the same row shape, and the planning of a batch of (source, destination) rows in
plain Python (validation, order, runs of consecutive rows).

No engine, no vLLM.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch

from kvshelf.transfer.base import IndexLike
from kvshelf.transfer.layout import KVCacheLayout, LayerLayout, checked_block_view

# Element types used to move bytes, widest first. Copy kernels move one element per step, so
# the widest type the alignment allows moves the same bytes in the fewest steps; only bits are
# copied (no arithmetic), so any type is bit-exact.
_WIDE_DTYPES: tuple[tuple[int, torch.dtype], ...] = (
    (16, torch.complex128),
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


def layer_views(
    tensor: torch.Tensor, layer: LayerLayout, layout: KVCacheLayout, pages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build one layer's ``[num_blocks, ...]`` cache view and ``[num_pages, ...]`` page view.

    Both views have the same shape after the first dimension and the same element type: the
    widest type the alignment allows (copy kernels move one element per step).

    Args:
        tensor: the layer's KV cache, on any device.
        layer, layout: the layout computed from the KV caches.
        pages: the arena as ``[num_pages, page_bytes]`` uint8 (on any device, or an alias).

    Raises:
        ValueError: a tensor that does not match the layout.
    """
    blocks = checked_block_view(tensor, layer, layout)
    page_slice = pages[:, layer.offset : layer.offset + layer.block_bytes]
    for width, dtype in _WIDE_DTYPES:
        block_view = _reinterpret(blocks, dtype, width)
        page_view = _reinterpret(page_slice, dtype, width)
        if block_view is None or page_view is None:
            continue
        page_view = page_view.view(pages.shape[0], *block_view.shape[1:])
        assert page_view.shape[1:] == block_view.shape[1:] and page_view.dtype == block_view.dtype
        return block_view, page_view
    # A last dimension that is not contiguous: copy in the tensor's own element type.
    return blocks, layer.page_view(pages)


def _reinterpret(tensor: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor | None:
    """View ``tensor``'s bytes as ``dtype`` (``width`` bytes), or None when misaligned."""
    if tensor.dim() == 0 or tensor.stride(-1) != 1:
        return None
    itemsize = tensor.element_size()
    strides_bytes = [s * itemsize for s in tensor.stride()[:-1]]
    if (
        tensor.shape[-1] * itemsize % width
        or tensor.data_ptr() % width
        or any(s % width for s in strides_bytes)
    ):
        return None
    try:
        return tensor.view(torch.uint8).view(dtype)
    except RuntimeError:
        return None


def runs(sorted_index: list[int]) -> list[tuple[int, int]]:
    """Split a sorted index into runs of consecutive values: ``(start, length)`` pairs."""
    found = []
    start = 0
    for i in range(1, len(sorted_index)):
        if sorted_index[i] != sorted_index[i - 1] + 1:
            found.append((start, i - start))
            start = i
    found.append((start, len(sorted_index) - start))
    return found


def sorted_by(keys: list[int], values: list[int]) -> tuple[list[int], list[int]]:
    """``keys`` sorted, and ``values`` in the same order."""
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return [keys[i] for i in order], [values[i] for i in order]


def index_tensor(values: list[int]) -> torch.Tensor:
    """A batch's rows as an int64 CPU tensor, for the copy kernels."""
    return torch.tensor(values, dtype=torch.int64)


def arena_pages(
    arena: torch.Tensor, layout: KVCacheLayout, kv_caches: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """The arena as ``[num_pages, page_bytes]`` uint8, after checking the engine's arguments.

    Raises:
        ValueError: an arena that is not a contiguous 1-D uint8 CPU tensor of at least one
            page, or KV caches that name other layers than ``layout``.
    """
    if arena.dtype != torch.uint8 or arena.dim() != 1 or arena.device.type != "cpu":
        raise ValueError(
            f"arena must be a 1-D uint8 CPU tensor, got {arena.dtype} "
            f"{list(arena.shape)} on {arena.device}"
        )
    if not arena.is_contiguous():
        raise ValueError("arena must be contiguous")
    num_pages = arena.numel() // layout.page_bytes
    if num_pages < 1:
        raise ValueError(
            f"arena of {arena.numel()} bytes holds no page of {layout.page_bytes} bytes"
        )
    if set(kv_caches) != {layer.name for layer in layout.layers}:
        raise ValueError("kv_caches and layout name different layers")
    return arena[: num_pages * layout.page_bytes].view(num_pages, -1)


def sorted_batch(
    src: IndexLike, src_rows: int, dst: IndexLike, dst_rows: int
) -> tuple[list[int], list[int]]:
    """Validate a batch and return it sorted by destination, as lists of ints.

    In plain Python: a batch is at most a few thousand blocks, for which list work costs less
    than the dozens of small tensor operations it replaces (each a few microseconds, on every
    batch). An engine that needs device indices makes them from these lists.

    Raises:
        ValueError: mismatched lengths, non-integer or non-1-D indices, duplicate destinations.
        IndexError: an index out of range.
    """
    src_l = _as_index(src, "source")
    dst_l = _as_index(dst, "destination")
    if len(src_l) != len(dst_l):
        raise ValueError(f"{len(src_l)} sources but {len(dst_l)} destinations in one batch")
    if not dst_l:
        return src_l, dst_l
    _check_range(src_l, src_rows, "source")
    _check_range(dst_l, dst_rows, "destination")
    if len(set(dst_l)) != len(dst_l):
        raise ValueError("duplicate destination in one batch")
    dst_sorted, src_by_dst = sorted_by(dst_l, src_l)
    return src_by_dst, dst_sorted


def _as_index(values: IndexLike, what: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{what} indices must be 1-D, got shape {list(values.shape)}")
        if values.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise ValueError(f"{what} indices must be integers, got {values.dtype}")
        return values.tolist()
    try:
        return [operator.index(value) for value in values]
    except TypeError:
        # Not a flat sequence of ints (nested lists, floats): judged as a tensor of it.
        return _as_index(torch.as_tensor(values), what)


def _check_range(index: list[int], rows: int, what: str) -> None:
    low, high = min(index), max(index)
    if low < 0 or high >= rows:
        raise IndexError(f"{what} index out of range [0, {rows}): min {low}, max {high}")
