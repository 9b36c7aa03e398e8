"""``kvshelf clear``: empty a running server's cache.

Every committed object that no lookup lock pins is dropped; pools stay registered, so running
vLLM engines keep working (their next lookups miss and their stores refill the cache).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvshelf.cli.args import add_client_arguments, run_client_command
from kvshelf.client import Cleared, KVShelfClient


def build_parser() -> argparse.ArgumentParser:
    """The clear command's argument parser."""
    parser = argparse.ArgumentParser(
        prog="kvshelf clear",
        description="Empty the cache of a running kvshelf server: drop every stored object "
        "(objects a load is reading at that moment stay). Engines keep running.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_client_arguments(parser)
    return parser


def show(cleared: Cleared, _args: argparse.Namespace) -> None:
    """Print what the clear dropped (and kept)."""
    kept = f"; {cleared.locked_objects:,} being loaded stay" if cleared.locked_objects else ""
    print(f"cleared {cleared.cleared_objects:,} objects{kept}")


def main(argv: Sequence[str] | None = None) -> int:
    """Ask the server to clear its cache once; the exit status of
    :func:`~kvshelf.cli.args.run_client_command`."""
    return run_client_command("clear", build_parser(), argv, KVShelfClient.clear, show)
