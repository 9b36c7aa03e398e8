"""``kvshelf gc``: remove the arenas in ``/dev/shm`` whose server is provably gone.

A kvshelf arena whose ownership lock is free (:mod:`kvshelf.platform.ownership`) belonged to a
server that died without removing it (SIGKILL, an OOM kill); it holds its whole size of memory
until removed. A live server's arena (locked) is never touched, and an arena without this
kvshelf's header (made by an older kvshelf, which took no lock) is only reported. A dead
arena is normally adopted by the next server on its port; this command is for ports that will
not get one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvshelf.cli.args import parse_port
from kvshelf.platform.ownership import Owner, scan
from kvshelf.platform.shm import SHM_DIR
from kvshelf.server.page_table import carries_header


def build_parser() -> argparse.ArgumentParser:
    """The gc command's argument parser."""
    parser = argparse.ArgumentParser(
        prog="kvshelf gc",
        description=f"Remove every kvshelf arena in {SHM_DIR} whose server is provably gone "
        "(its ownership lock is free), and report the ones whose owner cannot be proven gone "
        "(made by an older kvshelf without that lock). Live servers' arenas are never touched. "
        "Exits 0.",
    )
    parser.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    parser.add_argument(
        "--port", type=parse_port, help="only the arenas of the server on this port (all: default)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Remove (or list, with ``--dry-run``) the orphaned arenas; exit status 0."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or a bad flag; argparse already printed why
        return exc.code if isinstance(exc.code, int) else 2
    verb = "would remove" if args.dry_run else "removed"
    removed = removed_bytes = live = 0
    unprovable: list[str] = []
    for arena in scan(carries_header, port=args.port):
        if arena.owner is Owner.LIVE:
            live += 1
        elif arena.owner is Owner.UNPROVABLE:
            unprovable.append(arena.name)
        else:
            if args.dry_run:
                arena.release()
            else:
                arena.remove()
            removed += 1
            removed_bytes += arena.size_bytes
            print(f"{verb} {arena.path} ({arena.size_bytes:,} bytes): its server is gone")
    for name in unprovable:
        print(
            f"left {SHM_DIR}/{name}: no kvshelf ownership header (an older kvshelf's arena?); "
            "remove it by hand once no process uses it",
            file=sys.stderr,
        )
    print(
        f"{verb} {removed} orphaned arenas ({removed_bytes:,} bytes); "
        f"{live} live, {len(unprovable)} unprovable left alone"
    )
    return 0
