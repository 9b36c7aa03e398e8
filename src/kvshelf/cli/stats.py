"""``kvshelf stats``: print a running server's counters, as a table or as JSON.

Besides the server's counters it shows what an operator reads first: the hit ratio (objects
lookups found / objects they asked for), the arena's used percentage, the uptime and the
committed objects of each pool.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from kvshelf.cli.args import add_client_arguments, run_client_command
from kvshelf.client import ServerStats
from kvshelf.metrics import SERVER


def build_parser() -> argparse.ArgumentParser:
    """The stats command's argument parser."""
    parser = argparse.ArgumentParser(
        prog="kvshelf stats",
        description="Print the counters of a running kvshelf server, with its hit ratio, used "
        "percentage, uptime and objects per pool.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_client_arguments(parser)
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: the counters, hit_ratio, used_percent and pool_objects",
    )
    return parser


def summary(stats: ServerStats) -> dict[str, Any]:
    """The derived figures: ``hit_ratio`` (None before any lookup), ``used_percent``."""
    counters = stats.counters
    requested = counters.get("lookup_requested_objects_total", 0)
    capacity = counters.get("capacity_bytes", 0)
    return {
        "hit_ratio": counters["lookup_hit_objects_total"] / requested if requested else None,
        "used_percent": 100 * counters["resident_bytes"] / capacity if capacity else 0.0,
    }


def format_duration(seconds: int) -> str:
    """``1d 02:03:04`` style."""
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{days}d {clock}" if days else clock


def format_report(stats: ServerStats) -> str:
    """The headline figures, the objects per pool, then every counter as ``name  value  help``.

    The help is the metric's declaration (:data:`kvshelf.metrics.SERVER`), so that e.g.
    ``loaded_objects_total`` (pages copied) and ``locked_objects_total`` (pages locked) say
    which is which.
    """
    counters = stats.counters
    derived = summary(stats)
    ratio = derived["hit_ratio"]
    lines = [
        "hit ratio     "
        + (
            "- (no lookups yet)"
            if ratio is None
            else f"{ratio:.1%} ({counters['lookup_hit_objects_total']:,} of "
            f"{counters['lookup_requested_objects_total']:,} objects looked up)"
        ),
        f"used          {derived['used_percent']:.1f}% ({counters['resident_bytes']:,} of "
        f"{counters['capacity_bytes']:,} bytes)",
        f"uptime        {format_duration(counters.get('uptime_seconds', 0))}",
    ]
    if stats.pool_objects:
        lines.append("objects per pool:")
        lines += [f"  {name}  {count:,}" for name, count in sorted(stats.pool_objects.items())]
    width = max(len(name) for name in counters)
    lines.append("")
    lines += [
        f"{name:<{width}}  {value:>16,}  {SERVER[name].help if name in SERVER else ''}".rstrip()
        for name, value in sorted(counters.items())
    ]
    return "\n".join(lines)


def show(stats: ServerStats, args: argparse.Namespace) -> None:
    """Print ``stats`` as ``--json`` or the flags ask."""
    if args.json:
        report = {**stats.counters, **summary(stats), "pool_objects": stats.pool_objects}
        print(json.dumps(report, sort_keys=True))
    else:
        print(format_report(stats))


def main(argv: Sequence[str] | None = None) -> int:
    """Query the server once and print its counters; the exit status of
    :func:`~kvshelf.cli.args.run_client_command`."""
    return run_client_command(
        "stats", build_parser(), argv, lambda client, _args: client.server_stats(), show
    )
