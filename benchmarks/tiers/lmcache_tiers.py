"""LMCache 0.5.6 beside kvshelf in ``make bench-tiers``: its MP server's ``fs`` and ``resp`` L2
adapters on the same engine, prompts and hit rounds.

For each adapter, engine A stores the prompts through an LMCache server with that adapter; the
server is stopped once its L2 writes settled, and a new one (its L1 empty) serves engine B's
hit rounds, so every hit comes from L2, as for kvshelf's rows. ``fs``: once with the adapter's
files dropped from the page cache (``cold``), once warm; ``raw_gbps`` reads the same number of
bytes of its files. ``resp``: a loopback ``redis-server``; ``raw_gbps`` is one pipelined ``GET``
of as many of its values. A setup that fails (an adapter that cannot start here, no hit) gives
a row that says why. Runs under ``.venv-peers`` (``make bench-peers``); imports neither LMCache,
torch nor vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis

from benchmarks.e2e.peers import (
    LMCacheServer,
    lmcache_connector_config,
    lmcache_version,
    peers_python,
)
from benchmarks.tiers.raw import raw_read_gbps, set_cache_state
from testbed.redis import RedisServer, have_redis
from testbed.run_engine import EngineSpec, run_engine

# L2 writes are asynchronous in LMCache's server: they are over once the adapter's files (or
# Redis's memory) stopped changing for this long.
SETTLED_S = 3.0
SETTLE_TIMEOUT_S = 120.0

# Makes rows from an engine B result: (result, tier, cache, raw_gbps, system) -> rows.
RowsOf = Callable[[dict[str, Any], str, str, float | None, str], list[dict[str, Any]]]


def _connector(port: int) -> dict[str, Any]:
    return lmcache_connector_config(port, lazy_policy=None, lazy_threshold=0, lazy_select_count=0)


def _files(directory: Path) -> list[str]:
    return sorted(
        os.path.join(root, name) for root, _, names in os.walk(directory) for name in names
    )


def _wait_settled(size: Callable[[], int]) -> None:
    """Wait until ``size()`` stayed the same for :data:`SETTLED_S`."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last, since = size(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < SETTLED_S:
        time.sleep(0.25)
        now = size()
        if now != last:
            last, since = now, time.monotonic()


def _skipped(tier: str, why: str) -> dict[str, Any]:
    return {"system": "lmcache", "tier": tier, "lmcache": lmcache_version(), "skipped": why}


def _adapter_server(python: Path, cache_gib: float, adapter: dict[str, Any]) -> LMCacheServer:
    return LMCacheServer(
        python, l1_size_gb=cache_gib, extra_args=("--l2-adapter", json.dumps(adapter))
    )


def _store(python: Path, cache_gib: float, adapter: dict[str, Any], spec: EngineSpec) -> None:
    with _adapter_server(python, cache_gib, adapter) as server:
        run_engine(replace(spec, kv_transfer_config=_connector(server.port)), python=str(python))
        if adapter["type"] == "fs":
            _wait_settled(lambda: sum(os.path.getsize(f) for f in _files(adapter["base_path"])))
        else:
            client = redis.Redis(host=adapter["host"], port=adapter["port"])
            _wait_settled(lambda: int(client.info("memory")["used_memory"]))
            client.close()


@contextmanager
def _serving(
    python: Path, cache_gib: float, adapter: dict[str, Any], spec: EngineSpec
) -> Iterator[Callable[[], dict[str, Any]]]:
    """A fresh LMCache server (L1 empty) on the adapter; yields: run ``spec`` against it."""
    with _adapter_server(python, cache_gib, adapter) as server:
        yield lambda: run_engine(
            replace(spec, kv_transfer_config=_connector(server.port)), python=str(python)
        )


def fs_rows(
    cache_gib: float,
    store: EngineSpec,
    hit: EngineSpec,
    prompt_bytes: int,
    folder: Path,
    rows_of: RowsOf,
) -> list[dict[str, Any]]:
    """LMCache's ``fs`` adapter: rows ``tier: "disk"``, cold then warm."""
    python = peers_python()
    if python is None:
        return [_skipped("disk", "not run: .venv-peers missing (make bench-peers)")]
    adapter = {"type": "fs", "base_path": str(folder / "lmcache-fs")}
    rows: list[dict[str, Any]] = []
    try:
        _store(python, cache_gib, adapter, store)
        files = _files(folder / "lmcache-fs")
        if not files:
            return [_skipped("disk", "its fs adapter wrote no file")]
        sample, total = [], 0
        for path in files:
            if total >= prompt_bytes:
                break
            sample.append(path)
            total += os.path.getsize(path)
        for cache in ("cold", "warm"):
            with _serving(python, cache_gib, adapter, hit) as run:
                set_cache_state(files, cache)
                raw = raw_read_gbps(sample)
                set_cache_state(files, cache)
                rows += rows_of(run(), "disk", cache, raw, "lmcache")
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        # An engine that failed or hung, or a server that did not start: the row says which.
        rows.append(_skipped("disk", f"failed: {str(exc)[-300:]}"))
    return rows


def resp_rows(
    cache_gib: float,
    store: EngineSpec,
    hit: EngineSpec,
    raw_get: Callable[[int], float],
    rows_of: RowsOf,
) -> list[dict[str, Any]]:
    """LMCache's ``resp`` adapter on a loopback Redis: rows ``tier: "redis"``.

    ``raw_get(port)``: the reference fetch of as many bytes from the Redis on ``port``.
    """
    python = peers_python()
    if python is None:
        return [_skipped("redis", "not run: .venv-peers missing (make bench-peers)")]
    if not have_redis():
        return [_skipped("redis", "not run: no redis-server")]
    try:
        with RedisServer() as shared:
            adapter = {"type": "resp", "host": "127.0.0.1", "port": shared.port}
            _store(python, cache_gib, adapter, store)
            with _serving(python, cache_gib, adapter, hit) as run:
                raw = raw_get(shared.port)
                return rows_of(run(), "redis", "loopback", raw, "lmcache")
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return [_skipped("redis", f"failed: {str(exc)[-300:]}")]
