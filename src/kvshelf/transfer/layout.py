"""Where one KV block lives in each layer's KV cache tensor, and how it is packed into a page.

A page holds one block of one KV-cache rank: for every layer, in the order of the ``kv_caches``
mapping, the layer's slice of that block at a fixed, aligned byte offset. Inside its slice a
layer's block is stored in the *physical* order of the tensor's dimensions (their strides,
largest first), so that a block that is one contiguous run in the KV cache is one contiguous
run in the page too, and a copy never transposes.

What vLLM 0.32 hands a connector (``vllm/v1/kv_cache_interface.py``): per layer a logical
``[B, H, N, C]`` view (blocks, heads, tokens, K||V content) of one backing buffer, whose strides
follow the resolved ``KVCacheLayout`` (a stride order of ``[L, B, H, N, C]``):

- layer-compact ``LBNHC`` (the GPU default), ``LBHNC`` (the CPU backend), ``LHBNC``;
- block-outermost ``BLNHC``, ``BLHNC`` (block-compact: one block of every layer is one
  contiguous run, exactly one page, see :meth:`KVCacheLayout.whole_page_view`), ``BHLNC``;
- MLA caches are the same view with ``H = 1`` and ``C`` the latent vector.

When an attention backend splits a block into ``r`` kernel blocks, the view has ``B = r *
num_blocks`` rows (kernel block ``j`` of block ``b`` is row ``b * r + j``); the page still holds
the whole block, ``r`` folded into the token dimension, so pages do not depend on the kernel
block size. Older shapes stay recognised: ``[2, N, block_size, kv_heads, head_size]`` (K and V
first, block dim 1), ``[N, block_size, latent]`` (MLA), and any tensor whose leading dimension
is the block count (FlashInfer's ``[N, 2, block_size, kv_heads, head_size]``).

The packing depends only on the layers' names, logical shapes, dtypes and stride order, never
on the device or the number of blocks, so every process that runs the same model with the same
KV cache configuration computes the same pages and the same fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

PAGE_ALIGN_BYTES = 64
"""Every layer's slice starts at a multiple of this inside a page, and ``page_bytes`` is a
multiple of it, so that wide element views of the arena stay aligned."""

_FINGERPRINT_VERSION = "kvshelf-kv-layout-v2"

_TOKEN_DIM = 3
"""The token dimension ``N`` of vLLM's logical ``[B, H, N, C]`` view (counting ``r`` at 1)."""


