"""Transfer benchmark: store and load KV blocks through a real server versus a raw memory copy.

One run starts a real ``kvshelf server`` process, registers a pool for a synthetic vLLM CPU KV
cache (``[num_blocks, kv_heads, block_size, 2*head_size]`` per layer), maps the server's arena
and, for each batch size, times:

- store: ``client.reserve`` -> ``engine.store`` -> ``client.commit`` (fresh keys every time);
- load: ``client.lookup(lock=True)`` -> ``engine.load`` -> ``client.release``, into other blocks;
- raw copy: ``dst.copy_(src)`` of two contiguous buffers of the same number of bytes, reused
  every repetition (so cache-warm: on this machine's 260 MiB L3 a 64 MiB copy stays in cache);
- cold raw copy: the same copy, but reading from a rotating slice of a buffer as large as the
  KV cache and writing to a rotating slice of a buffer as large as the arena, so that it touches
  memory the way store and load do (the arena and KV cache exceed the cache);
- the control round trip: ``client.ping`` over what the client uses after registering
  (``transport``: the server's node-local socket), and over ZMQ from a second client, the two
  interleaved (``rtt_zmq_p50_us``);
- the gather (``gather_gbps``), the yardstick of a store: the same scattered source rows (16 KiB
  per block and layer by default) copied into the same destination pages by plain torch calls
  on this thread, no server and no kvshelf code: per layer, one ``index_select`` per run of
  consecutive pages. ``scatter_gbps`` is its mirror, the yardstick of a load: the same pages
  into the same block rows, one ``index_copy_`` per run. ``store_ratio_gather`` and
  ``load_ratio_gather`` divide store and load by them: vLLM's blocks are scattered, so this
  copy, not a contiguous one, is what a store or load can at best approach;
- a stream (one ``stream`` row): ``stream_batches`` store jobs of ``stream_batch_bytes`` each,
  handed at once to a real :class:`~kvshelf.roles.worker.WorkerConnector` whose store thread
  runs them as it does under load (queued jobs batched into one reserve, copy and commit, the
  commit not waited for), timed until ``flush_stores`` returns, against one cold raw copy of
  the same bytes in the same repetition (run after the stream, so that it pushes the stream's
  rows and pages out of cache), and against the gather of the same jobs' rows into the pages
  the worker stored them in (found by a lookup afterwards).

Repetitions are interleaved (raw, gather, store, scatter, load; the gathers run before the copy
they measure in even repetitions and after it in odd ones, so that neither side finds the
other's rows in cache more often) so that noise from other processes hits them alike; every
figure is a median. Block ids are random (vLLM's blocks are fragmented), the
pages are whatever the server hands out. Each batch's last load is checked bit for bit, and the
stream's last job is loaded back and checked too. A store commits without waiting for the
reply (``commit_nowait``), as the worker does: ``commit_us`` is the time to send it.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from kvshelf.bench.gather import gather, scatter
from kvshelf.bench.server_process import ServerProcess
from kvshelf.client import KVShelfClient
from kvshelf.plan import StoreJob
from kvshelf.protocol import PageLayout, pool_name
from kvshelf.transfer import CpuTransferEngine, KVCacheLayout, map_arena

KiB = 1024
MiB = 1024 * KiB
DEFAULT_BATCH_BYTES = (256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
MODEL_FINGERPRINT = "kvshelf-bench-transfer"


@dataclass(frozen=True)
class TransferBenchConfig:
    """What to benchmark.

    Attributes:
        num_layers: layers of the synthetic model.
        kv_heads: KV heads per layer.
        head_size: head size.
        block_size: tokens per block.
        dtype: KV cache dtype name (``float16``, ``bfloat16``, ``float32``).
        batch_bytes: batch sizes to time; each is rounded down to whole pages (at least one).
        repeats: timed repetitions per batch size (after one untimed warm-up).
        pings: control round trips timed per batch size.
        threads: ``torch.set_num_threads`` for the run (raw copies and engine alike); 0 or
            None keeps torch's default. The default is 1: on a 2-core machine that also runs
            the server (and, in CI, other tests), every OpenMP parallel region of a 2-thread
            copy stalls until its second thread gets a core back, and a batch is one region per
            layer, so a busy neighbour slows a 2-thread store or load by 10-100x.
        l1_size_gb: the server's arena size.
        seed: random seed for data, block ids and keys.
        stream_batch_bytes: the size of each store job of the stream (whole pages, at least
            one).
        stream_batches: store jobs per stream repetition; 0 skips the stream.
    """

    num_layers: int = 16
    kv_heads: int = 1
    head_size: int = 32
    block_size: int = 128
    dtype: str = "float16"
    batch_bytes: tuple[int, ...] = DEFAULT_BATCH_BYTES
    repeats: int = 9
    pings: int = 200
    threads: int | None = 1
    l1_size_gb: float = 0.5
    seed: int = 0
    stream_batch_bytes: int = 1 * MiB
    stream_batches: int = 64


@dataclass
class BatchResult:
    """One JSON line of the benchmark's output (throughputs in GB/s = 1e9 bytes/s)."""

    batch_bytes: int
    blocks: int
    store_gbps: float
    load_gbps: float
    raw_copy_gbps: float
    store_ratio: float
    load_ratio: float
    rtt_p50_us: float
    rtt_zmq_p50_us: float
    transport: str
    raw_cold_gbps: float
    store_ratio_cold: float
    load_ratio_cold: float
    store_copy_gbps: float
    load_copy_gbps: float
    gather_gbps: float
    scatter_gbps: float
    store_ratio_gather: float
    load_ratio_gather: float
    page_bytes: int
    layers: int
    dtype: str
    threads: int
    repeats: int
    verified: bool
    extra: dict[str, float] = field(default_factory=dict)
    kind: str = "batch"


