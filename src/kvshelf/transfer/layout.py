"""Where one KV block lives in each layer's KV cache tensor, and how it is packed into a page.

A page holds one block of one KV-cache rank: for every layer, in the order of the ``kv_caches``
mapping, the layer's slice of that block in C order (the block dimension removed), at a fixed
byte offset. The packing only depends on the layers' names, logical shapes and dtypes, never on
strides, devices or the number of blocks, so every process that runs the same model with the
same KV cache configuration computes the same page layout and the same fingerprint.

Recognised layouts of one layer's KV cache tensor (``N`` = number of blocks):

- vLLM CPU backend: ``[N, kv_heads, block_size, 2 * head_size]``, block dim 0.
- vLLM GPU backends (K and V first): ``[2, N, block_size, kv_heads, head_size]``, block dim 1.
- MLA: ``[N, block_size, latent_dim]``, block dim 0.

Any other tensor whose leading dimension is ``N`` is accepted with block dim 0 (for example the
FlashInfer layout ``[N, 2, block_size, kv_heads, head_size]``).
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

_FINGERPRINT_VERSION = "kvshelf-kv-layout-v1"


@dataclass(frozen=True)
class LayerLayout:
    """One layer's KV cache tensor and its slice of a page.

    Attributes:
        name: the layer's name (the key in the ``kv_caches`` mapping).
        block_dim: the dimension of the layer's tensor that indexes blocks.
        block_shape: the tensor's shape without ``block_dim``: the shape of one block.
        dtype: the tensor's dtype.
        block_bytes: bytes of one block of this layer.
        offset: byte offset of this layer's slice inside a page.
    """

    name: str
    block_dim: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    block_bytes: int
    offset: int

    def __post_init__(self) -> None:
        assert self.offset % PAGE_ALIGN_BYTES == 0
        assert self.block_bytes == math.prod(self.block_shape) * self.dtype.itemsize


@dataclass(frozen=True)
class KVCacheLayout:
    """The page layout of a model's KV cache (one rank), computed from its per-layer tensors.

    Attributes:
        layers: one entry per layer, in page order (the order of the ``kv_caches`` mapping).
        num_blocks: number of blocks of every layer's tensor (not part of the fingerprint).
        page_bytes: bytes of one page: every layer's block, each at its aligned offset.
        fingerprint: a stable hex digest of the layer names, block shapes, dtypes and block
            dims; equal layouts give equal fingerprints in every process.
    """

    layers: tuple[LayerLayout, ...]
    num_blocks: int
    page_bytes: int
    fingerprint: str

    @classmethod
    def from_kv_caches(
        cls, kv_caches: Mapping[str, torch.Tensor], num_blocks: int
    ) -> KVCacheLayout:
        """Detect each layer's block dimension and pack all layers into one page.

        Args:
            kv_caches: layer name -> that layer's KV cache tensor, in the order vLLM registers
                them (the page order follows the mapping's iteration order).
            num_blocks: the number of KV blocks in every tensor.

        Returns:
            The layout.

        Raises:
            ValueError: no layers, ``num_blocks < 1``, or a tensor with no dimension of
                ``num_blocks`` blocks in a recognised position.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if not kv_caches:
            raise ValueError("kv_caches is empty: no layer to lay out")
        layers: list[LayerLayout] = []
        offset = 0
        for name, tensor in kv_caches.items():
            block_dim = detect_block_dim(tensor.shape, num_blocks, name=name)
            block_shape = tuple(s for d, s in enumerate(tensor.shape) if d != block_dim)
            block_bytes = math.prod(block_shape) * tensor.dtype.itemsize
            layers.append(
                LayerLayout(
                    name=name,
                    block_dim=block_dim,
                    block_shape=block_shape,
                    dtype=tensor.dtype,
                    block_bytes=block_bytes,
                    offset=offset,
                )
            )
            offset = _align_up(offset + block_bytes, PAGE_ALIGN_BYTES)
        page_bytes = offset
        assert page_bytes > 0
        return cls(
            layers=tuple(layers),
            num_blocks=num_blocks,
            page_bytes=page_bytes,
            fingerprint=_fingerprint(layers),
        )

    @property
    def num_layers(self) -> int:
        """Number of layers in a page."""
        return len(self.layers)

    @property
    def layer_offsets(self) -> dict[str, int]:
        """Layer name -> byte offset of that layer's slice inside a page."""
        return {layer.name: layer.offset for layer in self.layers}


def detect_block_dim(
    shape: torch.Size | tuple[int, ...], num_blocks: int, *, name: str = ""
) -> int:
    """Find the dimension that indexes blocks in one layer's KV cache tensor.

    The K-and-V-first GPU layout ``[2, N, ...]`` (5 dims) is checked first, so that it is
    recognised even when ``N == 2``; otherwise the leading dimension must be ``N``.

    Args:
        shape: the tensor's shape.
        num_blocks: the number of blocks ``N``.
        name: the layer's name, for the error message.

    Returns:
        The block dimension (0 or 1).

    Raises:
        ValueError: when neither position holds ``num_blocks``.
    """
    shape = tuple(shape)
    if len(shape) == 5 and shape[0] == 2 and shape[1] == num_blocks:
        return 1
    if len(shape) >= 2 and shape[0] == num_blocks:
        return 0
    raise ValueError(
        f"KV cache tensor {name!r} of shape {list(shape)} has no block dimension of size "
        f"{num_blocks}: expected [num_blocks, kv_heads, block_size, 2*head_size] (CPU), "
        f"[2, num_blocks, block_size, kv_heads, head_size] (GPU) or "
        f"[num_blocks, block_size, dim] (MLA)"
    )


def _fingerprint(layers: list[LayerLayout]) -> str:
    payload = {
        "version": _FINGERPRINT_VERSION,
        "align": PAGE_ALIGN_BYTES,
        "layers": [
            [layer.name, list(layer.block_shape), str(layer.dtype), layer.block_dim]
            for layer in layers
        ],
    }
    canonical = json.dumps(payload, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align
