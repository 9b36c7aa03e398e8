"""Every metric kvshelf keeps, declared once: name, kind, unit and help text.

The server, the scheduler role, the worker role and the lazy offloader count through
:class:`Counters` made from these declarations, and everything that shows metrics derives from
them: ``kvshelf stats`` (the server's), vLLM's connector stats (:mod:`kvshelf.vllm.stats`: which
names are gauges) and Prometheus exporters. A new metric is one line here plus the code that
counts it.

Names are user-visible and stable: the server's are the ``kvshelf stats --json`` fields, the
connector's the keys of vLLM's KV connector stats. Counters end in ``_total`` on the server and
count events since start; gauges describe now.

No import of vLLM, torch or ZeroMQ: the server and every role import this module.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvshelf.metric_types import Kind, Metric, MetricGroup


def _counter(name: str, unit: str, help: str) -> Metric:
    return Metric(name, Kind.COUNTER, unit, help)


def _gauge(name: str, unit: str, help: str) -> Metric:
    return Metric(name, Kind.GAUGE, unit, help)


def _histogram(name: str, help: str, buckets: tuple[float, ...]) -> Metric:
    return Metric(name, Kind.HISTOGRAM, "seconds", help, buckets)


# Server request handling: a lookup of a few hundred blocks takes tens of microseconds.
_HANDLING_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1)
# A worker's copy of one store or one step's loads: from well under a millisecond to seconds.
_COPY_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 5.0)


SERVER = MetricGroup(
    "server",
    _gauge("resident_objects", "objects", "Committed pages held in the arena."),
    _gauge("resident_bytes", "bytes", "Bytes of the committed pages held in the arena."),
    _gauge("reserved_objects", "objects", "Pages reserved for stores and not committed yet."),
    _gauge("locked_objects", "objects", "Pages held by lookup locks (not evictable)."),
    _gauge("capacity_bytes", "bytes", "Size of the shared-memory arena."),
    _gauge("allocated_bytes", "bytes", "Arena bytes handed to pools as extents."),
    _gauge(
        "pools",
        "pools",
        "Pools held (model identity, layout and world size), retiring ones included.",
    ),
    _gauge("active_reservations", "reservations", "Store reservations not committed yet."),
    _gauge("active_locks", "locks", "Lookup locks not fully released yet."),
    _gauge("arena_zeroing", "flag", "1 while --prefault zeroes the arena in the background."),
    # The arena's bytes by use (crash recovery, docs/crash-recovery.md): these four and
    # resident_bytes add up to capacity_bytes.
    _gauge("l1_free_bytes", "bytes", "Arena bytes free: free pages and unallocated space."),
    _gauge("l1_reserved_bytes", "bytes", "Arena bytes of pages being written or filled."),
    _gauge(
        "l1_quarantined_bytes",
        "bytes",
        "Arena bytes of adopted pages a dead server's clients may still write (out of use).",
    ),
    _gauge("l1_gap_bytes", "bytes", "Arena bytes lost to extent alignment between pools."),
    _gauge(
        "quarantined_pages",
        "pages",
        "Adopted pages kept from eviction and reuse until the lease timeout after start.",
    ),
    _counter(
        "adopted_objects_total",
        "objects",
        "Committed pages adopted from a dead server's arena at start.",
    ),
    _counter("committed_objects_total", "objects", "Pages committed by stores."),
    _counter("reserved_objects_total", "objects", "Pages reserved for stores."),
    _counter("reservations_total", "reservations", "Store reservations made (one per store)."),
    _counter(
        "reserve_skipped_objects_total",
        "objects",
        "Keys a store asked to reserve that were present or being written already.",
    ),
    _counter(
        "reserve_no_space_objects_total",
        "objects",
        "Keys a store could not reserve because every page was locked or reserved.",
    ),
    _counter(
        "reserve_over_quota_objects_total",
        "objects",
        "Keys a store could not reserve because its tenant was at --tenant-quota and none of "
        "its own pages could be evicted for them (also in reserve_no_space_objects_total).",
    ),
    _counter(
        "tenant_share_refused_objects_total",
        "objects",
        "Pages a store or a fetch from below could not get by eviction: every evictable page "
        "was of a tenant at or under its soft share, while a larger tenant's pages were all "
        "reserved or locked (a store's keys also in reserve_no_space_objects_total).",
    ),
    _counter(
        "tenant_folded_objects_total",
        "objects",
        "Pages stored for tenants past the first MAX_TENANTS_PER_POOL (kvshelf.server.limits, "
        "256) holding pages of their pool: counted as one overflow tenant, with one soft share "
        "between them.",
    ),
    _counter("aborted_objects_total", "objects", "Reserved pages released by an abort."),
    _counter(
        "unwhole_dropped_objects_total",
        "objects",
        "Other ranks' pages of blocks a rank's reservation ended without writing (abort or "
        "lease end): freed, or freed at their commit, so that no block stays committed by some "
        "ranks only.",
    ),
    _counter("expired_reservations_total", "reservations", "Reservations whose lease ran out."),
    _counter("expired_locks_total", "locks", "Lookup locks whose lease ran out."),
    _counter(
        "expired_lookups_total",
        "lookups",
        "Lookups answered EXPIRED: the server reached them after their client's deadline.",
    ),
    _counter("lookup_requests_total", "requests", "Lookups answered."),
    _counter("lookup_hit_objects_total", "objects", "Pages found by lookups (all ranks)."),
    _counter(
        "loaded_objects_total",
        "objects",
        "Pages workers copied into vLLM (each rank's count, sent with its lock release).",
    ),
    _counter(
        "locked_objects_total",
        "objects",
        "Pages locked by lookups (all ranks), including hits vLLM then did not load.",
    ),
    # Why a request's first lookup stopped short of its blocks, by its first missing block;
    # the connector asks the server to count only a request's first lookup.
    _counter(
        "miss_never_stored_total",
        "lookups",
        "Lookups short of their blocks whose first missing block was never stored (or not "
        "committed yet), nor evicted recently.",
    ),
    _counter(
        "miss_evicted_total",
        "lookups",
        "Lookups short of their blocks whose first missing block was evicted (among the "
        "recently evicted keys the server remembers).",
    ),
    _counter(
        "miss_rank_incomplete_total",
        "lookups",
        "Lookups short of their blocks whose first missing block is stored for some ranks "
        "but not all.",
    ),
    _counter(
        "miss_tier_error_total",
        "lookups",
        "Lookups short of their blocks whose first missing block a tier below L1 holds but "
        "could not load.",
    ),
    _counter("evicted_objects_total", "objects", "Committed pages evicted to make room."),
    _counter(
        "reclaimed_extents_total",
        "extents",
        "Arena extents taken back from an idle or oversized pool for a pool below its share.",
    ),
    _counter(
        "rejected_over_limit_total",
        "requests",
        "Reservations and locking lookups refused: their pool's lease bound was reached.",
    ),
    _counter("requests_total", "requests", "Requests received, valid or not."),
    _counter("bad_requests_total", "requests", "Requests answered with an error."),
    # Operability (issue 14): the hit ratio's denominator, uptime, kvshelf clear.
    _counter(
        "lookup_requested_objects_total",
        "objects",
        "Pages lookups asked for (blocks x world size): lookup_hit_objects_total's denominator.",
    ),
    _gauge("uptime_seconds", "seconds", "Seconds since the server started (whole seconds)."),
    _gauge(
        "local_socket_clients",
        "clients",
        "Clients connected over the node-local socket (clients on this node move there after "
        "their first reply; 0 with --no-local-socket or where they cannot reach it, and they "
        "use ZMQ).",
    ),
    _counter(
        "gc_full_collections_total",
        "collections",
        "Full collections of Python's cyclic garbage collector in the server; each holds the "
        "socket loop for a time that grows with the pools' structures (rare: requests are "
        "answered with the collector off, and pages are not tracked by it).",
    ),
    _counter("cleared_objects_total", "objects", "Committed pages dropped by kvshelf clear."),
    _counter(
        "pools_retired_total",
        "pools",
        "Pools retired: replaced by a new identity epoch, idle and empty, or the least recently "
        "used idle pool at the limit of pools; their pages were freed.",
    ),
    _counter(
        "rejected_handshakes_total",
        "handshakes",
        "Connection handshakes refused by --curve-keys: no CURVE key, or a key not in the "
        "allow-list (a refused client retries, so one client counts many times); and "
        "connections to the node-local socket from another user than the server's or root.",
    ),
    # The disk tier (L2, --l2-disk-path); 0 without it.
    _gauge("l2_resident_objects", "objects", "Objects held by the disk tier."),
    _gauge("l2_resident_bytes", "bytes", "Disk space of the disk tier's objects (4 KiB blocks)."),
    _gauge("l2_capacity_bytes", "bytes", "The disk tier's budget (--l2-disk-size-gb)."),
    _counter("l2_stored_objects_total", "objects", "Objects written to the disk tier."),
    _counter("l2_hit_objects_total", "objects", "Objects read from the disk tier into L1."),
    _counter(
        "l2_corrupt_objects_total",
        "objects",
        "Disk objects that failed their checks (key, pool, length, checksum) and were removed.",
    ),
    _counter(
        "l2_dropped_writes_total",
        "objects",
        "Objects not written to disk: the write queue was full, no room, or the tier degraded.",
    ),
    _counter("l2_errors_total", "objects", "Disk reads and writes that failed (ENOSPC, EIO, ...)."),
    # The shared Redis tier (L3, --l3-redis-url); 0 without it.
    _gauge("l3_available", "bool", "1 while the Redis tier's breaker is closed (Redis answers)."),
    _counter("l3_stored_objects_total", "objects", "Objects written to Redis."),
    _counter("l3_hit_objects_total", "objects", "Objects fetched from Redis into L1."),
    _counter(
        "l3_dropped_writes_total",
        "objects",
        "Objects not written to Redis: the write queue was full, or Redis was down or slow.",
    ),
    _counter(
        "l3_corrupt_objects_total",
        "objects",
        "Redis values that failed their checks (key, pool, length, checksum, tag); not loaded.",
    ),
    _counter("l3_errors_total", "operations", "Redis operations (pipelines) that failed."),
    _gauge("l3_clearing", "bool", "1 while a kvshelf clear --shared deletes kvshelf's Redis keys."),
    _counter(
        "l3_cleared_objects_total", "objects", "kvshelf keys deleted from Redis by kvshelf clear."
    ),
    # The Redis tier's probe bound (issue 33, D4; kvshelf.server.limits.MAX_QUEUED_PROBES).
    _gauge(
        "l3_queued_probes",
        "probes",
        "Probes (EXISTS batches for keys other nodes may have written) queued or running.",
    ),
    _counter(
        "l3_skipped_probes_total",
        "probes",
        "Probes not sent because MAX_QUEUED_PROBES were queued: their keys missed.",
    ),
)

SERVER_TIMINGS = MetricGroup(
    "server timings",
    _histogram(
        "lookup_duration_seconds",
        "Time the server took to handle a lookup and lock its hit (a deferred one: to start "
        "its fetch).",
        _HANDLING_BUCKETS,
    ),
    _histogram(
        "reserve_duration_seconds",
        "Time the server took to handle a reserve (pages for a store, evictions included).",
        _HANDLING_BUCKETS,
    ),
    _histogram(
        "commit_duration_seconds",
        "Time the server took to handle a commit (or an abort) of a reservation.",
        _HANDLING_BUCKETS,
    ),
    _histogram(
        "release_duration_seconds",
        "Time the server took to handle a release of a rank's share of a lookup lock.",
        _HANDLING_BUCKETS,
    ),
)
"""The server's latency histograms: in ``/metrics``, not in ``kvshelf stats``."""

