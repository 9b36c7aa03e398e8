"""``kvshelf server``: run the cache server in the foreground until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Sequence

import zmq

from kvshelf.platform.shm import SHM_DIR, arena_name
from kvshelf.server.app import RequestHandler, ServerLoop
from kvshelf.server.arena import ExtentAllocator, SharedMemoryArena
from kvshelf.server.index import CacheIndex

logger = logging.getLogger("kvshelf.server")

GIB = 1 << 30


def positive_float(text: str) -> float:
    """argparse type of a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def _watermark(text: str) -> float:
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


def build_parser() -> argparse.ArgumentParser:
    """The server's argument parser."""
    parser = argparse.ArgumentParser(
        prog="kvshelf server",
        description="Run the kvshelf KV cache server: a shared-memory page arena and its index, "
        "served over ZeroMQ. Stops cleanly on SIGTERM or SIGINT.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; anything but loopback exposes the cache to the network",
    )
    parser.add_argument("--port", type=parse_port, default=5555, help="TCP port to bind")
    parser.add_argument(
        "--l1-size-gb",
        type=positive_float,
        default=4.0,
        help="size of the shared-memory arena in GiB (all pools together)",
    )
    parser.add_argument(
        "--eviction-watermark",
        type=_watermark,
        default=0.95,
        help="fraction of the arena in use above which a store evicts LRU pages of its pool "
        "rather than taking free space",
    )
    parser.add_argument(
        "--lease-timeout-s",
        type=positive_float,
        default=30.0,
        help="seconds after which an uncommitted reservation or an unreleased lock is reclaimed",
    )
    parser.add_argument(
        "--prefault",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="allocate the whole arena at start (about 0.1 s per GiB) and zero it in the "
        "background, so that stores never wait for the kernel to do it page by page and "
        "workers map the arena ahead of their first load; the server refuses to start when "
        "that memory is not available. --no-prefault allocates pages as stores first write "
        "them, and workers then map them on demand",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default="INFO",
        help="logging level",
    )
    return parser


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except (OSError, ValueError):
            return False


def available_memory_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """Return the memory the kernel estimates can be allocated without swapping.

    Args:
        meminfo: the ``/proc/meminfo`` file to read.

    Returns:
        ``MemAvailable`` in bytes, or None where it cannot be read.
    """
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server.

    Args:
        argv: the arguments after ``kvshelf server``; defaults to ``sys.argv[1:]``.

    Returns:
        The exit status: 0 after a clean shutdown, 2 for bad arguments, 1 if it cannot start.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or a bad value; argparse already printed why
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    arena_bytes = int(args.l1_size_gb * GIB)
    if arena_bytes < 4096:
        parser.print_usage(sys.stderr)
        print("kvshelf server: error: argument --l1-size-gb: below 4 KiB", file=sys.stderr)
        return 2
    shm_total = os.statvfs(SHM_DIR)
    if arena_bytes > shm_total.f_blocks * shm_total.f_frsize:
        print(
            f"kvshelf server: error: argument --l1-size-gb: {args.l1_size_gb} GiB does not fit "
            f"in {SHM_DIR} ({shm_total.f_blocks * shm_total.f_frsize / GIB:.2f} GiB)",
            file=sys.stderr,
        )
        return 2
    available = available_memory_bytes()
    if args.prefault and available is not None and arena_bytes > available:
        print(
            f"kvshelf server: error: argument --l1-size-gb: {args.l1_size_gb} GiB cannot be "
            f"pre-faulted: only {available / GIB:.2f} GiB of memory is available; lower "
            "--l1-size-gb or pass --no-prefault",
            file=sys.stderr,
        )
        return 2
    if not _is_loopback(args.host):
        logger.warning(
            "BINDING NON-LOOPBACK ADDRESS %s: any host that can reach this port can read and "
            "overwrite cache metadata; the protocol has no authentication",
            args.host,
        )

    return serve(args, arena_bytes)


def _prefault(arena: SharedMemoryArena) -> bool:
    """Allocate the arena and start zeroing it, logging how long the allocation took.

    Returns:
        Whether it worked; False after an error (logged).
    """
    started = time.perf_counter()
    try:
        arena.prefault()
    except OSError as exc:
        logger.error(
            "cannot allocate the %.3f GiB arena: %s; lower --l1-size-gb or pass --no-prefault",
            arena.size_bytes / GIB,
            exc,
        )
        return False
    logger.info(
        "allocated the arena: %d bytes in %.2f s; zeroing it in the background",
        arena.size_bytes,
        time.perf_counter() - started,
    )
    return True


def serve(args: argparse.Namespace, arena_bytes: int) -> int:
    """Create the arena, bind the socket and serve until SIGTERM or SIGINT.

    Args:
        args: validated command-line arguments.
        arena_bytes: the arena size.

    Returns:
        0 after a clean shutdown, 1 when the arena or the socket cannot be set up.
    """
    stop_requested = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True
        logger.info("received %s, shutting down", signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    boot_id = secrets.token_hex(8)
    endpoint = _endpoint(args.host, args.port)
    try:
        arena = SharedMemoryArena(arena_name(args.port, boot_id), arena_bytes)
    except OSError as exc:
        logger.error("cannot create the shared-memory arena: %s", exc)
        return 1
    if args.prefault and not _prefault(arena):
        arena.close()
        return 1
    context = zmq.Context()
    try:
        index = CacheIndex(
            ExtentAllocator(arena_bytes),
            lease_timeout_s=args.lease_timeout_s,
            eviction_watermark=args.eviction_watermark,
        )
        try:
            loop = ServerLoop(RequestHandler(index, arena, boot_id), index, endpoint, context)
        except zmq.ZMQError as exc:
            logger.error("cannot bind %s: %s", endpoint, exc)
            return 1
        logger.info(
            "kvshelf server listening on %s (arena %s, %.3f GiB, boot id %s, "
            "lease %.1f s, watermark %.2f)",
            endpoint,
            arena.path,
            arena_bytes / GIB,
            boot_id,
            args.lease_timeout_s,
            args.eviction_watermark,
        )
        try:
            loop.run(lambda: stop_requested)
        finally:
            loop.close()
    finally:
        context.term()
        arena.close()
    logger.info("kvshelf server stopped")
    return 0
