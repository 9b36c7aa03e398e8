"""The server application: build everything from a :class:`ServerConfig`, serve until a stop signal
(SIGTERM, SIGINT, SIGHUP or SIGQUIT), tear down.

:func:`build_tiers` is the one place that turns the configuration into storage tiers; a new
tier is wired there and nowhere else (the index, the handler and the socket loop take whatever
list it returns). Must not import torch or vLLM.
"""

from __future__ import annotations

import gc
import logging
import secrets
import signal
import time

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvshelf.curve import ServerCurve
from kvshelf.platform.shm import arena_name
from kvshelf.protocol import local_socket_name
from kvshelf.server.adoption import open_arena, rebuild
from kvshelf.server.completions import Completions
from kvshelf.server.config import GIB, ServerConfig
from kvshelf.server.handler import RequestHandler
from kvshelf.server.index import CacheIndex
from kvshelf.server.local_socket import LocalListener
from kvshelf.server.loop import ServerLoop
from kvshelf.server.policy import POLICIES
from kvshelf.server.prometheus import MetricsServer, ServerCollector
from kvshelf.server.stats_log import StatsLog
from kvshelf.server.tenants import Tenants
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.base import Tier
from kvshelf.server.tiers.disk import DiskTier
from kvshelf.server.tiers.shared_memory import ExtentAllocator, SharedMemoryArena

logger = logging.getLogger("kvshelf.server")

# Each ends the server the same clean way: a log line, the socket closed, the arena unlinked
# (or kept, with --keep-arena-on-exit).
# SIGHUP (a closed terminal or a supervisor's reload) and SIGQUIT would otherwise kill it and
# leave the whole arena in /dev/shm.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

# Disk write jobs are taken while fewer bytes than this are queued or running: the write-behind
# window is about this over the disk's write bandwidth (see kvshelf.server.tiers.disk).
DISK_WRITE_QUEUE_BYTES = 256 * 1024 * 1024

# The most bytes of Redis writes queued or being sent; beyond it writes are dropped.
REDIS_WRITE_QUEUE_BYTES = 128 * 1024 * 1024