SERVER_POOLS = MetricGroup(
    "server pools",
    Metric(
        "pool_resident_objects",
        Kind.GAUGE,
        "objects",
        "Committed pages held in the arena, per pool (the first 64 pools by name; the rest "
        'summed under pool="other").',
        labels=("pool",),
    ),
)
"""The server's per-pool gauges: in ``/metrics``, labelled by pool name."""

# Tenants with a label of their own in /metrics (the first seen); the rest share "other".
MAX_TENANT_LABELS = 16

SERVER_TENANTS = MetricGroup(
    "server tenants",
    Metric(
        "tenant_bytes",
        Kind.GAUGE,
        "bytes",
        "L1 bytes of the pages a tenant stored (committed or being written), all pools "
        f"together; the first {MAX_TENANT_LABELS} tenants seen have a label each, the rest are "
        "summed under "
        'tenant="other"; tenant="none" is requests that name none and pages loaded from '
        "below L1.",
        labels=("tenant",),
    ),
    Metric(
        "tenant_hit_objects_total",
        Kind.COUNTER,
        "objects",
        "Blocks that a tenant's lookups found in L1 (labels as tenant_bytes).",
        labels=("tenant",),
    ),
)
"""The server's per-tenant series (:mod:`kvshelf.server.tenants`): in ``/metrics``."""

