"""argparse value types shared by the ``kvshelf`` subcommands.

Each raises :class:`argparse.ArgumentTypeError`, so argparse names the flag in its message and
exits with status 2. Also the flags and the one call of the subcommands that talk to a running
server (``stats``, ``clear``).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvshelf.client import KVShelfClient, KVShelfError
from kvshelf.curve import ClientCurve, CurveKeyError

T = TypeVar("T")


def positive_float(text: str) -> float:
    """argparse type of a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def fraction(text: str) -> float:
    """argparse type of a float in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1]")
    return value


def parse_port(text: str) -> int:
    """argparse type of a TCP port number, 1..65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} must be in 1..65535")
    return value


def positive_int(text: str) -> int:
    """argparse type of an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer > 0")
    return value


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a subcommand that calls a running server: where it is, how long to wait."""
    parser.add_argument("--host", default="127.0.0.1", help="server host")
    parser.add_argument("--port", type=parse_port, default=5555, help="server port")
    parser.add_argument(
        "--timeout-s",
        type=positive_float,
        default=2.0,
        help="give up when the server has not answered",
    )
    parser.add_argument(
        "--curve-keys",
        metavar="DIR",
        help="for a server started with --curve-keys: the kvshelf keygen folder whose client "
        "keys to use (a server that refuses them does not answer)",
    )


def run_client_command(
    command: str,
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    call: Callable[[KVShelfClient, argparse.Namespace], T],
    show: Callable[[T, argparse.Namespace], int | None],
) -> int:
    """Parse ``argv``, call the server the flags name, and show the result.

    Returns:
        What ``show`` returns, or 0; 1 when the server does not answer or rejects the call (the
        reason on stderr), 2 for bad arguments (argparse's message).
    """
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or a bad value; argparse already printed why
        return exc.code if isinstance(exc.code, int) else 2
    try:
        curve = None if args.curve_keys is None else ClientCurve.load(args.curve_keys)
    except CurveKeyError as exc:
        print(f"kvshelf {command}: error: argument --curve-keys: {exc}", file=sys.stderr)
        return 2
    try:
        with KVShelfClient(args.host, args.port, timeout_s=args.timeout_s, curve=curve) as client:
            result = call(client, args)
    except KVShelfError as exc:
        print(
            f"kvshelf {command}: no answer from the kvshelf server at {args.host}:{args.port}: "
            f"{exc}",
            file=sys.stderr,
        )
        return 1
    return show(result, args) or 0
