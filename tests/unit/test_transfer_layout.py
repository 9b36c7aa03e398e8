"""Layout detection and page packing of kvshelf.transfer.layout."""

from __future__ import annotations

import pytest
import torch

from kvshelf.transfer import PAGE_ALIGN_BYTES, KVCacheLayout, detect_block_dim, distinct_layers
from kvshelf.transfer.views import layer_views


def _caches(shape_fn, num_layers: int, num_blocks: int, dtype=torch.float16):
    return {
        f"model.layers.{i}.self_attn": torch.empty(shape_fn(num_blocks), dtype=dtype)
        for i in range(num_layers)
    }


def cpu_shape(n):
    return (n, 2, 32, 2 * 64)


def gpu_shape(n):
    return (2, n, 32, 2, 64)


def mla_shape(n):
    return (n, 32, 576)


@pytest.mark.parametrize(
    ("shape_fn", "block_dim", "block_shape"),
    [
        (cpu_shape, 0, (2, 32, 128)),
        (gpu_shape, 1, (2, 32, 2, 64)),
        (mla_shape, 0, (32, 576)),
    ],
    ids=["cpu", "gpu", "mla"],
)
def test_detects_block_dim_and_packs_layers(shape_fn, block_dim, block_shape):
    layout = KVCacheLayout.from_kv_caches(_caches(shape_fn, 3, 10), num_blocks=10)
    block_bytes = 2 * torch.Size(block_shape).numel()
    assert [layer.block_dim for layer in layout.layers] == [block_dim] * 3
    assert all(layer.block_shape == block_shape for layer in layout.layers)
    assert [layer.offset for layer in layout.layers] == [0, block_bytes, 2 * block_bytes]
    assert layout.page_bytes == 3 * block_bytes
    assert layout.num_blocks == 10
    assert layout.num_layers == 3
    assert list(layout.layer_offsets) == [f"model.layers.{i}.self_attn" for i in range(3)]


def test_gpu_layout_wins_when_num_blocks_is_two():
    assert detect_block_dim((2, 2, 16, 4, 64), 2) == (1, 1)
    assert detect_block_dim((2, 7, 16, 4, 64), 2) == (0, 1)  # FlashInfer-style [N, 2, ...]
    assert detect_block_dim((7, 2, 16, 4, 64), 7) == (0, 1)
    assert detect_block_dim((28, 2, 4, 64), 7) == (0, 4)  # 4 kernel blocks per block


def test_offsets_are_aligned_when_blocks_are_odd_sized():
    caches = {
        "a": torch.empty(4, 3, 5, dtype=torch.float16),
        "b": torch.empty(4, 7, dtype=torch.uint8),
    }
    layout = KVCacheLayout.from_kv_caches(caches, num_blocks=4)
    assert [layer.block_bytes for layer in layout.layers] == [30, 7]
    assert [layer.offset for layer in layout.layers] == [0, PAGE_ALIGN_BYTES]
    assert layout.page_bytes == 2 * PAGE_ALIGN_BYTES


@pytest.mark.parametrize(
    ("shape", "num_blocks"),
    [((11, 2, 32, 128), 10), ((2, 11, 32, 2, 64), 10), ((10,), 10), ((3, 10, 4), 10)],
)
def test_no_block_dim_is_a_clear_error(shape, num_blocks):
    with pytest.raises(ValueError, match=r"no block dimension of size 10"):
        KVCacheLayout.from_kv_caches({"layer": torch.empty(shape)}, num_blocks=num_blocks)


def test_empty_and_bad_num_blocks_are_errors():
    with pytest.raises(ValueError, match="empty"):
        KVCacheLayout.from_kv_caches({}, num_blocks=4)
    with pytest.raises(ValueError, match="positive"):
        KVCacheLayout.from_kv_caches({"x": torch.empty(4, 4)}, num_blocks=0)


