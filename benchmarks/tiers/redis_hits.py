"""The Redis tier's part of ``make bench-tiers``: node two's hits on what node one stored.

A loopback ``redis-server`` (no persistence) is shared by two kvshelf servers with their own
arenas. Engine A on node one stores the prompts; once every object is in Redis, a fresh
engine B on node two (L1 empty) runs the benchmark's hit rounds, so every hit is fetched from
Redis. This runs twice, without and with ``--l3-secret-file`` on both nodes (a fresh Redis
each time), for the cost of the values' tag.

Yardsticks, same Redis, same run, before engine B starts:

- ``raw_c_gbps``: Redis's own C client, ``redis-benchmark -t get -d VALUE_BYTES -P 16``, at the
  size of kvshelf's values in this run (its key set to that many bytes first). ``-c 2`` (the
  tier's I/O threads, not the default 50): 50 connections with 16 values of MiBs in flight
  each would need GBs of output buffers in Redis on this 24 GiB machine.
- ``raw_gbps``: the ``redis`` client fetching one prompt's values with one plain pipelined
  ``GET`` (LMCache's rows: :mod:`benchmarks.tiers.lmcache_tiers`).

``run_server_cpu_s_per_gb``: node two's server process's CPU seconds during engine B's run over
the bytes it fetched from Redis (the engine's lookups and the writes of the blocks it computes
included). ``fetch``: the same fetch without an engine, of 1 GiB of pages (or one prompt's, if
more) on the same Redis (:mod:`benchmarks.tiers.redis_fetch`). Imports neither torch nor vLLM.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import redis

from benchmarks.tiers.redis_fetch import Fetch, fetch_from_redis
from kvshelf.server.tiers.redis_format import KEY_PREFIX
from testbed.redis import RedisServer, have_redis
from testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine
from testbed.server import ServerProcess

# The secret of the rows with --l3-secret-file.
BENCH_SECRET = b"make bench-tiers: a secret shared by both nodes"
# Bytes of the engine-less fetch (at least one prompt's).
FETCH_BYTES = 1 << 30
# The key redis-benchmark's GET test asks for (without -r).
BENCHMARK_KEY = b"key:__rand_int__"
BENCHMARK_PIPELINE = 16
BENCHMARK_CLIENTS = 2
# Bytes redis-benchmark fetches per measurement (at least 2 pipelines' worth per client).
BENCHMARK_BYTES = 2 << 30


@dataclass
class RedisHits:
    """One round of node two's hits through Redis."""

    result: dict[str, Any]
    raw_gbps: float
    raw_c_gbps: float | None
    value_bytes: int
    server_cpu_s: float
    stats: dict[str, int]
    fetch: Fetch

    @property
    def run_server_cpu_s_per_gb(self) -> float | None:
        fetched = self.stats["l3_hit_objects_total"] * self.value_bytes
        return self.server_cpu_s / (fetched / 1e9) if fetched else None


def _node(cache_gib: float, url: str, secret: Path | None) -> ServerProcess:
    extra = ["--l3-redis-url", url, *(["--l3-secret-file", str(secret)] if secret else [])]
    return ServerProcess(l1_size_gb=cache_gib, extra_args=extra, startup_timeout_s=120.0)


def _wait_sent(server: ServerProcess) -> dict[str, int]:
    with server.client() as client:
        while True:
            stats = client.stats()
            sent = stats["l3_stored_objects_total"] + stats["l3_dropped_writes_total"]
            if sent >= stats["committed_objects_total"]:
                return stats
            time.sleep(0.05)


def _kvshelf_keys(client: redis.Redis, count: int, match: bytes) -> list[bytes]:
    keys = []
    for key in client.scan_iter(match=match, count=1000):
        keys.append(key)
        if len(keys) == count:
            break
    return keys


