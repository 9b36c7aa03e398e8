"""``kvshelf server``: parse the flags into a :class:`ServerConfig` and run the server.

The flags and their defaults mirror :class:`~kvshelf.server.config.ServerConfig` field by field;
this module is the only one that sees them as ``argparse`` values.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvshelf.cli.args import fraction, parse_port, positive_float, positive_int
from kvshelf.server.app import serve
from kvshelf.server.config import GIB, MIN_ARENA_BYTES, ConfigError, ServerConfig
from kvshelf.server.limits import (
    BYTES_PER_LEASE_UNIT,
    BYTES_PER_PAGE,
    BYTES_PER_POOL,
    CLIENT_BUFFER_BYTES,
    MIN_PAGE_BYTES,
    RECEIVE_HWM_FRAMES,
    TRANSPORT_MAX_MESSAGE_BYTES,
)
from kvshelf.server.policy import DEFAULT_POLICY, DEFAULT_POLICY_ABOVE_DISK, POLICIES
from kvshelf.server.tenants import TenantQuota, parse_tenant_quota

DEFAULTS = ServerConfig()


def _arena_size_gb(text: str) -> float:
    value = positive_float(text)
    if int(value * GIB) < MIN_ARENA_BYTES:
        raise argparse.ArgumentTypeError("below 4 KiB")
    return value


def _tenant_quota(text: str) -> TenantQuota:
    try:
        return parse_tenant_quota(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The server's argument parser; its namespace has one attribute per config field."""
    parser = argparse.ArgumentParser(
        prog="kvshelf server",
        description="Run the kvshelf KV cache server: a shared-memory page arena and its index, "
        "served over ZeroMQ. Stops cleanly (arena unlinked) on SIGTERM, SIGINT, SIGHUP or "
        "SIGQUIT. Worst-case memory beyond "
        "the arena (--l1-size-gb, shared memory): the index holds at most "
        f"{BYTES_PER_PAGE} B per {MIN_PAGE_BYTES} B of arena (pages are at least "
        f"{MIN_PAGE_BYTES} B) and what --eviction-policy keeps per page ("
        + ", ".join(f"{name} {p.extra_bytes_per_page} B" for name, p in POLICIES.items())
        + f"), {BYTES_PER_LEASE_UNIT} B per lease unit (--max-pools x "
        f"--max-lease-units-per-pool) and {BYTES_PER_POOL // 1024} KiB per pool; with the "
        f"defaults and a {DEFAULTS.l1_size_gb:g} GiB arena that is "
        f"{DEFAULTS.worst_case_index_bytes() / GIB:.2f} GiB. Add about 100 MiB for the process, "
        f"and ZeroMQ's buffers: at most {CLIENT_BUFFER_BYTES / 2**20:.0f} MiB per connected "
        f"client ({RECEIVE_HWM_FRAMES} queued frames of at most "
        f"{TRANSPORT_MAX_MESSAGE_BYTES / 2**20:.2f} MiB; a larger one disconnects it). "
        "A real KV page is 10s of KiB to MiBs, so in practice the pages "
        "cost well under 1 % of the arena.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--host",
        default=DEFAULTS.host,
        help="address to bind; anything but loopback needs --curve-keys (or "
        "--allow-unauthenticated)",
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
        help="fraction of the arena in use above which a store evicts pages of its pool "
        "rather than taking free space",
    )
    parser.add_argument(
        "--eviction-policy",
        choices=sorted(POLICIES),
        # Absent unless given: the default depends on --l2-disk-path (ServerConfig).
        default=argparse.SUPPRESS,
        help="which pages of a pool L1 evicts first: lru, the least recently used; reuse, "
        "pages used once before pages used again, which live up to k times longer, k learnt "
        f"from lookups' misses (docs/cache-policy.md). Default: {DEFAULT_POLICY}, or "
        f"{DEFAULT_POLICY_ABOVE_DISK} with a disk tier (--l2-disk-path), which then keeps what "
        "is reused (--l2-disk-eviction-policy)",
    )
    parser.add_argument(
        "--tenant-quota",
        type=_tenant_quota,
        default=DEFAULTS.tenant_quota,
        metavar="BYTES|PERCENT",
        help="the most L1 bytes one tenant (a request's cache_salt, else its LoRA name) holds "
        "in a pool, as bytes (512M, 2GiB) or a percentage of the arena (25%%): a store that "
        "would pass it evicts the tenant's own pages, and what they cannot make room for is "
        "not stored. Without it tenants have only a soft share: eviction takes from the "
        "tenant holding the most (docs/cache-policy.md)",
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
    parser.add_argument(
        "--adopt",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.adopt,
        help="adopt the arena a dead (killed) server on this port left in /dev/shm: its "
        "committed pages are loadable at once, and pages its clients may still use stay out "
        "of use for --lease-timeout-s. An arena of another size or format is removed. "
        "--no-adopt removes it and starts empty (see docs/crash-recovery.md)",
    )
    parser.add_argument(
        "--keep-arena-on-exit",
        action="store_true",
        default=DEFAULTS.keep_arena_on_exit,
        help="leave the arena in /dev/shm at a clean stop, for the next server on this port "
        "to adopt (a restart that keeps the cache, e.g. systemctl restart); without it a "
        "clean stop removes the arena",
    )
    parser.add_argument(
        "--local-socket",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.local_socket,
        help="also answer clients on this node over a Unix socket in the abstract namespace "
        "(named after the port and the boot id; only this user and root are served): the "
        "same requests as the ZMQ port with a fraction of its round trip. Clients move to it "
        "after their first reply and keep ZMQ where they cannot reach it. --no-local-socket "
        "serves ZMQ only",
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
        help="the most GiB of objects the directory holds (which go first: "
        "--l2-disk-eviction-policy)",
    )
    disk.add_argument(
        "--l2-disk-eviction-policy",
        choices=sorted(POLICIES),
        default=DEFAULTS.l2_disk_eviction_policy,
        help="which objects the disk tier evicts first (the policies of --eviction-policy)",
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
        help="a file holding a secret every node shares: values are authenticated with a "
        "keyed BLAKE3 tag derived from it, and values without a valid one are never loaded",
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
        "--stats-log-interval-s",
        type=positive_float,
        default=DEFAULTS.stats_log_interval_s,
        help="seconds between the INFO log lines of key counters (used space, lookups and hit "
        "ratio, stores, evictions, bad requests)",
    )
    parser.add_argument(
        "--curve-keys",
        metavar="DIR",
        default=DEFAULTS.curve_keys,
        help="authenticate clients with ZeroMQ CURVE: DIR is a folder written by kvshelf "
        "keygen; only clients whose public key is in DIR/clients are answered. Without it "
        "there is no authentication, and only a loopback --host is allowed",
    )
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=DEFAULTS.allow_unauthenticated,
        help="bind a non-loopback --host without --curve-keys: anyone who reaches the port "
        "can read and overwrite the cache",
    )
    parser.add_argument(
        "--metrics-port",
        type=parse_port,
        default=DEFAULTS.metrics_port,
        help="serve Prometheus /metrics and a /healthz endpoint on this TCP port, bound to "
        "--host (off unless given: a fixed default would collide between servers on one "
        "host, and the HTTP endpoint has no authentication)",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default=DEFAULTS.log_level,
        help="logging level",
    )
    parser.add_argument(
        "--max-pools",
        type=positive_int,
        default=DEFAULTS.max_pools,
        help="the most pools (model identity x KV layout x world size) at once; at the limit a "
        "new pool retires the least recently used idle one, and gets a LIMIT_EXCEEDED error "
        "only when every pool has leases or transfers in flight",
    )
    parser.add_argument(
        "--max-lease-units-per-pool",
        type=positive_int,
        default=DEFAULTS.max_lease_units_per_pool,
        help="the most lease units live in one pool: each uncommitted reservation counts 1 + "
        "its keys, each unreleased lock 1 + its pages (all ranks); a reservation or locking "
        "lookup beyond it gets a LIMIT_EXCEEDED error. The unit is the pool, not the client: a "
        "client's ZeroMQ identity changes whenever it reconnects",
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
        curve = config.check_security()
        config.check_host()
    except ConfigError as exc:
        print(f"kvshelf server: error: {exc}", file=sys.stderr)
        return 2
    return serve(config, curve)
