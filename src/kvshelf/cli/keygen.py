"""``kvshelf keygen DIR``: write the CURVE keys of a server and a client (see kvshelf.curve)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvshelf.curve import CurveKeyError, keygen


def build_parser() -> argparse.ArgumentParser:
    """The keygen command's argument parser."""
    parser = argparse.ArgumentParser(
        prog="kvshelf keygen",
        description="Write a ZeroMQ CURVE key pair for the server and one for a client into "
        "DIR (owner-only files), with the client's public key in DIR/clients, the server's "
        "allow-list. Use DIR with kvshelf server --curve-keys, kvshelf stats --curve-keys and "
        "the connector key kvshelf.curve_keys_dir. Existing keys are never overwritten.",
    )
    parser.add_argument("dir", metavar="DIR", help="the folder to write (created if needed)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Write the keys.

    Returns:
        0 on success, 1 when the keys cannot be written (e.g. they exist), 2 for bad arguments.
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        written = keygen(args.dir)
    except CurveKeyError as exc:
        print(f"kvshelf keygen: error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0
