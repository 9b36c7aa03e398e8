"""``kvshelf clear``: empty a running server's tiers.

Every committed object that no lookup lock pins is dropped from the node's own tiers (the arena
and the disk tier); pools stay registered, so running vLLM engines keep working (their next
lookups miss and their stores refill the cache). The shared Redis tier is other nodes' cache
too: it is cleared only with ``--shared``, and then only of kvshelf's own keys.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvshelf.cli.args import add_client_arguments, run_client_command
from kvshelf.client import Cleared, KVShelfClient

# How often to ask the server whether its shared clear is over.
POLL_S = 0.2


@dataclass(frozen=True)
class Outcome:
    """What a clear did: the server's answer and, after ``--shared``, the keys Redis lost."""

    cleared: Cleared
    shared_removed: int | None = None


def build_parser() -> argparse.ArgumentParser:
    """The clear command's argument parser."""
    parser = argparse.ArgumentParser(
        prog="kvshelf clear",
        description="Empty the cache of a running kvshelf server: drop every stored object of "
        "its arena and disk tier (objects a load is reading at that moment stay). Engines keep "
        "running. The shared Redis tier is left alone unless --shared is given.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_client_arguments(parser)
    parser.add_argument(
        "--shared",
        action="store_true",
        help="also delete kvshelf's keys (kvshelf:v<N>:*) from the shared Redis tier, which "
        "every node using that Redis loses; waits until the server has deleted them",
    )
    return parser


def clear(client: KVShelfClient, args: argparse.Namespace) -> Outcome:
    """Ask for the clear; after ``--shared``, wait until the server's Redis clear is over."""
    # Only a shared clear reports progress through the stats.
    before = client.stats().get("l3_cleared_objects_total", 0) if args.shared else 0
    cleared = client.clear(shared=args.shared)
    if not cleared.clearing_shared:
        return Outcome(cleared)
    while True:
        stats = client.stats()
        if not stats["l3_clearing"]:
            return Outcome(cleared, stats["l3_cleared_objects_total"] - before)
        time.sleep(POLL_S)


def show(outcome: Outcome, args: argparse.Namespace) -> int:
    """Print what the clear dropped (and kept); 1 when ``--shared`` could not clear Redis."""
    cleared = outcome.cleared
    kept = f"; {cleared.locked_objects:,} being loaded stay" if cleared.locked_objects else ""
    on_disk = cleared.cleared_disk_objects
    left = cleared.remaining_objects
    print(
        f"cleared {cleared.cleared_objects:,} objects{kept}"
        + (f"; {on_disk:,} from the disk tier" if on_disk else "")
        + (f"; {left:,} stored meanwhile are left (run it again)" if left else "")
    )
    if outcome.shared_removed is not None:
        print(f"deleted {outcome.shared_removed:,} kvshelf keys from the shared Redis tier")
    elif args.shared:
        print(
            "kvshelf clear: the shared tier was not cleared: the server has no Redis tier "
            "(--l3-redis-url) or Redis is down now (kvshelf stats: l3_available 0)",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Ask the server to clear its tiers once; the exit status of
    :func:`~kvshelf.cli.args.run_client_command`."""
    return run_client_command("clear", build_parser(), argv, clear, show)
