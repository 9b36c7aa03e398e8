"""The ``kvshelf`` command: a thin dispatcher to each subcommand's own parser.

The package holds the command line of every subcommand but ``bench`` (``kvshelf.bench.cli``,
the transfer benchmark an operator runs on their own machine):
``server`` (:mod:`kvshelf.cli.server`), ``stats`` (:mod:`kvshelf.cli.stats`), ``clear``
(:mod:`kvshelf.cli.clear`), ``gc`` (:mod:`kvshelf.cli.gc`), ``keygen``
(:mod:`kvshelf.cli.keygen`) and the argument types and client options they share
(:mod:`kvshelf.cli.args`). Subcommands are imported when run, so ``kvshelf stats`` never
imports the server or torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

USAGE = """usage: kvshelf [--version] {server,stats,clear,gc,keygen,bench} ...

commands:
  server    run the kvshelf cache server (kvshelf server --help)
  stats     print a running server's counters (kvshelf stats --help)
  clear     empty a running server's cache (kvshelf clear --help)
  gc        remove arenas of dead servers from /dev/shm (kvshelf gc --help)
  keygen    write CURVE keys for --curve-keys (kvshelf keygen --help)
  bench     run a benchmark (kvshelf bench --help)
"""


def _server(argv: Sequence[str]) -> int:
    from kvshelf.cli.server import main

    return main(argv)


def _stats(argv: Sequence[str]) -> int:
    from kvshelf.cli.stats import main

    return main(argv)


def _clear(argv: Sequence[str]) -> int:
    from kvshelf.cli.clear import main

    return main(argv)


def _gc(argv: Sequence[str]) -> int:
    from kvshelf.cli.gc import main

    return main(argv)


def _keygen(argv: Sequence[str]) -> int:
    from kvshelf.cli.keygen import main

    return main(argv)


def _bench(argv: Sequence[str]) -> int:
    try:
        from kvshelf.bench.cli import main
    except ModuleNotFoundError as exc:
        # The transfer benchmark copies with torch, which the base install leaves out.
        if exc.name != "torch":
            raise
        print(
            "kvshelf bench: error: torch is not installed; install kvshelf with the torch "
            "extra (pip install 'kvshelf[torch]') or beside vLLM",
            file=sys.stderr,
        )
        return 1
    return main(argv)


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "server": _server,
    "stats": _stats,
    "clear": _clear,
    "gc": _gc,
    "keygen": _keygen,
    "bench": _bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvshelf <command> [args]`` and return its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    if args[0] == "--version":
        from kvshelf import __version__

        print(f"kvshelf {__version__}")
        return 0
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"kvshelf: unknown command {args[0]!r}\n{USAGE}", end="", file=sys.stderr)
        return 2
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