@dataclass
class StreamResult:
    """The ``stream`` JSON line: store jobs through the worker's store thread vs a raw copy."""

    batch_bytes: int
    batches: int
    stream_bytes: int
    stream_gbps: float
    raw_cold_gbps: float
    stream_ratio: float
    gather_gbps: float
    store_ratio_gather: float
    verified: bool
    page_bytes: int
    layers: int
    dtype: str
    threads: int
    repeats: int
    kind: str = "stream"


def run_transfer_bench(config: TransferBenchConfig) -> Iterator[BatchResult | StreamResult]:
    """Start a server, run every batch size, and yield one result per batch size, then the
    stream's.

    Args:
        config: what to run.

    Yields:
        The results, in the order of ``config.batch_bytes``, then the stream (unless
        ``config.stream_batches`` is 0).
    """
    if config.threads:
        torch.set_num_threads(config.threads)
    dtype = getattr(torch, config.dtype)
    gen = torch.Generator().manual_seed(config.seed)
    per_layer_block = config.kv_heads * config.block_size * 2 * config.head_size * dtype.itemsize
    page_bytes_guess = per_layer_block * config.num_layers
    max_blocks = max(max(1, b // page_bytes_guess) for b in config.batch_bytes)
    max_blocks = max(max_blocks, config.stream_batch_bytes // page_bytes_guess)
    num_blocks = 2 * max_blocks + 1  # block 0 is vLLM's null block; room for store and load
    kv_caches = _random_kv_caches(config, num_blocks, dtype, gen)
    layout = KVCacheLayout.from_kv_caches(kv_caches, num_blocks)

    with ServerProcess(l1_size_gb=config.l1_size_gb) as server:
        client = KVShelfClient(server.host, server.port, timeout_s=10.0)
        zmq_client = KVShelfClient(server.host, server.port, timeout_s=10.0, local=False)
        page_layout = PageLayout(
            model_fingerprint=MODEL_FINGERPRINT,
            layout_fingerprint=layout.fingerprint,
            page_bytes=layout.page_bytes,
            world_size=1,
            rank=0,
        )
        registration = client.register(page_layout)
        pool = pool_name(MODEL_FINGERPRINT, layout.fingerprint, 1)
        assert registration.pool == pool, (registration.pool, pool)
        assert registration.page_bytes == layout.page_bytes
        # Pre-fault the arena so that first-touch page faults are not timed.
        mapping = map_arena(registration.shm_name, registration.arena_bytes, populate=True)
        engine = CpuTransferEngine(kv_caches, layout, mapping.buffer)
        # The arena's pages, for the yardstick gathers (page i at byte i * page_bytes).
        pages_2d = mapping.buffer[
            : mapping.buffer.numel() // layout.page_bytes * layout.page_bytes
        ].view(-1, layout.page_bytes)
        stream_bytes = config.stream_batches * max(layout.page_bytes, config.stream_batch_bytes)
        cold_bytes = max(num_blocks * layout.page_bytes, stream_bytes)
        cold_src = torch.randint(0, 256, (cold_bytes,), dtype=torch.uint8)
        cold_dst = torch.zeros(registration.arena_bytes, dtype=torch.uint8)
        try:
            for batch_bytes in config.batch_bytes:
                yield _run_batch(
                    config,
                    client,
                    zmq_client.ping,
                    engine,
                    kv_caches,
                    layout,
                    pool,
                    batch_bytes,
                    gen,
                    (cold_src, cold_dst),
                    pages_2d,
                )
            if config.stream_batches > 0:
                yield _run_stream(
                    config,
                    server,
                    client,
                    engine,
                    kv_caches,
                    layout,
                    gen,
                    (cold_src, cold_dst),
                    pages_2d,
                )
        finally:
            del cold_src, cold_dst, pages_2d
            engine.close()
            mapping.close()
            client.close()
            zmq_client.close()


def _run_batch(
    config: TransferBenchConfig,
    client: KVShelfClient,
    zmq_ping: Callable[[], object],
    engine: CpuTransferEngine,
    kv_caches: dict[str, torch.Tensor],
    layout: KVCacheLayout,
    pool: str,
    batch_bytes: int,
    gen: torch.Generator,
    cold: tuple[torch.Tensor, torch.Tensor],
    pages_2d: torch.Tensor,
) -> BatchResult:
    n = max(1, batch_bytes // layout.page_bytes)
    nbytes = n * layout.page_bytes
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    dst = torch.empty_like(src)
    raw_s, cold_s, store_s, load_s, store_copy_s, load_copy_s = [], [], [], [], [], []
    gather_s, scatter_s = [], []
    control_s: dict[str, list[float]] = {"reserve": [], "commit": [], "lookup": [], "release": []}
    cold_src, cold_dst = cold
    cold_src_slots = cold_src.numel() // nbytes
    cold_dst_slots = cold_dst.numel() // nbytes
    assert cold_src_slots >= 1 and cold_dst_slots >= 1
    blocks: list[int] = []
    load_blocks: list[int] = []
    for rep in range(config.repeats + 1):
        # Distinct random blocks for the store and for the load (never the null block 0).
        perm = (torch.randperm(layout.num_blocks - 1, generator=gen) + 1).tolist()
        blocks, load_blocks = perm[:n], perm[n : 2 * n]
        hashes = [
            torch.randint(0, 256, (32,), dtype=torch.uint8, generator=gen).numpy().tobytes()
            for _ in range(n)
        ]

        cold_copy_s = _cold_copy(cold, nbytes, rep % cold_src_slots, rep % cold_dst_slots)
        clock = time.perf_counter

        t0 = clock()
        dst.copy_(src)
        raw = clock() - t0

        t0 = clock()
        reservation = client.reserve(pool, 0, hashes)
        reserve = clock() - t0
        if any(p is None for p in reservation.pages):
            raise RuntimeError("the server reserved fewer pages than asked; raise l1_size_gb")
        page_ids = [int(p) for p in reservation.pages if p is not None]
        yardstick_first = rep % 2 == 0
        if yardstick_first:
            gathered = gather(kv_caches, layout, pages_2d, blocks, page_ids)
        t0 = clock()
        engine.store(blocks, reservation.pages).wait()
        store_copy = clock() - t0
        if not yardstick_first:
            gathered = gather(kv_caches, layout, pages_2d, blocks, page_ids)
        t0 = clock()
        client.commit_nowait(reservation.reservation_id)
        commit = clock() - t0

        t0 = clock()
        hit = client.lookup(pool, hashes, world_size=1, lock=True)
        lookup = clock() - t0
        if hit.num_hit_blocks != n:
            raise RuntimeError(f"lookup hit {hit.num_hit_blocks} of {n} blocks just stored")
        if yardstick_first:
            scattered = scatter(kv_caches, layout, pages_2d, page_ids, load_blocks)
        t0 = clock()
        engine.load(hit.pages[0], load_blocks).wait()
        load_copy = clock() - t0
        if not yardstick_first:
            scattered = scatter(kv_caches, layout, pages_2d, page_ids, load_blocks)
        t0 = clock()
        client.release(hit.lock_id, 0)
        release = clock() - t0

        if rep == 0:
            continue  # warm-up
        raw_s.append(raw)
        cold_s.append(cold_copy_s)
        gather_s.append(gathered)
        scatter_s.append(scattered)
        store_s.append(reserve + store_copy + commit)
        store_copy_s.append(store_copy)
        load_s.append(lookup + load_copy + release)
        load_copy_s.append(load_copy)
        control_s["reserve"].append(reserve)
        control_s["commit"].append(commit)
        control_s["lookup"].append(lookup)
        control_s["release"].append(release)

    verified = _verify(kv_caches, blocks, load_blocks)
    rtt, rtt_zmq = _interleaved_medians((client.ping, zmq_ping), config.pings)
    raw = statistics.median(raw_s)
    store = statistics.median(store_s)
    load = statistics.median(load_s)
    raw_cold = statistics.median(cold_s)
    gather_median = statistics.median(gather_s)
    scatter_median = statistics.median(scatter_s)
    return BatchResult(
        batch_bytes=nbytes,
        blocks=n,
        store_gbps=_gbps(nbytes, store),
        load_gbps=_gbps(nbytes, load),
        raw_copy_gbps=_gbps(nbytes, raw),
        store_ratio=round(raw / store, 3),
        load_ratio=round(raw / load, 3),
        rtt_p50_us=round(rtt * 1e6, 1),
        rtt_zmq_p50_us=round(rtt_zmq * 1e6, 1),
        transport=client.transport,
        raw_cold_gbps=_gbps(nbytes, raw_cold),
        store_ratio_cold=round(raw_cold / store, 3),
        load_ratio_cold=round(raw_cold / load, 3),
        store_copy_gbps=_gbps(nbytes, statistics.median(store_copy_s)),
        load_copy_gbps=_gbps(nbytes, statistics.median(load_copy_s)),
        gather_gbps=_gbps(nbytes, gather_median),
        scatter_gbps=_gbps(nbytes, scatter_median),
        store_ratio_gather=round(gather_median / store, 3),
        load_ratio_gather=round(scatter_median / load, 3),
        page_bytes=layout.page_bytes,
        layers=layout.num_layers,
        dtype=config.dtype,
        threads=torch.get_num_threads(),
        repeats=config.repeats,
        verified=verified,
        extra={f"{name}_us": round(statistics.median(v) * 1e6, 1) for name, v in control_s.items()},
    )


def _run_stream(
    config: TransferBenchConfig,
    server: ServerProcess,
    client: KVShelfClient,
    engine: CpuTransferEngine,
    kv_caches: dict[str, torch.Tensor],
    layout: KVCacheLayout,
    gen: torch.Generator,
    cold: tuple[torch.Tensor, torch.Tensor],
    pages_2d: torch.Tensor,
) -> StreamResult:
    """Time ``stream_batches`` store jobs through a worker's store thread vs a raw copy and vs
    the gather of the same rows into the pages the worker stored them in."""
    from kvshelf.roles.worker import WorkerConnector

    per_job = max(1, config.stream_batch_bytes // layout.page_bytes)
    nbytes = config.stream_batches * per_job * layout.page_bytes
    cold_src, cold_dst = cold
    slots = min(cold_src.numel(), cold_dst.numel()) // nbytes
    if slots < 1:
        raise RuntimeError("the stream is larger than the KV cache or the arena; raise l1_size_gb")
    worker = WorkerConnector(
        lambda: server.client(timeout_s=10.0), MODEL_FINGERPRINT, layout.fingerprint, 0, 1
    )
    worker.register_kv_caches(kv_caches, layout.num_blocks)
    raw_s, stream_s, gather_s = [], [], []
    jobs: list[StoreJob] = []
    pool = pool_name(MODEL_FINGERPRINT, layout.fingerprint, 1)
    try:
        for rep in range(config.repeats + 1):
            jobs = []
            for j in range(config.stream_batches):
                blocks = torch.randperm(layout.num_blocks - 1, generator=gen)[:per_job] + 1
                hashes = torch.randint(0, 256, (per_job, 32), dtype=torch.uint8, generator=gen)
                jobs.append(
                    StoreJob(
                        f"stream-{rep}-{j}",
                        tuple(blocks.tolist()),
                        tuple(row.numpy().tobytes() for row in hashes),
                        0,
                    )
                )
            t0 = time.perf_counter()
            worker.submit_stores(jobs)
            worker.flush_stores()
            t1 = time.perf_counter()
            # Between the stream and its gather: pushes what the stream left in cache out.
            cold_copy_s = _cold_copy(cold, nbytes, rep % slots, rep % slots)
            # The same rows into the same pages: the worker's pages, found by a lookup (locked,
            # so they stay put); the gather rewrites the bytes they already hold.
            blocks = [b for job in jobs for b in job.block_ids]
            hashes = [h for job in jobs for h in job.block_hashes]
            hit = client.lookup(pool, hashes, world_size=1, lock=True)
            try:
                if hit.num_hit_blocks != len(blocks):
                    raise RuntimeError(f"the stream stored {hit.num_hit_blocks} of {len(blocks)}")
                gathered = gather(kv_caches, layout, pages_2d, blocks, list(hit.pages[0]))
            finally:
                client.release(hit.lock_id, 0)
            if rep == 0:
                continue  # warm-up (and the worker's arena prefault)
            raw_s.append(cold_copy_s)
            stream_s.append(t1 - t0)
            gather_s.append(gathered)
        stored = worker.snapshot()["blocks_stored"]
    finally:
        worker.shutdown()
    expected = (config.repeats + 1) * config.stream_batches * per_job
    verified = stored == expected and _verify_stored(client, engine, kv_caches, layout, jobs[-1])
    raw = statistics.median(raw_s)
    stream = statistics.median(stream_s)
    return StreamResult(
        batch_bytes=per_job * layout.page_bytes,
        batches=config.stream_batches,
        stream_bytes=nbytes,
        stream_gbps=_gbps(nbytes, stream),
        raw_cold_gbps=_gbps(nbytes, raw),
        stream_ratio=round(raw / stream, 3),
        gather_gbps=_gbps(nbytes, statistics.median(gather_s)),
        store_ratio_gather=round(statistics.median(gather_s) / stream, 3),
        verified=verified,
        page_bytes=layout.page_bytes,
        layers=layout.num_layers,
        dtype=config.dtype,
        threads=torch.get_num_threads(),
        repeats=config.repeats,
    )


def _cold_copy(cold: tuple[torch.Tensor, torch.Tensor], nbytes: int, i: int, j: int) -> float:
    """Copy slot ``i`` of the cold source into slot ``j`` of the cold destination (slots of
    ``nbytes``); return the seconds it took."""
    cold_src, cold_dst = cold
    cold_from = cold_src[i * nbytes : (i + 1) * nbytes]
    cold_to = cold_dst[j * nbytes : (j + 1) * nbytes]
    t0 = time.perf_counter()
    cold_to.copy_(cold_from)
    return time.perf_counter() - t0


def _verify_stored(
    client: KVShelfClient,
    engine: CpuTransferEngine,
    kv_caches: dict[str, torch.Tensor],
    layout: KVCacheLayout,
    job: StoreJob,
) -> bool:
    """Load a stored job back into other blocks and compare them bit for bit."""
    pool = pool_name(MODEL_FINGERPRINT, layout.fingerprint, 1)
    hit = client.lookup(pool, list(job.block_hashes), world_size=1, lock=True)
    if hit.num_hit_blocks != job.num_blocks:
        return False
    others = [b for b in range(1, layout.num_blocks) if b not in set(job.block_ids)]
    targets = others[: job.num_blocks]
    try:
        engine.load(hit.pages[0], targets).wait()
    finally:
        client.release(hit.lock_id, 0)
    return _verify(kv_caches, job.block_ids, targets)


def _random_kv_caches(
    config: TransferBenchConfig, num_blocks: int, dtype: torch.dtype, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    shape = (num_blocks, config.kv_heads, config.block_size, 2 * config.head_size)
    caches = {}
    for i in range(config.num_layers):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        caches[f"model.layers.{i}.self_attn.attn"] = raw.view(dtype).view(shape)
    return caches


def _verify(kv_caches: dict[str, torch.Tensor], src: Sequence[int], dst: Sequence[int]) -> bool:
    src_t, dst_t = torch.tensor(src), torch.tensor(dst)
    return all(
        torch.equal(t[src_t].view(torch.uint8), t[dst_t].view(torch.uint8))
        for t in kv_caches.values()
    )


def _interleaved_medians(
    fns: Sequence[Callable[[], object]], repeats: int, rounds: int = 10
) -> list[float]:
    """The median time of each of ``fns`` over ``repeats`` calls, made in ``rounds`` rounds
    that take the functions in turn, so that noise hits them alike while each runs back to
    back within a round (as one client's calls do)."""
    per_round = max(1, repeats // rounds)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, fn_times in zip(fns, times, strict=True):
            fn()  # the first call after the other function's is a warm-up
            for _ in range(per_round):
                t0 = time.perf_counter()
                fn()
                fn_times.append(time.perf_counter() - t0)
    return [statistics.median(fn_times) for fn_times in times]


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def result_json(result: BatchResult | StreamResult) -> str:
    """One compact JSON line for a result (``extra`` merged in, omitted when empty)."""
    row = asdict(result)
    row.update(row.pop("extra", {}))
    return json.dumps(row, separators=(", ", ": "))