def build_tiers(
    config: ServerConfig, memory: SharedMemoryArena, tenants: Tenants | None = None
) -> list[Tier]:
    """The storage tiers the configuration asks for: the arena (L1) first, fastest first.

    Args:
        config: the server's configuration.
        memory: the arena's shared-memory object, already created.
        tenants: the per-tenant quota and metrics of L1 (:mod:`kvshelf.server.tenants`).
    """
    arena = ArenaTier(
        ExtentAllocator(memory.size_bytes),
        eviction_watermark=config.eviction_watermark,
        eviction_policy=config.l1_policy,
        tenants=tenants,
        memory=memory,
        table=memory.table(),
    )
    tiers: list[Tier] = [arena]
    if config.l2_disk_path is not None:
        tiers.append(
            DiskTier(
                config.l2_disk_path,
                config.l2_disk_bytes,
                arena.counters,
                # Writes queued pin their L1 pages: at most a quarter of the arena.
                queue_bytes=min(DISK_WRITE_QUEUE_BYTES, config.arena_bytes // 4),
                policy=POLICIES[config.l2_disk_eviction_policy](),
            )
        )
    if config.l3_redis_url is not None:
        # Imported here: the redis package is needed only with a Redis tier.
        from kvshelf.server.tiers.redis_link import RedisLink
        from kvshelf.server.tiers.redis_tier import RedisTier

        tiers.append(
            RedisTier(
                RedisLink(config.l3_redis_url),
                arena.counters,
                queue_bytes=min(REDIS_WRITE_QUEUE_BYTES, config.arena_bytes // 4),
                secret=config.l3_secret(),
                ttl_s=config.l3_ttl_s,
            )
        )
    return tiers


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


def _start_authenticator(
    context: zmq.Context, curve: ServerCurve | None
) -> ThreadAuthenticator | None:
    """Start ZeroMQ's ZAP handler for ``context``: only the allow-list's client keys pass."""
    if curve is None:
        return None
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve(domain="*", location=str(curve.allowed_clients))
    logger.info(
        "CURVE authentication on: %d allowed client keys in %s",
        curve.allowed_count(),
        curve.allowed_clients,
    )
    return authenticator


def _start_metrics(
    config: ServerConfig, handler: RequestHandler, index: CacheIndex, loop: ServerLoop
) -> MetricsServer | bool | None:
    """Start /metrics and /healthz when --metrics-port is given.

    Returns:
        The endpoint, None when not asked for, False when its port cannot be bound (logged).
    """
    if config.metrics_port is None:
        return None
    collector = ServerCollector(
        handler.stats, handler.timings, index.pool_objects, handler.tenant_metrics
    )
    try:
        metrics = MetricsServer(config.host, config.metrics_port, collector, lambda: loop.heartbeat)
    except OSError as exc:
        logger.error(
            "cannot bind --metrics-port %d on %s: %s", config.metrics_port, config.host, exc
        )
        return False
    logger.info(
        "Prometheus metrics on http://%s:%d/metrics, health on /healthz",
        f"[{config.host}]" if ":" in config.host else config.host,
        metrics.port,
    )
    return metrics


def _start_local_socket(
    config: ServerConfig, handler: RequestHandler, index: CacheIndex, boot_id: str
) -> LocalListener | None:
    """Bind the node-local socket, or None (``--no-local-socket``, or it cannot be bound:
    clients then use ZMQ, so the server serves on, with a warning)."""
    if not config.local_socket:
        return None
    name = local_socket_name(config.port, boot_id)
    try:
        local = LocalListener(
            name,
            handler.handle,
            handler.error_frame,
            lambda: index.counters.add("rejected_handshakes_total"),
        )
    except OSError as exc:
        logger.warning("no node-local socket (clients use ZMQ): cannot bind @%s: %s", name, exc)
        return None
    handler.serve_locally(name, lambda: local.connections)
    logger.info("node-local clients served on the abstract Unix socket @%s", name)
    return local


def serve(config: ServerConfig, curve: ServerCurve | None = None) -> int:
    """Create the arena and the tiers, bind the socket and serve until a stop signal.

    Args:
        config: the checked configuration.
        curve: the keys of ``config.curve_keys`` (:meth:`ServerConfig.check_security`); None
            serves without authentication.

    Returns:
        0 after a clean shutdown, 1 when the arena or the socket cannot be set up.
    """
    if curve is None and not config.loopback:
        logger.warning(
            "BINDING NON-LOOPBACK ADDRESS %s WITHOUT AUTHENTICATION (--allow-unauthenticated): "
            "any host that can reach this port can read and overwrite cache metadata",
            config.host,
        )
    stop_requested = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True
        logger.info("received %s, shutting down", signal.Signals(signum).name)

    for signum in STOP_SIGNALS:
        signal.signal(signum, request_stop)

    boot_id = secrets.token_hex(8)
    endpoint = config.endpoint
    try:
        memory, adopted = open_arena(
            config.port,
            arena_name(config.port, boot_id),
            config.arena_bytes,
            config.max_pools,
            adopt=config.adopt,
        )
    except OSError as exc:
        logger.error("cannot create the shared-memory arena: %s", exc)
        return 1
    memory.keep_on_close = config.keep_arena_on_exit
    if config.prefault and not _prefault(memory):
        memory.close()
        return 1
    tenants = Tenants(config.tenant_quota)
    try:
        tiers = build_tiers(config, memory, tenants)
    except OSError as exc:
        logger.error("cannot set up the storage tiers: %s", exc)
        memory.close()
        return 1
    if adopted is not None:
        assert isinstance(tiers[0], ArenaTier)
        # The dead server's workers may use its leases for up to a lease timeout.
        rebuild(tiers[0], adopted, time.monotonic() + config.lease_timeout_s)
    context = zmq.Context()
    authenticator = _start_authenticator(context, curve)
    completions = Completions()
    # Adopted pages first: tiers below L1 restore what they hold here, before the socket is
    # bound, and keep a key L1 holds as their own copy only (one entry per key).
    index = CacheIndex(
        tiers,
        lease_timeout_s=config.lease_timeout_s,
        completions=completions,
        limits=config.limits,
        pools=adopted.pools if adopted is not None else (),
    )
    local: LocalListener | None = None
    try:
        try:
            handler = RequestHandler(index, memory, boot_id, tenants=tenants.ledger)
            stats_log = StatsLog(config.stats_log_interval_s, handler.stats, time.monotonic())
            local = _start_local_socket(config, handler, index, boot_id)
            loop = ServerLoop(
                handler, index, endpoint, context, completions, stats_log.tick, curve, local
            )
        except zmq.ZMQError as exc:
            logger.error("cannot bind %s: %s", endpoint, exc)
            if local is not None:
                local.close()
            # An adopted arena stays for the next server on the port (this one never served).
            memory.keep_on_close |= adopted is not None
            return 1
        metrics = _start_metrics(config, handler, index, loop)
        if metrics is False:
            loop.close()
            return 1
        logger.info(
            "kvshelf server listening on %s (arena %s, %.3f GiB, boot id %s, "
            "lease %.1f s, watermark %.2f, eviction %s%s)",
            endpoint,
            memory.path,
            config.arena_bytes / GIB,
            boot_id,
            config.lease_timeout_s,
            config.eviction_watermark,
            config.l1_policy,
            ""
            if config.l2_disk_path is None
            else f", disk eviction {config.l2_disk_eviction_policy}",
        )
        # What start-up built (modules, the tiers, adopted pages) lives as long as the server:
        # keep it out of the cyclic collector's full collections, which walk every tracked
        # object while the loop waits.
        gc.freeze()
        try:
            loop.run(lambda: stop_requested)
        finally:
            if metrics is not None:
                metrics.close()
            loop.close()
    finally:
        # Tiers first: their threads post completions and view the arena until they stop.
        index.close()
        completions.close()
        if authenticator is not None:
            authenticator.stop()
        context.term()
        memory.close()
    if config.keep_arena_on_exit:
        logger.info("kept the arena %s for the next server on port %d", memory.path, config.port)
    logger.info("kvshelf server stopped")
    return 0