def test_fingerprint_ignores_num_blocks_but_not_the_storage_order():
    small = KVCacheLayout.from_kv_caches(_caches(gpu_shape, 2, 5), num_blocks=5)
    big = KVCacheLayout.from_kv_caches(_caches(gpu_shape, 2, 50), num_blocks=50)
    # Same logical shape, other memory order (as vLLM's HND stride orders produce): pages
    # hold blocks in storage order, so their bytes differ, and so does the fingerprint.
    strided = {
        name: torch.empty(2, 5, 2, 32, 64, dtype=torch.float16).transpose(2, 3)
        for name in _caches(gpu_shape, 2, 5)
    }
    permuted = KVCacheLayout.from_kv_caches(strided, num_blocks=5)
    assert small.fingerprint == big.fingerprint != permuted.fingerprint
    assert len(small.fingerprint) == 64
    assert small.page_bytes == big.page_bytes == permuted.page_bytes


def test_fingerprint_changes_with_names_order_shapes_and_dtypes():
    base = _caches(cpu_shape, 2, 8)
    fingerprints = {
        KVCacheLayout.from_kv_caches(base, 8).fingerprint,
        KVCacheLayout.from_kv_caches(dict(reversed(base.items())), 8).fingerprint,
        KVCacheLayout.from_kv_caches(_caches(cpu_shape, 3, 8), 8).fingerprint,
        KVCacheLayout.from_kv_caches(_caches(cpu_shape, 2, 8, torch.bfloat16), 8).fingerprint,
        KVCacheLayout.from_kv_caches(_caches(lambda n: (n, 2, 32, 64), 2, 8), 8).fingerprint,
        KVCacheLayout.from_kv_caches(
            {f"other.{i}": t for i, t in enumerate(base.values())}, 8
        ).fingerprint,
    }
    assert len(fingerprints) == 6


def test_a_size_one_dimension_never_stops_copies_moving_wide_elements() -> None:
    # One KV head (of any stride): the page keeps the contiguous dimension innermost, so the
    # copy views are 16-byte elements, not one 2-byte element at a time.
    caches = {f"l{i}": torch.zeros(8, 1, 128, 64, dtype=torch.float16) for i in range(2)}
    layout = KVCacheLayout.from_kv_caches(caches, 8)
    pages = torch.zeros(4 * layout.page_bytes, dtype=torch.uint8).view(4, -1)
    for layer in layout.layers:
        blocks, page_rows = layer_views(caches[layer.name], layer, layout, pages)
        assert blocks.dtype == page_rows.dtype == torch.complex128
        assert blocks.stride(-1) == page_rows.stride(-1) == 1


def test_overlaid_layers_are_one_layer_of_a_page_and_the_longest_run_covers_the_others() -> None:
    # vLLM's hybrid manager overlays groups on one buffer of 4 blocks of 256 bytes: two
    # attention layers with the same view, a state-space layer's 160-byte state per block.
    memory = torch.zeros(4 * 256, dtype=torch.uint8)
    attention = memory.view(torch.float32).view(4, 2, 4, 8)
    state = torch.as_strided(memory, (4, 1, 1, 160), (256, 160, 160, 1))
    other = torch.zeros(4, 2, 4, 8)
    kv_caches = {"state": state, "attn.0": attention, "attn.1": attention, "other": other}
    distinct, aliases = distinct_layers(kv_caches, num_blocks=4)
    assert list(distinct) == ["attn.0", "other"]
    assert aliases == {"state": "attn.0", "attn.1": "attn.0"}
    layout = KVCacheLayout.from_kv_caches(distinct, 4)
    assert layout.page_bytes == 2 * 256


def test_a_run_longer_than_its_block_or_not_dense_is_not_an_alias() -> None:
    memory = torch.zeros(4 * 256, dtype=torch.uint8)
    attention = memory.view(4, 256)
    # Every other byte of each block: not one dense run, so only an identical view aliases it.
    strided = torch.as_strided(memory, (4, 128), (256, 2))
    distinct, aliases = distinct_layers({"attn": attention, "strided": strided}, num_blocks=4)
    assert list(distinct) == ["attn", "strided"] and aliases == {}