@dataclass(frozen=True)
class LayerLayout:
    """One layer's KV cache tensor and its slice of a page.

    Attributes:
        name: the layer's name (the key in the ``kv_caches`` mapping).
        block_dim: the dimension of the layer's tensor that indexes blocks (or kernel blocks).
        kernel_blocks: kernel blocks per block along ``block_dim`` (1: no split).
        dim_order: the order, outermost first, in which the block's dimensions are stored in
            the page, as indices into the block view before ordering (:meth:`block_view`).
        block_shape: the shape of one block in page order.
        dtype: the tensor's dtype.
        block_bytes: bytes of one block of this layer.
        offset: byte offset of this layer's slice inside a page.
    """

    name: str
    block_dim: int
    kernel_blocks: int
    dim_order: tuple[int, ...]
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    block_bytes: int
    offset: int

    def __post_init__(self) -> None:
        assert self.offset % PAGE_ALIGN_BYTES == 0
        assert self.block_bytes == math.prod(self.block_shape) * self.dtype.itemsize

    def block_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """View the layer's KV cache as ``[num_blocks, *block_shape]`` (no copy).

        Row ``b`` is block ``b`` with its dimensions in page order: copying it, in C order,
        into the layer's page slice is the page's content.
        """
        rows = tensor.movedim(self.block_dim, 0)
        if self.kernel_blocks > 1:
            rows = rows.unflatten(0, (rows.shape[0] // self.kernel_blocks, self.kernel_blocks))
        return rows.permute(0, *(d + 1 for d in self.dim_order))

    def page_view(self, pages: torch.Tensor) -> torch.Tensor:
        """View this layer's slice of every page as ``[num_pages, *block_shape]``.

        Args:
            pages: the arena as ``[num_pages, page_bytes]`` uint8.
        """
        raw = pages[:, self.offset : self.offset + self.block_bytes]
        return raw.view(self.dtype).view(pages.shape[0], *self.block_shape)


@dataclass(frozen=True)
class KVCacheLayout:
    """The page layout of a model's KV cache (one rank), computed from its per-layer tensors.

    Attributes:
        layers: one entry per layer, in page order (the order of the ``kv_caches`` mapping).
        num_blocks: number of blocks of every layer's tensor (not part of the fingerprint).
        page_bytes: bytes of one page: every layer's block, each at its aligned offset.
        fingerprint: a stable hex digest of the layer names, block shapes in page order and
            dtypes; equal layouts give equal fingerprints in every process.
    """

    layers: tuple[LayerLayout, ...]
    num_blocks: int
    page_bytes: int
    fingerprint: str

    @classmethod
    def from_kv_caches(
        cls, kv_caches: Mapping[str, torch.Tensor], num_blocks: int
    ) -> KVCacheLayout:
        """Detect each layer's block dimension and storage order, and pack all layers.

        Args:
            kv_caches: layer name -> that layer's KV cache tensor, in the order vLLM registers
                them (the page order follows the mapping's iteration order).
            num_blocks: the number of KV blocks in every tensor.

        Returns:
            The layout.

        Raises:
            ValueError: no layers, ``num_blocks < 1``, a tensor with no dimension of
                ``num_blocks`` blocks (or kernel blocks) in a recognised position, or one whose
                blocks overlap in memory.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if not kv_caches:
            raise ValueError("kv_caches is empty: no layer to lay out")
        layers: list[LayerLayout] = []
        # Per layer: (shape, order) with kernel blocks merged into tokens, for the fingerprint.
        folded: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        offset = 0
        for name, tensor in kv_caches.items():
            block_dim, kernel_blocks = detect_block_dim(tensor.shape, num_blocks, name=name)
            rows = tensor.movedim(block_dim, 0)
            if kernel_blocks > 1:
                rows = rows.unflatten(0, (num_blocks, kernel_blocks))
            dim_order = _storage_order(rows, kernel_blocks)
            block_shape = tuple(rows.shape[d + 1] for d in dim_order)
            block_bytes = math.prod(block_shape) * tensor.dtype.itemsize
            layers.append(
                LayerLayout(
                    name=name,
                    block_dim=block_dim,
                    kernel_blocks=kernel_blocks,
                    dim_order=dim_order,
                    block_shape=block_shape,
                    dtype=tensor.dtype,
                    block_bytes=block_bytes,
                    offset=offset,
                )
            )
            folded.append(_fold_kernel_blocks(block_shape, dim_order, kernel_blocks))
            offset = _align_up(offset + block_bytes, PAGE_ALIGN_BYTES)
        page_bytes = offset
        assert page_bytes > 0
        return cls(
            layers=tuple(layers),
            num_blocks=num_blocks,
            page_bytes=page_bytes,
            fingerprint=_fingerprint(layers, folded),
        )

    @property
    def num_layers(self) -> int:
        """Number of layers in a page."""
        return len(self.layers)

    @property
    def layer_offsets(self) -> dict[str, int]:
        """Layer name -> byte offset of that layer's slice inside a page."""
        return {layer.name: layer.offset for layer in self.layers}

    def whole_page_view(self, kv_caches: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """The KV cache as ``[num_blocks, page_bytes]`` uint8, when each block is one page.

        That holds for a block-compact layout (``BLNHC``, ``BLHNC``) whose layers' blocks
        follow each other without gaps, exactly at their page offsets: one block of all layers
        is then a single run of ``page_bytes`` bytes, copied to or from a page in one go.

        Returns:
            The view (sharing the KV cache's memory), or None when some block is not one
            gap-free run laid out as a page.
        """
        views = [layer.block_view(kv_caches[layer.name]) for layer in self.layers]
        first = views[0]
        block_stride = first.stride(0) * first.element_size()
        expected = 0
        for layer, view in zip(self.layers, views, strict=True):
            contiguous_block = view.dim() == 1 or view[0].is_contiguous()
            if (
                not contiguous_block
                or layer.offset != expected
                or view.device != first.device
                or view.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or view.stride(0) * view.element_size() != block_stride
                or view.data_ptr() - first.data_ptr() != layer.offset
            ):
                return None
            expected = layer.offset + layer.block_bytes
        if expected != self.page_bytes or block_stride < self.page_bytes:
            return None
        raw = first.view(torch.uint8) if first.dim() > 1 else first.unsqueeze(1).view(torch.uint8)
        return torch.as_strided(
            raw,
            (self.num_blocks, self.page_bytes),
            (block_stride, 1),
            storage_offset=raw.storage_offset(),
        )


def distinct_layers(
    kv_caches: Mapping[str, torch.Tensor], num_blocks: int
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Keep one layer of each set whose KV cache tensors view the same memory.

    vLLM's hybrid KV cache manager overlays its KV cache groups: layer ``i`` of every group
    views the same memory, and a block id belongs to one group at a time, so block ``b`` there
    holds the KV (or the state) of whichever group owns ``b``. Such memory is one layer of a
    page (copying it once per aliasing layer would copy the same bytes again).

    Two layers alias when their tensors are the same view, or when both hold each of the
    ``num_blocks`` blocks as one dense run of bytes, from the same address with the same block
    stride: the longer run covers the shorter (a state-space layer's state and an attention
    layer's KV share a page this way, vLLM sizing the attention block to the state's page).

    Args:
        kv_caches: layer name -> that layer's KV cache tensor, in vLLM's order.
        num_blocks: the number of KV blocks.

    Returns:
        ``(distinct, aliases)``: one layer of each set (the one with the longest run; else the
        first), in ``kv_caches``' order, and the others' names -> the name of the layer they
        alias.
    """
    # The layers of each set of aliases, in order.
    sets: dict[tuple[object, ...], list[str]] = {}
    runs: dict[str, int] = {}
    for name, tensor in kv_caches.items():
        if not isinstance(tensor, torch.Tensor):
            # Not a KV cache tensor (a state-space layer's tuple): KVCacheLayout says why.
            continue
        run = _block_run_bytes(tensor, num_blocks)
        if run is None:
            key: tuple[object, ...] = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
            key += (tensor.dtype,)
        else:
            key = (tensor.data_ptr(), tensor.stride(0) * tensor.element_size())
            runs[name] = run
        sets.setdefault(key, []).append(name)
    aliases: dict[str, str] = {}
    for members in sets.values():
        first = max(members, key=lambda name: runs.get(name, 0))  # the first of the longest
        aliases.update({name: first for name in members if name != first})
    distinct = {name: kv_caches[name] for name in kv_caches if name not in aliases}
    return distinct, aliases


def _block_run_bytes(tensor: torch.Tensor, num_blocks: int) -> int | None:
    """The bytes of one block when ``tensor``'s leading dimension is its ``num_blocks`` blocks
    and each block is one dense run of memory (in any order of its other dimensions), at most
    one block stride long; else None."""
    if tensor.dim() < 2 or tensor.shape[0] != num_blocks:
        return None
    dims = sorted(
        (
            (size, stride)
            for size, stride in zip(tensor.shape[1:], tensor.stride()[1:], strict=True)
            if size > 1
        ),
        key=lambda dim: dim[1],
    )
    expected = 1
    for size, stride in dims:
        if stride != expected:
            return None
        expected *= size
    run = expected * tensor.element_size()
    return run if run <= tensor.stride(0) * tensor.element_size() else None


def checked_block_view(
    tensor: torch.Tensor, layer: LayerLayout, layout: KVCacheLayout
) -> torch.Tensor:
    """``layer.block_view(tensor)`` after checking that ``tensor`` is the one ``layout`` was
    computed from (dtype, block count, block shape in page order).

    Raises:
        ValueError: a tensor that does not match the layer's layout.
    """
    if tensor.dtype != layer.dtype:
        raise ValueError(
            f"layer {layer.name!r} does not match the layout: {tensor.dtype}, not {layer.dtype}"
        )
    try:
        blocks = layer.block_view(tensor)
    except RuntimeError as exc:
        raise ValueError(f"layer {layer.name!r} does not match the layout: {exc}") from None
    if blocks.shape[0] != layout.num_blocks or tuple(blocks.shape[1:]) != layer.block_shape:
        raise ValueError(
            f"layer {layer.name!r} has shape {list(tensor.shape)}, the layout expects "
            f"{layout.num_blocks} blocks of {list(layer.block_shape)}"
        )
    return blocks


def detect_block_dim(
    shape: torch.Size | tuple[int, ...], num_blocks: int, *, name: str = ""
) -> tuple[int, int]:
    """Find the dimension that indexes blocks in one layer's KV cache tensor.

    The K-and-V-first layout ``[2, N, ...]`` (5 dims) is checked first, so that it is
    recognised even when ``N == 2``; otherwise the leading dimension must be ``N``, or, for
    vLLM's 4-D ``[B, H, N, C]`` view, a multiple ``r * N`` (``r`` kernel blocks per block).

    Args:
        shape: the tensor's shape.
        num_blocks: the number of blocks ``N``.
        name: the layer's name, for the error message.

    Returns:
        ``(block dimension, kernel blocks per block)``.

    Raises:
        ValueError: when neither position holds ``num_blocks``.
    """
    shape = tuple(shape)
    if len(shape) == 5 and shape[0] == 2 and shape[1] == num_blocks:
        return 1, 1
    if len(shape) >= 2 and shape[0] == num_blocks:
        return 0, 1
    if len(shape) == 4 and shape[0] > num_blocks and shape[0] % num_blocks == 0:
        return 0, shape[0] // num_blocks
    raise ValueError(
        f"KV cache tensor {name!r} of shape {list(shape)} has no block dimension of size "
        f"{num_blocks}: expected [num_blocks (or a multiple: kernel blocks), kv_heads, "
        f"block_size, content] (vLLM's view, every KVCacheLayout, MLA with kv_heads 1), "
        f"[2, num_blocks, block_size, kv_heads, head_size] or [num_blocks, block_size, dim]"
    )


def _storage_order(rows: torch.Tensor, kernel_blocks: int) -> tuple[int, ...]:
    """The order, outermost first, in which one block's dimensions are stored.

    ``rows`` is the tensor with blocks first (and kernel blocks second when ``kernel_blocks >
    1``). Dimensions of size 1 hold no bytes apart: they go first, in logical order, whatever
    their strides, so that equal layouts give equal orders, and the innermost dimension of
    the view stays the one stored contiguously (copies then move wide elements, see
    :mod:`kvshelf.transfer.views`; last, a size-1 dimension of any stride would make every
    copy move one element at a time). The kernel-block dimension goes right before the token
    dimension, which it extends.
    """
    inner = list(range(rows.dim() - 1))
    split = kernel_blocks > 1
    base = inner[1:] if split else inner
    strides, sizes = rows.stride()[1:], rows.shape[1:]
    wide = sorted((d for d in base if sizes[d] > 1), key=lambda d: (-strides[d], d))
    order = [d for d in base if sizes[d] == 1] + wide
    if split:
        order.insert(order.index(_TOKEN_DIM - 1), 0)
    return tuple(order)


def _fold_kernel_blocks(
    block_shape: tuple[int, ...], dim_order: tuple[int, ...], kernel_blocks: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The block's shape and storage order with the kernel-block dimension merged into the
    token dimension: the same for every kernel block size (the page bytes are)."""
    if kernel_blocks == 1:
        return block_shape, dim_order
    at = dim_order.index(0)
    shape = (*block_shape[:at], block_shape[at] * block_shape[at + 1], *block_shape[at + 2 :])
    return shape, tuple(d - 1 for d in dim_order if d != 0)


def _fingerprint(
    layers: list[LayerLayout], folded: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> str:
    payload = {
        "version": _FINGERPRINT_VERSION,
        "align": PAGE_ALIGN_BYTES,
        "layers": [
            [layer.name, list(shape), list(order), str(layer.dtype), layer.block_dim]
            for layer, (shape, order) in zip(layers, folded, strict=True)
        ],
    }
    canonical = json.dumps(payload, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align
