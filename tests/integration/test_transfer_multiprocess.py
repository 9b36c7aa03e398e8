"""KV blocks through a real server and its shared-memory arena, across real processes.

Two writer processes store random KV blocks (reserve -> CpuTransferEngine.store -> commit), a
third process loads them back (locking lookup -> CpuTransferEngine.load -> release) into other
block ids, and the test checks every byte, for the vLLM CPU, GPU and MLA layouts.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from kvshelf.client import KVShelfClient
from kvshelf.protocol import PageLayout
from kvshelf.transfer import CpuTransferEngine, KVCacheLayout, map_arena

NUM_BLOCKS = 32
NUM_LAYERS = 3
MODEL = "test-transfer-multiprocess"
# layout name -> (shape for N blocks, dtype)
LAYOUTS = {
    "cpu": ((lambda n: (n, 2, 32, 2 * 32)), torch.bfloat16),
    "gpu": ((lambda n: (2, n, 32, 2, 32)), torch.float16),
    "mla": ((lambda n: (n, 32, 72)), torch.float32),
}


def make_caches(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """The same random KV caches in every process for the same (kind, seed)."""
    shape_fn, dtype = LAYOUTS[kind]
    gen = torch.Generator().manual_seed(seed)
    shape = shape_fn(NUM_BLOCKS)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return {
        f"model.layers.{i}.self_attn.attn": torch.randint(
            0, 256, (nbytes,), dtype=torch.uint8, generator=gen
        )
        .view(dtype)
        .view(shape)
        for i in range(NUM_LAYERS)
    }


def block_bytes(caches: dict[str, torch.Tensor], kind: str, block_ids: list[int]) -> list[bytes]:
    """Each block's bytes, all layers in order, computed independently of the engine."""
    block_dim = 1 if kind == "gpu" else 0
    return [
        b"".join(
            t.select(block_dim, block).contiguous().view(torch.uint8).numpy().tobytes()
            for t in caches.values()
        )
        for block in block_ids
    ]


def page_layout(layout: KVCacheLayout) -> PageLayout:
    return PageLayout(
        model_fingerprint=MODEL,
        layout_fingerprint=layout.fingerprint,
        page_bytes=layout.page_bytes,
        world_size=1,
        rank=0,
    )


def store_worker(port: int, kind: str, seed: int, hashes: list[bytes], blocks: list[int]) -> str:
    """A writer process: store ``blocks`` of its caches under ``hashes``; return the fingerprint."""
    caches = make_caches(kind, seed)
    layout = KVCacheLayout.from_kv_caches(caches, NUM_BLOCKS)
    with KVShelfClient("127.0.0.1", port, timeout_s=10.0) as client:
        registration = client.register(page_layout(layout))
        mapping = map_arena(registration.shm_name, registration.arena_bytes)
        engine = CpuTransferEngine(caches, layout, mapping.buffer)
        try:
            reservation = client.reserve(registration.pool, 0, hashes)
            assert all(page is not None for page in reservation.pages), reservation.pages
            engine.store(blocks, reservation.pages).wait()
            client.commit(reservation.reservation_id)
        finally:
            engine.close()
            mapping.close()
    return layout.fingerprint


def load_worker(
    port: int, kind: str, hashes: list[bytes], blocks: list[int]
) -> tuple[str, list[bytes]]:
    """A reader process: load ``hashes`` into ``blocks`` of zeroed caches; return their bytes."""
    caches = {name: torch.zeros_like(t) for name, t in make_caches(kind, seed=0).items()}
    layout = KVCacheLayout.from_kv_caches(caches, NUM_BLOCKS)
    with KVShelfClient("127.0.0.1", port, timeout_s=10.0) as client:
        registration = client.register(page_layout(layout))
        mapping = map_arena(registration.shm_name, registration.arena_bytes)
        engine = CpuTransferEngine(caches, layout, mapping.buffer)
        try:
            hit = client.lookup(registration.pool, hashes, world_size=1, lock=True)
            assert hit.num_hit_blocks == len(hashes), hit
            engine.load(hit.pages[0], blocks).wait()
            client.release(hit.lock_id, 0)
        finally:
            engine.close()
            mapping.close()
    return layout.fingerprint, block_bytes(caches, kind, blocks)


