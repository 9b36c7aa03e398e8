"""Bit-exact block copies of kvshelf.transfer.CpuTransferEngine on a real shared-memory arena."""

from __future__ import annotations

import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshelf.transfer import (
    COMPLETED,
    CpuTransferEngine,
    KVCacheLayout,
    LayerwiseLoad,
    TransferEngine,
    map_arena,
)

NUM_BLOCKS = 24
NUM_PAGES = 40

# Small but real shapes: (layout name, shape for N blocks, block dim).
LAYOUTS = {
    "cpu": (lambda n: (n, 2, 32, 2 * 32), 0),  # [N, kv_heads, block_size, 2*head_size]
    "gpu": (lambda n: (2, n, 32, 2, 32), 1),  # [2, N, block_size, kv_heads, head_size]
    "mla": (lambda n: (n, 32, 72), 0),  # [N, block_size, dim]
}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def random_caches(kind: str, dtype: torch.dtype, num_layers: int = 3, seed: int = 0):
    """Random bit patterns (NaNs and infinities included) in every layer."""
    shape_fn, _ = LAYOUTS[kind]
    gen = torch.Generator().manual_seed(seed)
    caches = {}
    for i in range(num_layers):
        shape = shape_fn(NUM_BLOCKS)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        caches[f"layers.{i}.attn"] = raw.view(dtype).view(shape)
    return caches


def block_bytes(tensor: torch.Tensor, block_dim: int, block_id: int) -> torch.Tensor:
    """One block of one layer as C-order bytes (logical order)."""
    return tensor.select(block_dim, block_id).contiguous().view(-1).view(torch.uint8)


def page_bytes_of(tensor: torch.Tensor, block_dim: int, block_id: int) -> torch.Tensor:
    """One block of one layer as a page holds it, computed independently: its dimensions in
    storage order (largest stride first; size-1 dimensions last), then C-order bytes."""
    block = tensor.select(block_dim, block_id)
    dims = sorted(range(block.dim()), key=lambda d: (block.shape[d] == 1, -block.stride(d), d))
    return block.permute(*dims).contiguous().view(-1).view(torch.uint8)


@pytest.fixture
def arena_factory():
    """Make /dev/shm arenas of a given size; all are unmapped and unlinked afterwards."""
    made = []

    def make(nbytes: int):
        name = f"kvshelf-test-{uuid.uuid4().hex}"
        fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        mapping = map_arena(name, nbytes)
        made.append((name, mapping))
        return mapping

    yield make
    for name, mapping in made:
        mapping.close()
        os.unlink(f"/dev/shm/{name}")


def make_engine(arena_factory, caches):
    layout = KVCacheLayout.from_kv_caches(caches, NUM_BLOCKS)
    mapping = arena_factory(NUM_PAGES * layout.page_bytes + 123)  # a ragged tail is ignored
    return CpuTransferEngine(caches, layout, mapping.buffer), layout, mapping


def check_pages(layout, mapping, caches, block_ids, page_ids):
    pages = mapping.buffer[: NUM_PAGES * layout.page_bytes].view(NUM_PAGES, layout.page_bytes)
    for block, page in zip(block_ids, page_ids, strict=True):
        for layer in layout.layers:
            got = pages[page, layer.offset : layer.offset + layer.block_bytes]
            want = page_bytes_of(caches[layer.name], layer.block_dim, block)
            assert torch.equal(got, want), (layer.name, block, page)


def check_blocks(layout, caches, dst_caches, src_blocks, dst_blocks):
    for src, dst in zip(src_blocks, dst_blocks, strict=True):
        for layer in layout.layers:
            want = block_bytes(caches[layer.name], layer.block_dim, src)
            got = block_bytes(dst_caches[layer.name], layer.block_dim, dst)
            assert torch.equal(got, want), (layer.name, src, dst)


