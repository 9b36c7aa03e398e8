"""``make bench-tiers``: TTFT of hits served from kvshelf's disk tier, cold and warm, against L1.

1. Storing runs: engine A computes the prompts against a server without and then with the disk
   tier; the CPU seconds of both runs (engine and server) give the tier's overhead and its CPU
   seconds per GB written.
2. Per page-cache state (``cold``: the object files' pages dropped with POSIX_FADV_DONTNEED;
   ``warm``: read once), a fresh server restarted on the filled directory (L1 empty) serves a
   fresh engine B: each prompt (the disk hit), then floor prompts that compute as many tokens
   with the prefix in vLLM's own cache (the hit without its load). ``raw_gbps`` is one thread
   reading the same number of bytes of object files, in the same cache state, in the same run.
   With the page cache warm, engine C then loads the same prompts from L1 (row ``l1``).
3. Redis (L3, :mod:`benchmarks.tiers.redis_hits`): a fresh engine on a second server loads
   what the first stored through a shared loopback Redis (rows ``tier: "redis"``), without and
   with a secret (``secret``), against ``redis-benchmark`` at the run's value size
   (``raw_c_gbps``, ``load_over_raw_c``), and an engine-less fetch of 1 GiB of pages by a
   third server (``fetch_gbps``, ``fetch_over_raw_c``, its CPU seconds per GB fetched:
   ``server_cpu_s_per_gb``); ``redis`` in the document: the ratios the targets are about.
4. LMCache 0.5.6 (``system: "lmcache"``, :mod:`benchmarks.tiers.lmcache_tiers`): the same
   rounds through its ``fs`` and ``resp`` L2 adapters, its server restarted between.
5. The restart time of a directory of 100,000 small objects.

Rows: ``system``, ``tier``, ``cache``, ``prompt_len``, ``ttft_hit_s``, ``floor_s``, ``load_gbps``
(bytes loaded / (hit - floor)) and ``raw_gbps``; medians over the prompts of a length.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from benchmarks.e2e.backends import engine_env
from benchmarks.e2e.config import REPO, E2EConfig, kv_bytes_per_token, model_name
from benchmarks.e2e.peers import LMCACHE_CHUNK_SIZE
from benchmarks.e2e.ttft import _matching_floor, first_requests
from benchmarks.e2e.ttft_prompts import floor_prompt, hit_candidates
from benchmarks.tiers.lmcache_tiers import fs_rows, resp_rows
from benchmarks.tiers.raw import raw_read_gbps, set_cache_state
from benchmarks.tiers.redis_hits import BENCH_SECRET, raw_get_gbps, redis_hits
from benchmarks.tiers.restart import restart_seconds
from testbed.disk import object_files
from testbed.models import PERF, TINY, ModelSpec, build_model
from testbed.prompts import random_tokens
from testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine
from testbed.server import ServerProcess

OUT = REPO / "bench" / "results" / "tiers.json"


@dataclass(frozen=True)
class TiersConfig:
    """One run of the benchmark.

    Attributes:
        model: The model (the issue's: 16 layers, hidden 1024, float32).
        lengths: Prompt lengths.
        prompts: Prompts per length.
        block_size: vLLM's block size.
        cache_gib: The kvshelf arena (L1).
        disk_gib: The disk tier's budget.
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE`` of the engines.
        restart_objects: Objects of the restart-time measurement.
    """

    model: ModelSpec = PERF
    lengths: tuple[int, ...] = (2048,)
    prompts: int = 3
    block_size: int = 128
    cache_gib: float = 2.0
    disk_gib: float = 8.0
    kv_cache_gib: int = 2
    restart_objects: int = 20_000


QUICK = TiersConfig(
    model=TINY, lengths=(1024,), prompts=2, cache_gib=0.25, disk_gib=0.5, kv_cache_gib=1
)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _server(config: TiersConfig, directory: Path | None) -> ServerProcess:
    disk = [] if directory is None else ["--l2-disk-path", str(directory)]
    disk += [] if directory is None else ["--l2-disk-size-gb", repr(config.disk_gib)]
    return ServerProcess(l1_size_gb=config.cache_gib, extra_args=disk, startup_timeout_s=120.0)


def _wait_written(server: ServerProcess) -> dict[str, int]:
    with server.client() as client:
        while True:
            stats = client.stats()
            if (
                stats["l2_stored_objects_total"] + stats["l2_dropped_writes_total"]
                >= stats["committed_objects_total"]
            ):
                return stats
            time.sleep(0.05)


def _storing_run(
    config: TiersConfig, base: EngineSpec, rounds: list[list[list[int]]], directory: Path | None
) -> dict[str, Any]:
    """Engine A stores ``rounds``; CPU seconds of the engine and of the server."""
    with _server(config, directory) as server:
        server.wait_zeroed()
        before = _children_cpu_s()
        run_engine(
            replace(base, rounds=rounds, kv_transfer_config=kvshelf_transfer_config(server.port))
        )
        engine_cpu = _children_cpu_s() - before
        stats = _wait_written(server) if directory is not None else server.client().stats()
        times = psutil.Process(server.pid).cpu_times()
    return {
        "tier": "disk" if directory is not None else "l1",
        "engine_cpu_s": engine_cpu,
        "server_cpu_s": times.user + times.system,
        "committed_objects": stats["committed_objects_total"],
        "l2_stored_objects": stats["l2_stored_objects_total"],
        "l2_resident_bytes": stats["l2_resident_bytes"],
        "l2_dropped_writes": stats["l2_dropped_writes_total"],
    }


def _hit_rounds(
    config: TiersConfig, warmup: list[int], prompts: list[list[int]]
) -> list[list[list[int]]]:
    rounds = [[warmup]]
    for i, prompt in enumerate(prompts):
        rounds.append([prompt])
        rounds += [
            [floor_prompt(prompt, cached, config.block_size, f"tiers:{i}:{cached}")]
            for cached in hit_candidates(len(prompt), config.block_size)
        ]
    return rounds


def _rows(
    config: TiersConfig,
    result: dict[str, Any],
    prompts: list[list[int]],
    tier: str,
    cache: str,
    raw_gbps: float | None,
    system: str = "kvshelf",
) -> list[dict[str, Any]]:
    """One row per length from a hit run's requests (its warm-up dropped)."""
    requests = iter(first_requests(result)[1:])
    per_token = kv_bytes_per_token(config.model)
    measured: dict[int, list[tuple[float, float, float, int]]] = {}
    for prompt in prompts:
        hit = next(requests)
        floors = [next(requests) for _ in hit_candidates(len(prompt), config.block_size)]
        floor = _matching_floor(hit, floors)
        blocks = -(-hit["num_cached_tokens"] // config.block_size)
        loaded = blocks * config.block_size * per_token
        gbps = (
            loaded / (hit["ttft_s"] - floor["ttft_s"]) / 1e9
            if hit["ttft_s"] > floor["ttft_s"]
            else None
        )
        measured.setdefault(len(prompt), []).append(
            (hit["ttft_s"], floor["ttft_s"], gbps or 0.0, hit["num_cached_tokens"])
        )
    return [
        {
            "system": system,
            "tier": tier,
            "cache": cache,
            "prompt_len": length,
            "ttft_hit_s": statistics.median(m[0] for m in values),
            "floor_s": statistics.median(m[1] for m in values),
            "load_gbps": statistics.median(m[2] for m in values),
            "raw_gbps": raw_gbps,
            "hit_tokens": [m[3] for m in values],
            "ttft_hit_all_s": [m[0] for m in values],
        }
        for length, values in measured.items()
    ]


def _local_part(
    config: TiersConfig,
    base: EngineSpec,
    stored: list[list[int]],
    prompts: list[list[int]],
    rounds: list[list[list[int]]],
    folder: Path,
) -> dict[str, Any]:
    """Storing runs, disk and L1 hits, LMCache's ``fs`` rows, the restart time."""
    directory = folder / "l2"
    print("storing: tier off, then on", flush=True)
    storing = [
        _storing_run(config, base, [[p] for p in stored], None),
        _storing_run(config, base, [[p] for p in stored], directory),
    ]
    files = object_files(str(directory))
    prompt_bytes = max(config.lengths) * kv_bytes_per_token(config.model)
    sample_size = os.stat(files[0]).st_size
    sample = files[: max(1, -(-prompt_bytes // sample_size))]
    rows: list[dict[str, Any]] = []
    for cache in ("cold", "warm"):
        print(f"disk hits, page cache {cache}", flush=True)
        with _server(config, directory) as server:
            server.wait_zeroed()
            set_cache_state(files, cache)
            raw = raw_read_gbps(sample)
            set_cache_state(files, cache)
            kv = kvshelf_transfer_config(server.port)
            result = run_engine(replace(base, rounds=rounds, kv_transfer_config=kv))
            rows += _rows(config, result, prompts, "disk", cache, raw)
            if cache == "warm":
                print("L1 hits", flush=True)
                result = run_engine(replace(base, rounds=rounds, kv_transfer_config=kv))
                rows += _rows(config, result, prompts, "l1", cache, None)
            final = server.client().stats()
    print("LMCache: fs L2 adapter", flush=True)

    def rows_of(
        result: dict[str, Any], tier: str, cache: str, raw: float | None, system: str
    ) -> list[dict[str, Any]]:
        return _rows(config, result, prompts, tier, cache, raw, system)

    store_spec = replace(base, rounds=[[p] for p in stored])
    hit_spec = replace(base, rounds=rounds)
    rows += fs_rows(config.cache_gib, store_spec, hit_spec, prompt_bytes, folder, rows_of)
    written_gb = storing[1]["l2_resident_bytes"] / 1e9
    # The server's CPU: the engine's own (RUSAGE_CHILDREN) misses vLLM's engine-core
    # process in multi-process mode, so it is reported but not compared.
    off, on = (s["server_cpu_s"] for s in storing)
    print("restart time", flush=True)
    restart_s = restart_seconds(folder / "restart", config.restart_objects)
    return {
        "rows": rows,
        "storing": storing,
        "cpu_s_per_gb_written": (storing[1]["server_cpu_s"] - storing[0]["server_cpu_s"])
        / written_gb
        if written_gb
        else None,
        "storing_server_cpu_ratio_on_vs_off": on / off,
        "last_server_stats": final,
        "restart_s_per_100k_objects": restart_s * 100_000 / config.restart_objects,
    }


def _redis_part(
    config: TiersConfig,
    base: EngineSpec,
    stored: list[list[int]],
    prompts: list[list[int]],
    rounds: list[list[list[int]]],
) -> list[dict[str, Any]]:
    """kvshelf's Redis rows (without, then with a secret) and LMCache's ``resp`` rows."""
    rows: list[dict[str, Any]] = []
    for secret in (None, BENCH_SECRET):
        print(f"Redis hits, {'with' if secret else 'without'} a secret", flush=True)
        page_bytes = config.block_size * kv_bytes_per_token(config.model)
        hits = redis_hits(config.cache_gib, base, stored, rounds, page_bytes, secret)
        if hits is None:
            return [{"system": "kvshelf", "tier": "redis", "skipped": "no redis-server"}]
        for row in _rows(config, hits.result, prompts, "redis", "loopback", hits.raw_gbps):
            raw_c = hits.raw_c_gbps
            rows.append(
                row
                | {
                    "secret": secret is not None,
                    "value_bytes": hits.value_bytes,
                    "raw_c_gbps": raw_c,
                    "load_over_raw_c": row["load_gbps"] / raw_c if raw_c else None,
                    "fetch_gbps": hits.fetch.fetch_gbps,
                    "fetch_over_raw_c": hits.fetch.fetch_gbps / raw_c if raw_c else None,
                    "server_cpu_s_per_gb": hits.fetch.server_cpu_s_per_gb,
                    "run_server_cpu_s_per_gb": hits.run_server_cpu_s_per_gb,
                    "l3_hit_objects": hits.stats["l3_hit_objects_total"],
                }
            )
    print("LMCache: resp L2 adapter", flush=True)

    def rows_of(
        result: dict[str, Any], tier: str, cache: str, raw: float | None, system: str
    ) -> list[dict[str, Any]]:
        return _rows(config, result, prompts, tier, cache, raw, system)

    chunks = -(-max(config.lengths) // LMCACHE_CHUNK_SIZE)
    rows += resp_rows(
        config.cache_gib,
        replace(base, rounds=[[p] for p in stored]),
        replace(base, rounds=rounds),
        lambda port: raw_get_gbps(port, chunks, match=b"*"),
        rows_of,
    )
    return rows


def redis_summary(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The Redis tier's ratios against their targets, from the first length's rows."""

    def row(system: str, secret: bool | None = None) -> dict[str, Any] | None:
        return next(
            (
                r
                for r in rows
                if r["system"] == system
                and r["tier"] == "redis"
                and "skipped" not in r
                and r.get("secret") == secret
            ),
            None,
        )

    plain, signed, lmcache = row("kvshelf", False), row("kvshelf", True), row("lmcache")
    if plain is None:
        return {}
    return {
        "load_over_raw_c": plain["load_over_raw_c"],
        "fetch_over_raw_c": plain["fetch_over_raw_c"],
        "server_cpu_s_per_gb": plain["server_cpu_s_per_gb"],
        "server_cpu_s_per_gb_secret": signed["server_cpu_s_per_gb"] if signed else None,
        "ttft_secret_over_plain": signed["ttft_hit_s"] / plain["ttft_hit_s"] if signed else None,
        "ttft_over_lmcache_resp": plain["ttft_hit_s"] / lmcache["ttft_hit_s"] if lmcache else None,
    }


def run(config: TiersConfig, out: Path, scratch: Path, redis_only: bool = False) -> dict[str, Any]:
    """Run the benchmark (only its Redis part: ``redis_only``); write and return the results
    document."""
    folder = Path(tempfile.mkdtemp(prefix="kvshelf-bench-tiers-", dir=scratch))
    try:
        env = engine_env(
            E2EConfig(block_size=config.block_size, kv_cache_gib=config.kv_cache_gib), folder
        )
        prompts = [
            random_tokens(length, seed=f"tiers:{length}:{i}")
            for i in range(config.prompts)
            for length in config.lengths
        ]
        warmup = random_tokens(max(config.lengths), seed="tiers:warmup")
        base = EngineSpec(
            model=str(build_model(config.model)),
            rounds=[],
            max_tokens=2,
            block_size=config.block_size,
            max_model_len=max(config.lengths) + 2 * config.block_size,
            dtype=config.model.dtype,
            sequential=True,
            env=env,
        )
        stored = [warmup, *prompts]
        rounds = _hit_rounds(config, warmup, prompts)
        document: dict[str, Any] = {
            "model": model_name(config.model),
            "config": asdict(config) | {"model": model_name(config.model)},
            "rows": [],
        }
        if not redis_only:
            document |= _local_part(config, base, stored, prompts, rounds, folder)
        document["rows"] += _redis_part(config, base, stored, prompts, rounds)
        document["redis"] = redis_summary(document["rows"])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
    return document


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.tiers [--quick] [--out PATH] [--scratch DIR] [--redis-only]``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tiers", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the tiny model: a smoke run")
    parser.add_argument("--out", type=Path, default=OUT, help="results file")
    parser.add_argument(
        "--scratch",
        type=Path,
        default=Path("/var/tmp"),
        help="where the disk tier's directory goes (a real disk, not tmpfs)",
    )
    parser.add_argument(
        "--redis-only",
        action="store_true",
        help="only the Redis rows (kvshelf without and with a secret, LMCache's resp)",
    )
    args = parser.parse_args(argv)
    config = QUICK if args.quick else TiersConfig()
    document = run(config, args.out, args.scratch, args.redis_only)
    for row in document["rows"]:
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all_s")}))
    if "storing" in document:
        print(
            f"storing server CPU on/off: {document['storing_server_cpu_ratio_on_vs_off']:.3f}; "
            f"CPU s per GB written: {document['cpu_s_per_gb_written']}; "
            f"restart: {document['restart_s_per_100k_objects']:.2f} s per 100k objects"
        )
    print(
        "Redis (targets: load/raw_c >= 0.8, server CPU <= 0.25 s/GB, TTFT vs LMCache resp "
        f"<= 0.6, with a secret <= 1.1): {json.dumps(document['redis'])}"
    )
    return 0
