"""Every vLLM 0.32 ``KVCacheLayout`` (and MLA, and kernel blocks) packs into pages bit-exactly.

The KV caches are built the way vLLM 0.32 builds them (one buffer, a ``[B, H, N, C]`` view
per layer in the layout's stride order: ``testbed.kv_layouts``), on CPU tensors; the
CPU engine round-trips random blocks through an arena and back into a zeroed cache.
"""

from __future__ import annotations

import pytest
import torch

from kvshelf.transfer import CpuTransferEngine, KVCacheLayout
from testbed.kv_layouts import BLOCK_COMPACT, STRIDE_ORDERS, make_kv_caches

NUM_BLOCKS = 12
GEOMETRIES = {
    "mha": {"heads": 2, "tokens": 16, "content": 2 * 32},
    "mla": {"heads": 1, "tokens": 16, "content": 72},
}


def _layout_and_caches(name: str, geometry: str, kernel_blocks: int = 1, fill: bool = True):
    caches = make_kv_caches(
        name,
        num_layers=3,
        num_blocks=NUM_BLOCKS,
        kernel_blocks=kernel_blocks,
        fill=fill,
        **GEOMETRIES[geometry],
    )
    return KVCacheLayout.from_kv_caches(caches, NUM_BLOCKS), caches


def _block(caches: dict[str, torch.Tensor], block: int, kernel_blocks: int) -> list[torch.Tensor]:
    """Block ``block`` of every layer in logical ``[H, N, C]`` order (kernel blocks joined), as
    bytes (random bits include NaNs, which ``torch.equal`` would call unequal to themselves)."""
    rows = slice(block * kernel_blocks, (block + 1) * kernel_blocks)
    return [
        t[rows].permute(1, 0, 2, 3).flatten(1, 2).contiguous().view(torch.uint8)
        for t in caches.values()
    ]


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("name", sorted(STRIDE_ORDERS))
def test_every_layout_round_trips_bit_exact(name: str, geometry: str) -> None:
    layout, caches = _layout_and_caches(name, geometry)
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    engine = CpuTransferEngine(caches, layout, arena)
    blocks, pages = [7, 0, 11, 3, 4], [2, 9, 0, 5, 6]
    engine.store(blocks, pages).wait()
    _, restored = _layout_and_caches(name, geometry, fill=False)
    back = CpuTransferEngine(restored, layout, arena)
    targets = [1, 2, 8, 10, 5]
    back.load(pages, targets).wait()
    for source, target in zip(blocks, targets, strict=True):
        for want, got in zip(_block(caches, source, 1), _block(restored, target, 1), strict=True):
            assert torch.equal(want, got)
    untouched = _block(restored, 0, 1)
    assert all(not t.any() for t in untouched)
    engine.close()
    back.close()


@pytest.mark.parametrize("name", sorted(STRIDE_ORDERS))
def test_a_page_holds_each_layer_block_in_storage_order(name: str) -> None:
    layout, caches = _layout_and_caches(name, "mha")
    arena = torch.zeros(2 * layout.page_bytes, dtype=torch.uint8)
    CpuTransferEngine(caches, layout, arena).store([5], [1]).wait()
    page = arena[layout.page_bytes :]
    order = [d for d in STRIDE_ORDERS[name] if d > 1]  # H, N, C in storage order
    for layer, tensor in zip(layout.layers, caches.values(), strict=True):
        block = tensor[5].permute(*(d - 2 for d in order)).contiguous()
        got = page[layer.offset : layer.offset + layer.block_bytes]
        assert torch.equal(got, block.view(-1).view(torch.uint8))


@pytest.mark.parametrize("name", ["LBNHC", "LBHNC", "LHBNC"])
def test_kernel_blocks_fold_into_the_block(name: str) -> None:
    whole, _ = _layout_and_caches(name, "mha")
    split, split_caches = _layout_and_caches(name, "mha", kernel_blocks=4)
    # Pages do not depend on the kernel block size: same bytes, same fingerprint.
    assert split.page_bytes == whole.page_bytes
    assert split.fingerprint == whole.fingerprint
    assert [layer.kernel_blocks for layer in split.layers] == [4, 4, 4]
    arena = torch.zeros(NUM_BLOCKS * whole.page_bytes, dtype=torch.uint8)
    CpuTransferEngine(split_caches, split, arena).store([3, 9], [0, 1]).wait()
    _, restored = _layout_and_caches(name, "mha", fill=False)
    CpuTransferEngine(restored, whole, arena).load([0, 1], [4, 6]).wait()
    for source, target in ((3, 4), (9, 6)):
        want = _block(split_caches, source, 4)
        got = _block(restored, target, 1)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("name", sorted(STRIDE_ORDERS))
def test_block_compact_layouts_are_one_page_per_block(name: str) -> None:
    layout, caches = _layout_and_caches(name, "mha")
    view = layout.whole_page_view(caches)
    if name not in BLOCK_COMPACT:
        assert view is None
        return
    assert view is not None and view.shape == (NUM_BLOCKS, layout.page_bytes)
    arena = torch.zeros(NUM_BLOCKS * layout.page_bytes, dtype=torch.uint8)
    CpuTransferEngine(caches, layout, arena).store([4, 2], [0, 1]).wait()
    pages = arena.view(NUM_BLOCKS, -1)
    assert torch.equal(pages[0], view[4]) and torch.equal(pages[1], view[2])


def test_layouts_with_equal_sizes_get_distinct_fingerprints() -> None:
    # H == N == C would hide a transposition from the shapes alone.
    fingerprints = {
        KVCacheLayout.from_kv_caches(
            make_kv_caches(n, num_layers=2, num_blocks=4, heads=4, tokens=4, content=4), 4
        ).fingerprint
        for n in STRIDE_ORDERS
    }
    # Layer-compact and block-outermost orders of H, N, C: HNC and NHC, two page formats.
    assert len(fingerprints) == 2