def clone_zeroed(caches):
    return {name: torch.zeros_like(t) for name, t in caches.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
@pytest.mark.parametrize("pattern", ["random", "page_run", "block_run", "both_runs"])
def test_round_trip_bit_exact(arena_factory, kind, dtype, pattern):
    caches = random_caches(kind, dtype)
    engine, layout, mapping = make_engine(arena_factory, caches)
    assert isinstance(engine, TransferEngine)
    gen = torch.Generator().manual_seed(1)
    n = 13
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[:n]
    pages = torch.randperm(NUM_PAGES, generator=gen)[:n]
    if pattern in ("page_run", "both_runs"):
        pages = torch.arange(20, 20 + n)[torch.randperm(n, generator=gen)]
    if pattern in ("block_run", "both_runs"):
        blocks = torch.arange(5, 5 + n)

    handle = engine.store(blocks, pages)
    assert handle is COMPLETED and handle.done()
    handle.wait()
    check_pages(layout, mapping, caches, blocks.tolist(), pages.tolist())

    # Load into other blocks of fresh caches (as a different vLLM instance would).
    dst_caches = clone_zeroed(caches)
    dst_engine = CpuTransferEngine(dst_caches, layout, mapping.buffer)
    dst_blocks = torch.randperm(NUM_BLOCKS, generator=gen)[:n]
    dst_engine.load(pages.tolist(), dst_blocks.tolist()).wait()
    check_blocks(layout, caches, dst_caches, blocks.tolist(), dst_blocks.tolist())
    untouched = sorted(set(range(NUM_BLOCKS)) - set(dst_blocks.tolist()))
    zeros = clone_zeroed(caches)
    check_blocks(layout, zeros, dst_caches, untouched, untouched)


def test_pages_outside_the_batch_are_untouched(arena_factory):
    caches = random_caches("gpu", torch.bfloat16)
    engine, layout, mapping = make_engine(arena_factory, caches)
    mapping.buffer.fill_(0xA5)
    before = mapping.buffer.clone()
    engine.store([3, 9, 4], [7, 2, 30])
    pages = mapping.buffer[: NUM_PAGES * layout.page_bytes].view(NUM_PAGES, -1)
    old = before[: NUM_PAGES * layout.page_bytes].view(NUM_PAGES, -1)
    for page in set(range(NUM_PAGES)) - {7, 2, 30}:
        assert torch.equal(pages[page], old[page])
    assert torch.equal(mapping.buffer[NUM_PAGES * layout.page_bytes :], before[-123:])
    # Padding between layers inside a written page is not part of any layer: left alone too.
    check_pages(layout, mapping, caches, [3, 9, 4], [7, 2, 30])


def test_non_contiguous_gpu_layout(arena_factory):
    """A GPU-shaped cache whose memory order differs from its logical order (HND strides)."""
    gen = torch.Generator().manual_seed(3)
    phys = torch.randint(0, 256, (2, NUM_BLOCKS, 2, 32, 32 * 2), dtype=torch.uint8, generator=gen)
    caches = {
        f"l{i}": phys.clone().view(torch.float16).transpose(2, 3)  # [2, N, block, heads, head]
        for i in range(2)
    }
    assert not caches["l0"].is_contiguous()
    engine, layout, mapping = make_engine(arena_factory, caches)
    blocks, pages = [1, 17, 6, 23], [39, 0, 12, 13]
    engine.store(blocks, pages)
    check_pages(layout, mapping, caches, blocks, pages)
    dst = {name: torch.zeros_like(t) for name, t in caches.items()}
    CpuTransferEngine(dst, layout, mapping.buffer).load(pages, [2, 3, 4, 5])
    check_blocks(layout, caches, dst, blocks, [2, 3, 4, 5])


def test_last_dim_not_contiguous_falls_back_to_own_dtype(arena_factory):
    base = torch.randn(NUM_BLOCKS, 16, 8, dtype=torch.float32)
    caches = {"x": base.transpose(1, 2)}  # [N, 8, 16], last stride 8
    engine, layout, mapping = make_engine(arena_factory, caches)
    engine.store([0, 5, 9], [1, 2, 3])
    check_pages(layout, mapping, caches, [0, 5, 9], [1, 2, 3])
    dst = {"x": torch.zeros_like(caches["x"])}
    CpuTransferEngine(dst, layout, mapping.buffer).load([1, 2, 3], [9, 5, 0])
    check_blocks(layout, caches, dst, [0, 5, 9], [9, 5, 0])


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_batches_round_trip(data):
    """Property: any batch of distinct pages and distinct blocks round-trips bit-exactly."""
    kind = data.draw(st.sampled_from(sorted(LAYOUTS)))
    dtype = data.draw(st.sampled_from(DTYPES))
    caches = random_caches(kind, dtype, num_layers=2, seed=data.draw(st.integers(0, 99)))
    layout = KVCacheLayout.from_kv_caches(caches, NUM_BLOCKS)
    arena = torch.zeros(NUM_PAGES * layout.page_bytes, dtype=torch.uint8)
    n = data.draw(st.integers(0, NUM_BLOCKS))
    blocks = data.draw(st.permutations(range(NUM_BLOCKS)))[:n]
    pages = data.draw(st.permutations(range(NUM_PAGES)))[:n]
    CpuTransferEngine(caches, layout, arena).store(blocks, pages)
    dst = clone_zeroed(caches)
    dst_blocks = data.draw(st.permutations(range(NUM_BLOCKS)))[:n]
    CpuTransferEngine(dst, layout, arena, scratch_bytes=0).load(pages, dst_blocks)
    check_blocks(layout, caches, dst, blocks, dst_blocks)


def test_scratch_path_in_small_chunks(arena_factory):
    caches = random_caches("cpu", torch.float16)
    layout = KVCacheLayout.from_kv_caches(caches, NUM_BLOCKS)
    mapping = arena_factory(NUM_PAGES * layout.page_bytes)
    engine = CpuTransferEngine(caches, layout, mapping.buffer, scratch_bytes=1)
    engine.SCRATCH_MIN_ROWS = 3  # chunks of 3 blocks: 7 blocks take 3 chunks per layer
    blocks, pages = [0, 2, 4, 6, 8, 10, 12], [1, 3, 5, 7, 9, 11, 13]  # no runs on either side
    engine.store(blocks, pages)
    check_pages(layout, mapping, caches, blocks, pages)
    dst = clone_zeroed(caches)
    dst_engine = CpuTransferEngine(dst, layout, mapping.buffer, scratch_bytes=1)
    dst_engine.SCRATCH_MIN_ROWS = 2
    dst_engine.load(pages, [23, 21, 19, 17, 15, 13, 11])
    check_blocks(layout, caches, dst, blocks, [23, 21, 19, 17, 15, 13, 11])


def test_short_runs_never_copy_block_by_block():
    caches = random_caches("cpu", torch.float16)
    layout = KVCacheLayout.from_kv_caches(caches, NUM_BLOCKS)
    engine = CpuTransferEngine(caches, layout, torch.zeros(layout.page_bytes, dtype=torch.uint8))
    assert engine._runs_pay(1, 1) and engine._runs_pay(2, 16)
    assert not engine._runs_pay(5, 16)  # mean run 3.2 < MIN_MEAN_RUN
    saved = 16 * layout.page_bytes // layout.num_layers  # a second copy of 16 blocks
    assert engine._runs_pay(4, 16) == (saved >= 2 * engine.RUN_CALL_BYTES)


def test_bad_batches_copy_nothing(arena_factory):
    caches = random_caches("cpu", torch.float32)
    engine, _, mapping = make_engine(arena_factory, caches)
    before = mapping.buffer.clone()
    with pytest.raises(ValueError, match="duplicate"):
        engine.store([1, 2], [3, 3])
    with pytest.raises(ValueError, match="sources but"):
        engine.store([1, 2], [3])
    with pytest.raises(IndexError):
        engine.store([1, NUM_BLOCKS], [3, 4])
    with pytest.raises(IndexError):
        engine.store([1, 2], [3, NUM_PAGES])
    with pytest.raises(IndexError):
        engine.load([-1], [3])
    with pytest.raises(ValueError, match="1-D"):
        engine.store([[1]], [[2]])
    with pytest.raises(ValueError, match="integers"):
        engine.store(torch.tensor([1.0]), torch.tensor([2.0]))
    assert torch.equal(mapping.buffer, before)
    assert engine.store([], []).done()
    engine.close()
    with pytest.raises(ValueError, match="closed"):
        engine.store([1], [2])


def test_engine_close_releases_the_arena(arena_factory):
    caches = random_caches("mla", torch.float16)
    engine, _, mapping = make_engine(arena_factory, caches)
    engine.store([1], [2])
    with pytest.raises(BufferError):
        mapping.close()
    engine.close()
    mapping.close()
    assert mapping.closed


def test_mismatched_caches_are_rejected():
    caches = random_caches("cpu", torch.float16)
    layout = KVCacheLayout.from_kv_caches(caches, NUM_BLOCKS)
    arena = torch.zeros(4 * layout.page_bytes, dtype=torch.uint8)
    other = {name: t.float() for name, t in caches.items()}
    with pytest.raises(ValueError, match="does not match"):
        CpuTransferEngine(other, layout, arena)
    with pytest.raises(ValueError, match="different layers"):
        CpuTransferEngine(dict(list(caches.items())[:1]), layout, arena)
    with pytest.raises(ValueError, match="no page"):
        CpuTransferEngine(caches, layout, arena[: layout.page_bytes - 1])
    with pytest.raises(ValueError, match="uint8"):
        CpuTransferEngine(caches, layout, arena.view(torch.int16))


def test_prepared_load_copies_exactly_the_layer_asked_in_any_order(arena_factory):
    caches = random_caches("gpu", torch.float16, num_layers=3, seed=7)
    engine, layout, mapping = make_engine(arena_factory, caches)
    blocks, pages = [3, 9, 4, 10], [7, 2, 30, 31]
    engine.store(blocks, pages)
    dst = {name: torch.zeros_like(t) for name, t in caches.items()}
    copy_layer = CpuTransferEngine(dst, layout, mapping.buffer).prepare_load(pages, [5, 6, 7, 8])
    names = [layer.name for layer in layout.layers]
    copy_layer(2)
    assert dst[names[0]].count_nonzero() == 0 and dst[names[1]].count_nonzero() == 0
    copy_layer(0)
    copy_layer(1)
    check_blocks(layout, caches, dst, blocks, [5, 6, 7, 8])
    with pytest.raises(IndexError):
        engine.prepare_load([NUM_PAGES], [1])


def test_begun_loads_fill_layer_by_layer_and_a_bad_load_fails_alone(arena_factory):
    caches = random_caches("cpu", torch.float16, num_layers=3, seed=5)
    engine, layout, mapping = make_engine(arena_factory, caches)
    blocks, pages = [3, 9, 4], [7, 2, 30]
    engine.store(blocks, pages)
    dst = clone_zeroed(caches)
    loading = CpuTransferEngine(dst, layout, mapping.buffer).begin_loads(
        [(pages, [5, 6, 7]), ([NUM_PAGES], [8]), ([1, 2], [9])]
    )
    assert isinstance(loading, LayerwiseLoad)
    names = [layer.name for layer in layout.layers]
    loading.wait_layer(0)
    assert dst[names[0]].count_nonzero() > 0 and dst[names[2]].count_nonzero() == 0
    loading.wait_all()
    loading.run()  # the load thread, late: nothing is left to copy
    failures = loading.failures()
    assert set(failures) == {1, 2}
    assert isinstance(failures[1], IndexError) and "sources but" in str(failures[2])
    check_blocks(layout, caches, dst, blocks, [5, 6, 7])
    assert dst[names[0]][8].count_nonzero() == 0 and dst[names[0]][9].count_nonzero() == 0


class BarrierCopyEngine(CpuTransferEngine):
    """An engine whose scratch-path layer copies also meet at a barrier after copying: stands
    in for copies that take long enough to overlap, which real small copies rarely do."""

    def __init__(self, *args, barrier: threading.Barrier, **kwargs):
        super().__init__(*args, **kwargs)
        self.barrier = barrier
        self.copying = threading.Event()

    def _copy_via_scratch(self, *args, **kwargs):
        super()._copy_via_scratch(*args, **kwargs)
        self.copying.set()
        self.barrier.wait(timeout=10)


def test_threads_copy_layers_at_the_same_time_each_with_its_own_scratch(arena_factory):
    caches = random_caches("cpu", torch.float32, num_layers=4, seed=3)
    layout = KVCacheLayout.from_kv_caches(caches, NUM_BLOCKS)
    mapping = arena_factory(NUM_PAGES * layout.page_bytes)
    CpuTransferEngine(caches, layout, mapping.buffer).store(range(NUM_BLOCKS), range(NUM_BLOCKS))
    dst = clone_zeroed(caches)
    engine = BarrierCopyEngine(
        dst, layout, mapping.buffer, scratch_bytes=1, barrier=threading.Barrier(2)
    )
    engine.SCRATCH_MIN_ROWS = 2
    # No runs on either side, so both loads take the scratch path, in chunks of 2 blocks.
    loads = [([0, 4, 8, 12, 16, 20], [23, 19, 15, 11, 7, 3]), ([2, 6, 10, 14], [1, 5, 9, 13])]
    copies = [engine.prepare_load(pages, blocks) for pages, blocks in loads]
    # Both threads copy every layer of their own load, one layer at a time; each layer's
    # copy only returns once the other thread's copy has run too (else BrokenBarrierError).
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(lambda copy: [copy(i) for i in range(layout.num_layers)], copy)
            for copy in copies
        ]
        for future in futures:
            future.result()
    for pages, blocks in loads:
        check_blocks(layout, caches, dst, pages, blocks)
    engine.close()


def test_close_waits_for_a_running_copy(arena_factory):
    caches = random_caches("cpu", torch.float16)
    layout = KVCacheLayout.from_kv_caches(caches, NUM_BLOCKS)
    mapping = arena_factory(NUM_PAGES * layout.page_bytes)
    barrier = threading.Barrier(2)
    engine = BarrierCopyEngine(caches, layout, mapping.buffer, barrier=barrier)
    with ThreadPoolExecutor(2) as pool:
        store = pool.submit(engine.store, [0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11])
        assert engine.copying.wait(timeout=10)
        closing = pool.submit(engine.close)
        time.sleep(0.3)
        assert not closing.done()  # the store is still in its first layer's copy
        barrier.wait(timeout=10)  # lets the first layer end; the store sees close, raises
        closing.result(timeout=10)
        with pytest.raises(ValueError, match="closed"):
            store.result(timeout=10)
    mapping.close()
    assert mapping.closed