@pytest.fixture(scope="module")
def processes():
    """Three long-lived spawned processes: writer A, writer B and the reader."""
    context = multiprocessing.get_context("spawn")
    executors = [ProcessPoolExecutor(max_workers=1, mp_context=context) for _ in range(3)]
    yield executors
    for executor in executors:
        executor.shutdown(cancel_futures=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_two_writers_one_reader_bit_exact(kvshelf_server, processes, kind):
    writer_a, writer_b, reader = processes
    port = kvshelf_server.port
    hashes = [hashlib.sha256(f"{kind}-{i}".encode()).digest() for i in range(16)]
    gen = torch.Generator().manual_seed(7)
    blocks_a = torch.randperm(NUM_BLOCKS, generator=gen)[:8].tolist()
    blocks_b = torch.randperm(NUM_BLOCKS, generator=gen)[:8].tolist()
    load_blocks = torch.randperm(NUM_BLOCKS, generator=gen)[:16].tolist()

    # The two writers run at the same time, each in its own process, with its own caches.
    future_a = writer_a.submit(store_worker, port, kind, 1, hashes[:8], blocks_a)
    future_b = writer_b.submit(store_worker, port, kind, 2, hashes[8:], blocks_b)
    fingerprint_a, fingerprint_b = future_a.result(), future_b.result()
    fingerprint_r, loaded = reader.submit(load_worker, port, kind, hashes, load_blocks).result()

    expected = block_bytes(make_caches(kind, 1), kind, blocks_a) + block_bytes(
        make_caches(kind, 2), kind, blocks_b
    )
    assert len(loaded) == len(expected) == 16
    for i, (got, want) in enumerate(zip(loaded, expected, strict=True)):
        assert got == want, f"block {i} ({hashes[i].hex()[:8]}) differs"
    assert any(any(b) for b in loaded)  # not trivially zero
    assert fingerprint_a == fingerprint_b == fingerprint_r
    with kvshelf_server.client() as client:
        assert client.stats()


_FINGERPRINT_SCRIPT = """
import torch
from kvshelf.transfer import KVCacheLayout
caches = {f"model.layers.{i}.attn": torch.empty(2, 9, 16, 4, 64, dtype=torch.bfloat16)
          for i in range(4)}
print(KVCacheLayout.from_kv_caches(caches, 9).fingerprint)
"""


def test_fingerprint_is_stable_across_processes():
    caches = {
        f"model.layers.{i}.attn": torch.empty(2, 9, 16, 4, 64, dtype=torch.bfloat16)
        for i in range(4)
    }
    here = KVCacheLayout.from_kv_caches(caches, 9).fingerprint
    seen = set()
    for hash_seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        out = subprocess.run(
            [sys.executable, "-c", _FINGERPRINT_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        seen.add(out.stdout.strip())
    assert seen == {here}


@pytest.mark.timeout(300)
def test_bench_transfer_smoke(capsys):
    """``kvshelf bench transfer`` runs against a real server and prints one JSON line per size."""
    from kvshelf.bench.cli import main

    argv = ["transfer", "--batch-bytes", "256K", "1M", "--repeats", "2", "--pings", "5"]
    argv += ["--stream-batches", "8"]
    assert main([*argv, "--layers", "4", "--threads", "1", "--l1-size-gb", "0.0625"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    rows = [row for row in lines if row["kind"] == "batch"]
    assert [row["batch_bytes"] for row in rows] == [256 * 1024, 1024 * 1024]
    (stream,) = [row for row in lines if row["kind"] == "stream"]
    assert stream["verified"] is True and stream["batches"] == 8
    assert stream["stream_gbps"] > 0 and stream["stream_ratio"] > 0
    assert stream["gather_gbps"] > 0 and stream["store_ratio_gather"] > 0
    for row in rows:
        assert row["verified"] is True
        for key in ("store_gbps", "load_gbps", "raw_copy_gbps", "store_ratio", "load_ratio"):
            assert row[key] > 0
        for key in ("gather_gbps", "scatter_gbps", "store_ratio_gather", "load_ratio_gather"):
            assert row[key] > 0
        assert row["rtt_p50_us"] > 0


def test_gather_and_scatter_yardsticks_copy_blocks_to_pages_and_back():
    """The yardsticks of ``bench transfer`` make the copy a store (and a load) makes: block
    rows of every layer land in the pages the engine would write, bit for bit."""
    from kvshelf.bench.gather import gather, scatter

    caches = {
        f"model.layers.{i}.attn": torch.randint(0, 1000, (9, 2, 16, 64)).to(torch.float16)
        for i in range(3)
    }
    layout = KVCacheLayout.from_kv_caches(caches, 9)
    arena = torch.zeros(8 * layout.page_bytes, dtype=torch.uint8)
    pages_2d = arena.view(8, layout.page_bytes)
    engine_arena = torch.zeros_like(arena)
    engine = CpuTransferEngine(caches, layout, engine_arena)
    blocks, pages = [5, 1, 7, 2], [3, 4, 0, 6]  # two runs of pages: 3-4, and 0 and 6 alone
    assert gather(caches, layout, pages_2d, blocks, pages) > 0
    engine.store(blocks, pages).wait()
    assert torch.equal(arena, engine_arena)
    before = {name: t.clone() for name, t in caches.items()}
    targets = [8, 3, 4, 6]
    assert scatter(caches, layout, pages_2d, pages, targets) > 0
    for name, t in caches.items():
        assert torch.equal(t[targets], before[name][blocks])
        others = [b for b in range(9) if b not in targets]
        assert torch.equal(t[others], before[name][others])
    engine.close()
