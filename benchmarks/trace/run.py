"""``python -m benchmarks.trace``: hit ratio per policy and capacity on the Mooncake traces.

Every policy replays the same demands (:mod:`.traces`: vLLM's prefix cache of
``--vllm-blocks`` in front) in process (:mod:`.sim`); the server's policies run their own code.
``--server`` also replays the server's policies through a real ``kvshelf server`` each
(:mod:`.server_replay`) and records its hit ratio beside the in-process one: they must agree.
Writes ``bench/results/trace.json`` and ``trace.png`` (hit ratio vs capacity, one line per
policy and trace). ``--requests N`` replays each trace's first N requests (a smoke run).

Must not import torch or vLLM.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.trace import index_scale, server_replay, sim, traces
from kvshelf.server.policy import DEFAULT_POLICY, POLICIES

DEFAULT_CAPACITIES = (1000, 4000, 16000)
DEFAULT_POLICIES = (*sorted(POLICIES), *sim.REFERENCE)
RESULTS = Path("bench/results")
DEFAULT_WITH_DISK = "default"
"""The L1 + disk rows' name for the server's default policies (L1's and the disk's)."""


def measure(
    trace: str,
    capacities: list[int],
    policies: list[str],
    vllm_blocks: int,
    requests: int | None,
    server: bool,
    disk_factor: int,
) -> list[dict[str, object]]:
    """One row per capacity: each policy's token hit ratio and its fraction of Belady's."""
    stream = traces.demands(traces.load_requests(trace, requests), vllm_blocks)
    rows = []
    for capacity in capacities:
        row: dict[str, object] = {"trace": trace, "capacity_blocks": capacity}
        ratios: dict[str, float] = {}
        for name in policies:
            started = time.perf_counter()
            counts = sim.replay(stream, sim.make_cache(name, capacity, stream))
            ratios[name] = counts["hit_tokens"] / counts["tokens"]
            row[f"{name}_seconds"] = round(time.perf_counter() - started, 2)
        row["hit_ratio"] = ratios
        if server:
            on_server: dict[str, float] = {}
            for name in policies:
                if name in POLICIES:
                    started = time.perf_counter()
                    counts = server_replay.replay(stream, capacity, name)
                    on_server[name] = counts["hit_tokens"] / counts["tokens"]
                    row[f"{name}_server_seconds"] = round(time.perf_counter() - started, 2)
            row["server_hit_ratio"] = on_server
            if disk_factor:
                # Each policy in both tiers, then the server's defaults for L1 + disk
                # (DEFAULT_POLICY_ABOVE_DISK above DEFAULT_POLICY).
                with_disk: dict[str, float] = {}
                tiers: dict[str, str | None] = {name: name for name in on_server}
                tiers[DEFAULT_WITH_DISK] = None
                for name, policy in tiers.items():
                    started = time.perf_counter()
                    counts = server_replay.replay(
                        stream, capacity, policy, disk_factor * capacity, policy
                    )
                    with_disk[name] = counts["hit_tokens"] / counts["tokens"]
                    row[f"{name}_l1_disk_seconds"] = round(time.perf_counter() - started, 2)
                row["server_l1_disk_hit_ratio"] = with_disk
                lru = with_disk.get("lru")
                if lru:
                    row["l1_disk_times_lru"] = {n: r / lru for n, r in with_disk.items()}
                print(
                    f"{trace:12s} {capacity:6d} server, disk {disk_factor}x: "
                    + " ".join(f"{n}={100 * r:.1f}%" for n, r in with_disk.items()),
                    flush=True,
                )
            print(
                f"{trace:12s} {capacity:6d} server: "
                + " ".join(f"{n}={100 * r:.1f}%" for n, r in on_server.items()),
                flush=True,
            )
        if "belady" in ratios and ratios["belady"] > 0:
            row["fraction_of_belady"] = {n: r / ratios["belady"] for n, r in ratios.items()}
        if "lru" in ratios and ratios["lru"] > 0:
            row["times_lru"] = {n: r / ratios["lru"] for n, r in ratios.items()}
        rows.append(row)
        print(
            f"{trace:12s} {capacity:6d} "
            + " ".join(f"{n}={100 * r:.1f}%" for n, r in ratios.items()),
            flush=True,
        )
    return rows


def plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({t for row in rows for t in [row["trace"]]})
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, trace in zip(axes[0], names, strict=True):
        mine = [row for row in rows if row["trace"] == trace]
        policies = list(mine[0]["hit_ratio"])  # type: ignore[call-overload]
        for policy in policies:
            xs = [row["capacity_blocks"] for row in mine]
            ys = [100 * row["hit_ratio"][policy] for row in mine]  # type: ignore[index]
            ax.plot(xs, ys, marker="o", label=policy)
        ax.set_xscale("log")
        ax.set_xlabel("kvshelf capacity (blocks of 512 tokens)")
        ax.set_ylabel("token hit ratio (%)")
        ax.set_title(trace)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trace", description=__doc__)
    parser.add_argument("--traces", default=",".join(traces.TRACE_NAMES))
    parser.add_argument(
        "--capacities", default=",".join(map(str, DEFAULT_CAPACITIES)), help="in blocks"
    )
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    parser.add_argument(
        "--vllm-blocks",
        type=int,
        default=traces.DEFAULT_VLLM_BLOCKS,
        help="vLLM's own prefix cache in front, in 512-token blocks (0: none)",
    )
    parser.add_argument("--requests", type=int, default=None, help="first N requests only")
    parser.add_argument(
        "--server",
        action="store_true",
        help="also replay the server's policies through a real kvshelf server each",
    )
    parser.add_argument(
        "--disk-factor",
        type=int,
        default=0,
        help="with --server, also replay with a disk tier of this many times the L1 capacity "
        "behind L1 (0: none)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "trace.json")
    parser.add_argument(
        "--index-scale",
        nargs="?",
        const=",".join(map(str, index_scale.DEFAULT_SCALES)),
        default=None,
        metavar="N,N,...",
        help="instead: lookup cost per block and index memory per object at these numbers of "
        "resident objects (default 10k, 100k, 1M), and a real server's ping latency while the "
        "largest is looked up, to bench/results/index-scale.json",
    )
    args = parser.parse_args(argv)
    if args.index_scale is not None:
        scale_rows = []
        scales = [int(n) for n in args.index_scale.split(",")]
        for objects in scales:
            for name in sorted(POLICIES):
                scale_rows.append(index_scale.measure(objects, name))
                print(scale_rows[-1], flush=True)
        ping = index_scale.ping_under_lookups(max(scales), DEFAULT_POLICY)
        print(ping, flush=True)
        out = args.out.with_name("index-scale.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        result = {"chain_blocks": index_scale.CHAIN, "rows": scale_rows, "ping": ping}
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
        return
    capacities = [int(c) for c in args.capacities.split(",")]
    policies = args.policies.split(",")
    for name in policies:
        if name not in POLICIES and name not in sim.REFERENCE:
            parser.error(f"--policies: {name!r} is not one of {list(DEFAULT_POLICIES)}")
    rows = []
    for trace in args.traces.split(","):
        rows += measure(
            trace,
            capacities,
            policies,
            args.vllm_blocks,
            args.requests,
            args.server,
            args.disk_factor,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "vllm_blocks": args.vllm_blocks,
        "block_tokens": traces.BLOCK_TOKENS,
        "requests": args.requests,
        "hit_ratio": "tokens kvshelf serves / all prompt tokens (vLLM's own hits excluded)",
        "replay": "in process: the server's policy code on stand-in pages (bench.trace.sim)",
        "server_replay": "a real kvshelf server per policy, 4 KiB pages" if args.server else None,
        "disk_factor": args.disk_factor,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
