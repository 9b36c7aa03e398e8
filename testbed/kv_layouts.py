"""KV cache tensors laid out as vLLM 0.32 lays them out, for tests and benchmarks.

vLLM views one backing buffer as a logical ``[L, B, H, N, C]`` array (layers, blocks, heads,
tokens, content) whose physical order is a ``KVCacheLayout`` stride order, and hands the
connector one ``[B, H, N, C]`` view per layer (``vllm/v1/kv_cache_layout.py``,
``vllm/v1/kv_cache_interface.py``). `make_kv_caches` builds the same views from a layout name,
on any device, so that copy engines can be tested on every layout without vLLM. Imports torch
only (the GPU check runs where vLLM is not installed).
"""

from __future__ import annotations

import math

import torch

STRIDE_ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
"""vLLM 0.32's ``KVCacheLayout`` members: physical order of the logical axes
``[L, B, H, N, C]``, outermost first."""

BLOCK_COMPACT = ("BLHNC", "BLNHC")
"""The layouts in which one block of every layer is one contiguous run."""


def make_kv_caches(
    layout: str,
    *,
    num_layers: int,
    num_blocks: int,
    heads: int,
    tokens: int,
    content: int,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
    kernel_blocks: int = 1,
    fill: bool = True,
) -> dict[str, torch.Tensor]:
    """One ``[B, H, N, C]`` view per layer of a single buffer in ``layout``'s stride order.

    Args:
        layout: a key of :data:`STRIDE_ORDERS`.
        num_layers, num_blocks, heads, tokens, content: the logical sizes (``tokens`` per
            block; ``content`` elements per token and head, e.g. K||V). MLA: ``heads=1``.
        dtype, device: of the buffer.
        kernel_blocks: split each block into this many kernel blocks of ``tokens //
            kernel_blocks`` tokens (the views then have ``num_blocks * kernel_blocks`` rows).
        fill: fill the buffer with random bytes (else zeros).

    Returns:
        ``model.layers.{i}.self_attn`` -> view, in layer order.
    """
    order = STRIDE_ORDERS[layout]
    if tokens % kernel_blocks:
        raise ValueError(f"{tokens} tokens do not split into {kernel_blocks} kernel blocks")
    sizes = (num_layers, num_blocks * kernel_blocks, heads, tokens // kernel_blocks, content)
    strides = [0] * 5
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= sizes[axis]
    if kernel_blocks > 1 and order.index(1) < order.index(0):
        raise ValueError("vLLM never splits the blocks of a block-outermost layout")
    numel = math.prod(sizes)
    if fill:
        raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, device=device)
        raw = raw.view(dtype)
    else:
        raw = torch.zeros(numel, dtype=dtype, device=device)
    full = torch.as_strided(raw, sizes, strides)
    return {f"model.layers.{i}.self_attn": full[i] for i in range(num_layers)}
