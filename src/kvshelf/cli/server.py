"""``kvshelf server``: parse the flags into a :class:`ServerConfig` and run the server.

The flags and their defaults mirror :class:`~kvshelf.server.config.ServerConfig` field by field;
this module is the only one that sees them as ``argparse`` values.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvshelf.cli.args import fraction, parse_port, positive_float
from kvshelf.server.app import serve
from kvshelf.server.config import GIB, MIN_ARENA_BYTES, ConfigError, ServerConfig

DEFAULTS = ServerConfig()


def _arena_size_gb(text: str) -> float:
    value = positive_float(text)
    if int(value * GIB) < MIN_ARENA_BYTES:
        raise argparse.ArgumentTypeError("below 4 KiB")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The server's argument parser; its namespace has one attribute per config field."""
    parser = argparse.ArgumentParser(
        prog="kvshelf server",
        description="Run the kvshelf KV cache server: a shared-memory page arena and its index, "
        "served over ZeroMQ. Stops cleanly on SIGTERM or SIGINT.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--host",
        default=DEFAULTS.host,
        help="address to bind; anything but loopback exposes the cache to the network",
    )
    parser.add_argument("--port", type=parse_port, default=DEFAULTS.port, help="TCP port to bind")
    parser.add_argument(
        "--l1-size-gb",
        type=_arena_size_gb,
        default=DEFAULTS.l1_size_gb,
        help="size of the shared-memory arena in GiB (all pools together)",
    )
    parser.add_argument(
        "--eviction-watermark",
        type=fraction,
        default=DEFAULTS.eviction_watermark,
        help="fraction of the arena in use above which a store evicts LRU pages of its pool "
        "rather than taking free space",
    )
    parser.add_argument(
        "--lease-timeout-s",
        type=positive_float,
        default=DEFAULTS.lease_timeout_s,
        help="seconds after which an uncommitted reservation or an unreleased lock is reclaimed",
    )
    parser.add_argument(
        "--prefault",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.prefault,
        help="allocate the whole arena at start (about 0.1 s per GiB) and zero it in the "
        "background, so that stores never wait for the kernel to do it page by page and "
        "workers map the arena ahead of their first load; the server refuses to start when "
        "that memory is not available. --no-prefault allocates pages as stores first write "
        "them, and workers then map them on demand",
    )
    disk = parser.add_argument_group(
        "disk tier (L2)",
        "a local directory behind the arena: every committed object is also written there "
        "(behind the commit, never delaying it), lookups load what L1 lacks from it, and a "
        "restarted server serves its contents at once. Both flags or neither",
    )
    disk.add_argument(
        "--l2-disk-path",
        metavar="DIR",
        default=DEFAULTS.l2_disk_path,
        help="the disk tier's directory, created owner-only; keep one server per directory",
    )
    disk.add_argument(
        "--l2-disk-size-gb",
        metavar="N",
        type=positive_float,
        default=DEFAULTS.l2_disk_size_gb,
        help="the most GiB of objects the directory holds (least recently used go first)",
    )
    shared = parser.add_argument_group(
        "shared tier (L3, Redis)",
        "a Redis or Valkey server, or a Redis Cluster, that every node's kvshelf server shares: "
        "committed objects are written there behind the commit, and lookups fetch what the "
        "local tiers lack from it; while it is down or slow the server serves its local "
        "tiers only, and resumes by itself. See docs/multi-node.md",
    )
    shared.add_argument(
        "--l3-redis-url",
        metavar="URL",
        default=DEFAULTS.l3_redis_url,
        help="redis://[user:password@]host:port[/db] or rediss:// (TLS); the password may "
        "come from KVSHELF_REDIS_PASSWORD instead; a Redis Cluster is detected and used as one",
    )
    shared.add_argument(
        "--l3-secret-file",
        metavar="FILE",
        default=DEFAULTS.l3_secret_file,
        help="a file holding a secret every node shares: values are authenticated with an "
        "HMAC keyed by it, and values without a valid one are never loaded",
    )
    shared.add_argument(
        "--l3-ttl-s",
        metavar="S",
        type=positive_float,
        default=DEFAULTS.l3_ttl_s,
        help="the keys' time to live in Redis; without it keys stay until Redis evicts them "
        "(its maxmemory with allkeys-lru bounds the tier)",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default=DEFAULTS.log_level,
        help="logging level",
    )
    return parser


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
    if (args.l2_disk_path is None) != (args.l2_disk_size_gb is None):
        given, missing = (
            ("--l2-disk-path", "--l2-disk-size-gb")
            if args.l2_disk_size_gb is None
            else ("--l2-disk-size-gb", "--l2-disk-path")
        )
        parser.print_usage(sys.stderr)
        print(f"kvshelf server: error: {given} needs {missing}", file=sys.stderr)
        return 2
    config = ServerConfig(**vars(args))
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config.check_host()
    except ConfigError as exc:
        print(f"kvshelf server: error: {exc}", file=sys.stderr)
        return 2
    return serve(config)
