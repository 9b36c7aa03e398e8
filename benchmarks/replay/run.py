"""``make bench-lazy``: every (workload, concurrency, mode) run, the table, JSON and plot.

`run_one` replays one workload at one concurrency in one mode on its backend
(`benchmarks.replay.backends`); `run_replay` runs them all and writes ``lazy-replay.json``
and ``lazy-replay.png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging_if_needed, suppress_logging

from benchmarks.replay.backends import run_connector, run_plain
from benchmarks.replay.config import MODES, QUICK, ReplayConfig, available_modes
from benchmarks.replay.loop import closed_loop
from benchmarks.replay.measurement import RunResult, hit_rates
from benchmarks.replay.report import format_header, format_row, plot_timelines
from benchmarks.replay.workloads import WORKLOADS, sampled_token
from testbed.models import TINY, build_model

MISMATCH_WARNING = "Part block hashes mismatch for request"
"""The start of the spec's per-request warning when a drain finds reused blocks. Under
eviction pressure FIFO logs it for nearly every request; the benchmark counts those in
``hash_mismatch_skips`` and keeps them off the terminal."""


def _is_not_mismatch_warning(record: logging.LogRecord) -> bool:
    """Logging filter: drop the spec's per-request hash mismatch warning, keep the rest."""
    return not record.getMessage().startswith(MISMATCH_WARNING)


@contextmanager
def _bench_logging() -> Iterator[None]:
    """Quiet vLLM's and kvshelf's per-run INFO lines and lazy offload's mismatch warnings.

    Other kvshelf warnings still print.
    """
    with suppress_logging(logging.WARNING):
        # vLLM applies its logging config on its first engine config, resetting the "vllm"
        # level set below; apply the same (default) config now, once, so that it is not.
        configure_logging_if_needed(LoggingConfig())
    names = ("vllm", "kvshelf")
    saved = {name: logging.getLogger(name).level for name in names}
    offloader_logger = logging.getLogger("kvshelf.lazy.offloader")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    logging.getLogger("kvshelf").setLevel(logging.WARNING)
    offloader_logger.addFilter(_is_not_mismatch_warning)
    try:
        yield
    finally:
        offloader_logger.removeFilter(_is_not_mismatch_warning)
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def run_one(
    config: ReplayConfig, model: Path, workload_name: str, concurrency: int, mode: str
) -> RunResult:
    """Replay one workload at one concurrency in one mode, with its own server.

    Args:
        config: sizes and seeds.
        model: the model folder (only its config is read).
        workload_name: a key of ``WORKLOADS``.
        concurrency: sessions with a request in flight.
        mode: a key of ``MODES``.

    Returns:
        The result row (see ``FIELDS``) and the finish-ordered hit timeline.
    """
    workload = WORKLOADS[workload_name](config.seed, config.max_model_len)
    turns = config.turns_per_session(concurrency)
    num_gpu_blocks = config.gpu_blocks_per_session * concurrency + 1
    engine = {
        "block_size": config.block_size,
        "num_gpu_blocks": num_gpu_blocks,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_num_seqs": concurrency,
        "max_model_len": config.max_model_len,
    }
    sample = sampled_token(config.seed)
    replay = functools.partial(
        closed_loop,
        workload=workload,
        concurrency=concurrency,
        turns=turns,
        block_size=config.block_size,
        step_limit=config.step_limit,
    )
    started = time.perf_counter()
    extra = MODES[mode]
    with _bench_logging():
        if extra is None:
            traffic, measures = run_plain(model, engine, replay, sample)
        else:
            traffic, measures = run_connector(
                model, engine, replay, sample, extra, config.l1_size_gb
            )
    row: dict[str, Any] = {
        "workload": workload_name,
        "concurrency": concurrency,
        "mode": mode,
        **hit_rates(traffic.finished, config.warmup_turns),
        **measures,
        "requests": len(traffic.finished),
        "steps": traffic.steps,
        "busy_steps": traffic.busy_steps,
        "preemptions": traffic.preemptions,
        "num_gpu_blocks": num_gpu_blocks,
        "wall_s": round(time.perf_counter() - started, 2),
    }
    return RunResult(row=row, timeline=traffic.finished)


def run_replay(
    config: ReplayConfig, out_dir: Path, print_line: Callable[[str], None] = print
) -> list[dict[str, Any]]:
    """Run every (workload, concurrency, mode), print the table, write JSON and the plot.

    Args:
        config: what to run.
        out_dir: where ``lazy-replay.json`` and ``lazy-replay.png`` go.
        print_line: where table lines go.

    Returns:
        The result rows, as written to the JSON file.
    """
    model = build_model(TINY)
    modes, notes = available_modes(config.modes)
    for note in notes:
        print_line(f"note: {note}")
    threads = torch.get_num_threads()
    # One thread: on a shared 2-core machine a 2-thread copy stalls on its busy neighbour.
    torch.set_num_threads(1)
    results: list[RunResult] = []
    started = time.perf_counter()
    try:
        print_line(format_header())
        for workload in config.workloads:
            for concurrency in config.concurrencies:
                for mode in modes:
                    result = run_one(config, model, workload, concurrency, mode)
                    results.append(result)
                    print_line(format_row(result.row))
    finally:
        torch.set_num_threads(threads)
    rows = [r.row for r in results]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "lazy-replay.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot_timelines(results, out_dir / "lazy-replay.png")
    print_line(
        f"{len(rows)} runs in {time.perf_counter() - started:.0f} s; "
        f"wrote {out_dir / 'lazy-replay.json'} and {out_dir / 'lazy-replay.png'}"
    )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.replay [--quick] [--out DIR]`` (``make bench-lazy``).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.replay",
        description="Replay chat, agent and unique-prompt workloads through vLLM's real "
        "scheduler, kvshelf's connector and a real server in every offload mode; prints a "
        "table and writes lazy-replay.json and lazy-replay.png.",
    )
    parser.add_argument("--quick", action="store_true", help="a ~1 minute smoke run")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="output folder")
    args = parser.parse_args(argv)
    run_replay(QUICK if args.quick else ReplayConfig(), args.out)
    return 0
