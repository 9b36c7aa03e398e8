"""``kvshelf stats``: print a running server's counters, as a table or as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvshelf.cli.args import parse_port, positive_float
from kvshelf.client import KVShelfClient, KVShelfError
from kvshelf.metrics import SERVER


def build_parser() -> argparse.ArgumentParser:
    """The stats command's argument parser."""
    parser = argparse.ArgumentParser(
        prog="kvshelf stats",
        description="Print the counters of a running kvshelf server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="server host")
    parser.add_argument("--port", type=parse_port, default=5555, help="server port")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--timeout-s",
        type=positive_float,
        default=2.0,
        help="give up when the server has not answered",
    )
    return parser


def format_table(stats: dict[str, int]) -> str:
    """Render counters as aligned ``name  value  help`` lines, sorted by name.

    The help is the metric's declaration (:data:`kvshelf.metrics.SERVER`), so that e.g.
    ``loaded_objects_total`` (pages copied) and ``locked_objects_total`` (pages locked) say
    which is which.
    """
    width = max(len(name) for name in stats)
    return "\n".join(
        f"{name:<{width}}  {value:>16,}  {SERVER[name].help if name in SERVER else ''}".rstrip()
        for name, value in sorted(stats.items())
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Query the server once and print its counters.

    Returns:
        0 on success, 1 when the server does not answer or rejects the request, 2 for bad
        arguments.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        with KVShelfClient(args.host, args.port, timeout_s=args.timeout_s) as client:
            stats = client.stats()
    except KVShelfError as exc:
        print(
            f"kvshelf stats: no answer from the kvshelf server at {args.host}:{args.port}: {exc}",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(stats, sort_keys=True))
    else:
        print(format_table(stats))
    return 0