SCHEDULER = MetricGroup(
    "scheduler",
    _counter("lookups", "lookups", "Lookups sent to the server."),
    _counter(
        "lookups_deferred",
        "asks",
        "Times vLLM was told to ask again because a lookup's reply had not arrived.",
    ),
    _counter("lookup_failures", "lookups", "Lookups that failed (server unavailable or error)."),
    _counter("lookup_hit_blocks", "blocks", "Blocks found by lookups."),
    # Why a request missed, counted once per request (by its first answered or failed
    # lookup): the server's reason from the reply, or the connector's own.
    _counter(
        "miss_never_stored",
        "requests",
        "Requests short of their blocks: the first missing block was never stored.",
    ),
    _counter(
        "miss_evicted",
        "requests",
        "Requests short of their blocks: the first missing block was evicted.",
    ),
    _counter(
        "miss_rank_incomplete",
        "requests",
        "Requests short of their blocks: the first missing block is stored for some ranks only.",
    ),
    _counter(
        "miss_tier_error",
        "requests",
        "Requests short of their blocks: a tier below L1 could not load the first missing block.",
    ),
    _counter(
        "miss_server_unavailable",
        "requests",
        "Requests computed without kvshelf: the server was unavailable or failed the lookup.",
    ),
    _counter(
        "miss_lookup_too_late",
        "requests",
        "Requests computed without kvshelf: their lookup's reply had not come when the client's "
        "timeout ran out or the request ended.",
    ),
    _counter("loads_planned", "loads", "Loads handed to the workers."),
    _counter(
        "hit_tokens",
        "tokens",
        "Tokens vLLM took from kvshelf: the hits of the loads handed to the workers.",
    ),
    _counter("blocks_load_planned", "blocks", "Blocks of the loads handed to the workers."),
    _counter("stores_submitted", "stores", "Store jobs handed to the workers."),
    _counter("blocks_store_submitted", "blocks", "Blocks of the store jobs handed to workers."),
    _counter("stores_completed", "stores", "Store jobs every worker reported finished."),
    _gauge(
        "inflight_store_requests",
        "requests",
        "Requests with store jobs not yet reported finished by every worker.",
    ),
)

