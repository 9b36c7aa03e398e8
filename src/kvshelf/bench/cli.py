"""``kvshelf bench``: run a benchmark and print its results as JSON lines."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvshelf.bench.transfer import DEFAULT_BATCH_BYTES, TransferBenchConfig


def _size(text: str) -> int:
    """Parse ``256K``, ``16M``, ``1G`` or a plain number of bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``kvshelf bench``."""
    parser = argparse.ArgumentParser(prog="kvshelf bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    transfer = commands.add_parser(
        "transfer",
        help="store/load bandwidth through a real server vs a raw memory copy",
        description="Store and load batches of KV blocks (vLLM CPU layout) through a real "
        "kvshelf server and its shared-memory arena, next to a raw torch copy of the same "
        "bytes; prints one JSON line per batch size.",
    )
    defaults = TransferBenchConfig()
    transfer.add_argument("--layers", type=int, default=defaults.num_layers)
    transfer.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    transfer.add_argument("--head-size", type=int, default=defaults.head_size)
    transfer.add_argument("--block-size", type=int, default=defaults.block_size)
    transfer.add_argument(
        "--dtype", choices=["float16", "bfloat16", "float32"], default=defaults.dtype
    )
    transfer.add_argument(
        "--batch-bytes",
        type=_size,
        nargs="+",
        default=list(DEFAULT_BATCH_BYTES),
        help="batch sizes, e.g. 256K 1M 16M (rounded down to whole pages)",
    )
    transfer.add_argument("--repeats", type=int, default=defaults.repeats)
    transfer.add_argument("--pings", type=int, default=defaults.pings)
    transfer.add_argument(
        "--threads",
        type=int,
        default=defaults.threads,
        help="torch.set_num_threads for raw copies and engine alike (0: torch's default)",
    )
    transfer.add_argument("--l1-size-gb", type=float, default=defaults.l1_size_gb)
    transfer.add_argument("--seed", type=int, default=defaults.seed)
    transfer.add_argument(
        "--stream-batch-bytes",
        type=_size,
        default=defaults.stream_batch_bytes,
        help="size of each store job of the pipelined stream (rounded down to whole pages)",
    )
    transfer.add_argument(
        "--stream-batches",
        type=int,
        default=defaults.stream_batches,
        help="store jobs per stream repetition, through a worker's store thread (0: no stream)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvshelf bench <benchmark> [options]``.

    Args:
        argv: the arguments after ``bench``; ``sys.argv[1:]`` when None.

    Returns:
        The exit status.
    """
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command == "transfer":
        from kvshelf.bench.transfer import result_json, run_transfer_bench

        config = TransferBenchConfig(
            num_layers=args.layers,
            kv_heads=args.kv_heads,
            head_size=args.head_size,
            block_size=args.block_size,
            dtype=args.dtype,
            batch_bytes=tuple(args.batch_bytes),
            repeats=args.repeats,
            pings=args.pings,
            threads=args.threads,
            l1_size_gb=args.l1_size_gb,
            seed=args.seed,
            stream_batch_bytes=args.stream_batch_bytes,
            stream_batches=args.stream_batches,
        )
        for result in run_transfer_bench(config):
            print(result_json(result), flush=True)
        return 0
    raise AssertionError(f"unhandled command {args.command!r}")