def raw_get_gbps(port: int, count: int, match: bytes = KEY_PREFIX + b"*") -> float:
    """Fetch ``count`` values of keys matching ``match`` (kvshelf's by default) with one
    pipelined GET; 1e9 bytes/s."""
    client = redis.Redis(port=port)
    try:
        pipe = client.pipeline(transaction=False)
        for key in _kvshelf_keys(client, count, match):
            pipe.get(key)
        start = time.perf_counter()
        values = pipe.execute()
        elapsed = time.perf_counter() - start
    finally:
        client.close()
    return sum(len(v) for v in values) / elapsed / 1e9


def raw_c_gbps(port: int, value_bytes: int) -> float | None:
    """``redis-benchmark -t get -d value_bytes -P 16 -c 2`` against the Redis on ``port``, its
    key holding ``value_bytes`` bytes; 1e9 bytes/s. None without ``redis-benchmark``."""
    if shutil.which("redis-benchmark") is None:
        return None
    client = redis.Redis(port=port)
    try:
        client.set(BENCHMARK_KEY, os.urandom(value_bytes))
        requests = max(BENCHMARK_BYTES // value_bytes, 2 * BENCHMARK_PIPELINE * BENCHMARK_CLIENTS)
        command = ["redis-benchmark", "-p", str(port), "-t", "get", "-d", str(value_bytes)]
        command += ["-P", str(BENCHMARK_PIPELINE), "-c", str(BENCHMARK_CLIENTS)]
        command += ["-n", str(requests), "--csv"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
        # CSV: "test","rps",...; the GET row.
        row = next(line for line in done.stdout.splitlines() if line.startswith('"GET'))
        return float(row.split(",")[1].strip('"')) * value_bytes / 1e9
    finally:
        client.delete(BENCHMARK_KEY)
        client.close()


def redis_hits(
    cache_gib: float,
    base: EngineSpec,
    stored: list[list[int]],
    rounds: list[list[list[int]]],
    page_bytes: int,
    secret: bytes | None = None,
) -> RedisHits | None:
    """Engine A stores ``stored`` on node one; engine B runs ``rounds`` on node two; both nodes
    with ``secret`` in their ``--l3-secret-file`` when given; then the engine-less fetch of one
    prompt's worth of pages of ``page_bytes``. None without ``redis-server``."""
    if not have_redis():
        return None
    with tempfile.TemporaryDirectory(prefix="kvshelf-bench-secret-") as folder:
        secret_file = None
        if secret is not None:
            secret_file = Path(folder) / "secret"
            secret_file.write_bytes(secret)
            secret_file.chmod(0o600)
        with RedisServer() as shared:
            with _node(cache_gib, shared.url, secret_file) as one:
                one.wait_zeroed()
                kv = kvshelf_transfer_config(one.port)
                run_engine(replace(base, rounds=[[p] for p in stored], kv_transfer_config=kv))
                _wait_sent(one)
            direct = redis.Redis(port=shared.port)
            value_bytes = int(direct.strlen(_kvshelf_keys(direct, 1, KEY_PREFIX + b"*")[0]))
            direct.close()
            with _node(cache_gib, shared.url, secret_file) as two:
                two.wait_zeroed()
                raw = raw_get_gbps(shared.port, max(len(p) for p in stored) // base.block_size)
                raw_c = raw_c_gbps(shared.port, value_bytes)
                process = psutil.Process(two.pid)
                before = sum(process.cpu_times()[:2])
                kv = kvshelf_transfer_config(two.port)
                result = run_engine(replace(base, rounds=rounds, kv_transfer_config=kv))
                cpu_s = sum(process.cpu_times()[:2]) - before
                with two.client() as client:
                    stats = client.stats()
            # At least FETCH_BYTES: the server's CPU times tick every 10 ms.
            pages = max(max(len(p) for p in stored) // base.block_size, FETCH_BYTES // page_bytes)
            fetch = fetch_from_redis(shared.url, secret_file, page_bytes, pages, value_bytes)
    return RedisHits(result, raw, raw_c, value_bytes, cpu_s, stats, fetch)