LAZY = MetricGroup(
    "lazy",
    _gauge("buffered_requests", "requests", "Requests with buffered store work, finished or not."),
    _gauge("ready_requests", "requests", "Finished requests with buffered store work."),
    _counter("drains", "drains", "Triggers that selected at least one request."),
    _counter(
        "requests_submitted", "requests", "Selected requests with at least one store submitted."
    ),
    _counter(
        "requests_skipped_hash_mismatch",
        "requests",
        "Selected requests whose buffered store work was dropped: vLLM had reused a block.",
    ),
    _counter("blocks_submitted", "blocks", "Blocks of the stores lazy offload submitted."),
    _counter(
        "lazy_blocks_stored",
        "blocks",
        "Blocks of lazy offload's stores that every worker reported finished.",
    ),
    _gauge("blocks_protected", "blocks", "Blocks held back from vLLM for stores in flight."),
    _gauge(
        "blocks_captured",
        "blocks",
        "Window-group blocks lazy offload holds until vLLM frees them (kvshelf.lazy.window_watch).",
    ),
    _counter(
        "requests_flushed",
        "requests",
        "Requests selected by the bounded-delay flush rather than the policy.",
    ),
    _counter(
        "blocks_trimmed", "blocks", "Blocks dropped after a hash mismatch by a trimming policy."
    ),
)

