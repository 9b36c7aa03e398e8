"""The Redis tier's part of ``make bench-tiers``: node two's hits on what node one stored.

A loopback ``redis-server`` (no persistence) is shared by two kvshelf servers with their own
arenas. Engine A on node one stores the prompts; once every object is in Redis, a fresh
engine B on node two (L1 empty) runs the benchmark's hit rounds, so every hit is fetched from
Redis. ``raw_gbps``: the same client (``redis``) fetching one prompt's values with one plain
pipelined ``GET``, in the same run (LMCache's rows: :mod:`kvshelf.bench.tiers.lmcache_tiers`).
Imports neither torch nor vLLM.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import redis

from kvshelf.server.tiers.redis_format import KEY_PREFIX
from kvshelf.testbed.redis import RedisServer, have_redis
from kvshelf.testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine
from kvshelf.testbed.server import ServerProcess


def _node(cache_gib: float, url: str) -> ServerProcess:
    return ServerProcess(
        l1_size_gb=cache_gib, extra_args=["--l3-redis-url", url], startup_timeout_s=120.0
    )


def _wait_sent(server: ServerProcess) -> dict[str, int]:
    with server.client() as client:
        while True:
            stats = client.stats()
            sent = stats["l3_stored_objects_total"] + stats["l3_dropped_writes_total"]
            if sent >= stats["committed_objects_total"]:
                return stats
            time.sleep(0.05)


def raw_get_gbps(port: int, count: int, match: bytes = KEY_PREFIX + b"*") -> float:
    """Fetch ``count`` values of keys matching ``match`` (kvshelf's by default) with one
    pipelined GET; 1e9 bytes/s."""
    client = redis.Redis(port=port)
    try:
        keys = []
        for key in client.scan_iter(match=match, count=1000):
            keys.append(key)
            if len(keys) == count:
                break
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        start = time.perf_counter()
        values = pipe.execute()
        elapsed = time.perf_counter() - start
    finally:
        client.close()
    return sum(len(v) for v in values) / elapsed / 1e9


def redis_hits(
    cache_gib: float, base: EngineSpec, stored: list[list[int]], rounds: list[list[list[int]]]
) -> tuple[dict[str, Any], float, dict[str, int]] | None:
    """Engine A stores ``stored`` on node one; engine B runs ``rounds`` on node two.

    Returns:
        Engine B's result, ``raw_gbps`` (as many values as one prompt of ``stored`` has
        blocks) and node two's stats; None without ``redis-server``.
    """
    if not have_redis():
        return None
    with RedisServer() as shared:
        with _node(cache_gib, shared.url) as one:
            one.wait_zeroed()
            kv = kvshelf_transfer_config(one.port)
            run_engine(replace(base, rounds=[[p] for p in stored], kv_transfer_config=kv))
            _wait_sent(one)
        with _node(cache_gib, shared.url) as two:
            two.wait_zeroed()
            raw = raw_get_gbps(shared.port, max(len(p) for p in stored) // base.block_size)
            kv = kvshelf_transfer_config(two.port)
            result = run_engine(replace(base, rounds=rounds, kv_transfer_config=kv))
            with two.client() as client:
                stats = client.stats()
    return result, raw, stats
