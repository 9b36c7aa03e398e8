"""``python -m benchmarks.e2e [options]``: the options of ``make bench-e2e`` and its page rule.

The options narrow the default `E2EConfig` (or the ``--quick`` one); only the full default run
regenerates the generated section of ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import e2e
from benchmarks.e2e.config import LOAD_MODES, MODES, QUICK, REPO, TTFT_MODES, E2EConfig
from benchmarks.e2e.report import PERFORMANCE_PAGE
from benchmarks.e2e.run import run


def _names(text: str, known: Sequence[str]) -> tuple[str, ...]:
    """Parse a comma-separated list of mode names (empty: none)."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modes {unknown}; choose from {list(known)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.e2e [options]``.

    Args:
        argv: Command-line arguments; default ``sys.argv[1:]``.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=e2e.__doc__)
    parser.add_argument("--quick", action="store_true", help="a few-minute smoke run")
    parser.add_argument(
        "--lengths", type=lambda t: tuple(int(x) for x in t.split(",") if x), default=None
    )
    parser.add_argument("--prompts", type=int, default=None, help="prompts per length (>= 4)")
    parser.add_argument(
        "--ttft-modes",
        type=lambda t: _names(t, TTFT_MODES),
        default=None,
        help=f"comma-separated, of {','.join(TTFT_MODES)} (default: all)",
    )
    parser.add_argument(
        "--load-modes",
        type=lambda t: _names(t, tuple(MODES)),
        default=None,
        help=f"comma-separated, of {','.join(MODES)} (default: {','.join(LOAD_MODES)}); "
        "'' for no load rows",
    )
    parser.add_argument("--no-gqa", action="store_true", help="skip the grouped-query model")
    parser.add_argument("--no-lmcache", action="store_true", help="skip LMCache's rows")
    parser.add_argument(
        "--single-process",
        action="store_true",
        help="TTFT engines in vLLM's single-process mode (fast starts; kvshelf rows only)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--page",
        type=Path,
        default=None,
        help="Markdown page to regenerate the marked performance section of (default: "
        "docs/performance.md for the full default run, none when --quick or any option "
        "narrows the run)",
    )
    args = parser.parse_args(argv)
    config = QUICK if args.quick else E2EConfig()
    overrides: dict[str, Any] = {}
    if args.lengths is not None:
        overrides["lengths"] = args.lengths
    if args.prompts is not None:
        overrides["prompts"] = args.prompts
    if args.ttft_modes is not None:
        overrides["ttft_modes"] = args.ttft_modes
    if args.load_modes is not None:
        overrides["load_modes"] = args.load_modes
    if args.no_gqa:
        overrides["gqa_model"] = None
    if args.single_process:
        overrides["multiprocessing"] = False
    config = replace(config, **overrides)
    # A partial run must not replace the full run's figures on the performance page.
    full_run = not (args.quick or overrides or args.no_lmcache)
    page = args.page if args.page is not None or not full_run else PERFORMANCE_PAGE
    return run(config, args.out, page=page, skip_lmcache=args.no_lmcache)