WORKER = MetricGroup(
    "worker",
    _counter("blocks_stored", "blocks", "Blocks this worker copied into the cache."),
    _counter(
        "blocks_store_skipped",
        "blocks",
        "Blocks of store jobs the server already held or was writing.",
    ),
    _counter("bytes_stored", "bytes", "Bytes this worker copied into the cache."),
    _counter("stores_dropped", "stores", "Store jobs dropped (server unavailable or full)."),
    _counter(
        "registrations_refused",
        "registrations",
        "Registrations the server refused (limit of pools, layout mismatch, page size): stores "
        "are dropped until one is accepted; logged once per pool and cause as a WARNING.",
    ),
    _counter("blocks_loaded", "blocks", "Blocks this worker copied from the cache."),
    _counter("bytes_loaded", "bytes", "Bytes this worker copied from the cache."),
    _counter("blocks_load_failed", "blocks", "Blocks whose load failed; vLLM recomputed them."),
    _counter(
        "store_reuse_waits",
        "steps",
        "Steps that reused a block a queued store still read (vLLM freed it: a window slid "
        "past it, a preemption); the step was ordered after that store's copy.",
    ),
)

WORKER_TIMINGS = MetricGroup(
    "worker timings",
    _histogram(
        "load_seconds",
        "Time a worker's load thread took to copy one step's loads from the cache (layers the "
        "forward pass copied itself overlap it).",
        _COPY_BUCKETS,
    ),
    _histogram(
        "store_seconds",
        "Time a worker took for one store job: reserve, copy into the cache and commit.",
        _COPY_BUCKETS,
    ),
)
"""The workers' latency histograms: observations travel in vLLM's connector stats."""

CONNECTOR_GROUPS = (SCHEDULER, LAZY, WORKER, WORKER_TIMINGS)
"""The groups in vLLM's connector stats: the scheduler role's (with lazy offload's) and the
workers' (counters and timings). vLLM merges scheduler and worker stats by name, so their
names never overlap."""

ALL_GROUPS = (
    SERVER,
    SERVER_TIMINGS,
    SERVER_POOLS,
    SERVER_TENANTS,
    SCHEDULER,
    LAZY,
    WORKER,
    WORKER_TIMINGS,
)
"""Every group, for the metrics reference (``docs/metrics.md``)."""


def gauge_names(groups: tuple[MetricGroup, ...]) -> frozenset[str]:
    """The names of the gauges in ``groups``."""
    return frozenset(name for group in groups for name in group.names(Kind.GAUGE))


def undeclared(values: Mapping[str, object], groups: tuple[MetricGroup, ...]) -> set[str]:
    """Names in ``values`` that no group in ``groups`` declares (for tests)."""
    return {name for name in values if not any(name in group for group in groups)}
