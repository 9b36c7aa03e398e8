"""The shared tier (L3): objects in a Redis or Valkey server, or a Redis Cluster, that every
node's kvshelf server writes and reads.

- **Writes** (behind every commit): ``prepare_store`` queues the committed pages as one job on
  the I/O threads and returns; the job sends them as ``SET`` commands (with ``PX`` when a TTL
  is set), each value's header, L1 page and tag given to one scatter-gather send, never joined
  (:func:`~kvshelf.server.tiers.redis_stream.set_each`). A job is queued whole while the jobs
  queued or being sent hold less than ``queue_bytes`` (their L1 pages stay pinned until sent);
  one that comes when they hold more, or while the breaker is open, is dropped and counted
  (``l3_dropped_writes_total``).
- **Discovery**: the index does not know what other nodes wrote, so a lookup asks this tier
  about the keys after the prefix the index knows (:meth:`RedisTier.prepare_probe`: one
  batch of ``EXISTS`` on an I/O thread); the keys found become STORED entries of this tier
  and are loaded like any other. At most :data:`~kvshelf.server.limits.MAX_QUEUED_PROBES`
  probes are queued or running (``l3_queued_probes``); one more is answered "not found" at
  once, a miss for its lookup (``l3_skipped_probes_total``).
- **Reads**: ``prepare_load`` sends a load's ``GET`` commands at once, split over the I/O
  threads, and receives each value's payload straight into its FILLING L1 page, hashed as it
  lands, checking its header before and its checksum or tag after
  (:mod:`~kvshelf.server.tiers.redis_stream`, :mod:`~kvshelf.server.tiers.redis_format`). A
  value that fails a check is a miss, counted in ``l3_corrupt_objects_total`` and logged (the
  first one, then at most one line per :data:`CORRUPT_LOG_INTERVAL_S` with how many came
  since); a value that went (evicted, expired, Redis restarted) is a plain miss. Either way
  the key is forgotten.
- **L1 eviction** keeps nothing: :meth:`holds` is None, and a later lookup asks Redis again.
- **Deadlines**: every operation (a probe's, a load part's or a write's batch of commands, a
  shared clear's SCAN step or UNLINK batch) has one deadline, ``timeout_s`` (1 s) plus 1 s per
  :data:`DEADLINE_BYTES_PER_S` it moves, and every send and receive gets only the time left;
  past it the operation fails with
  ``TimeoutError`` like any fault. A Redis that answers a byte at a time, or not at all,
  thus opens the breaker within the deadline, and the lookups waiting on it miss.
- **Stop**: :meth:`RedisTier.close` returns within :data:`STOP_WITHIN_S` plus 1 s for the
  link's monitor: I/O in progress or queued ends by then (past it, queued jobs finish without
  I/O: probes find nothing, loads miss, writes are dropped).
- **Faults**: any failed operation opens the breaker (:class:`RedisLink`): the tier then
  discovers nothing, loads nothing and drops writes, so the server serves its local tiers only;
  it closes by itself once Redis answers a ping. Failed operations count in ``l3_errors_total``.
  A load's reply that is not a value, a nil or a redirect (an error reply such as
  ``WRONGTYPE``, bytes that are not RESP) fails that load only: its connection is closed, the
  values not read yet are misses, and the breaker stays closed.

Everything but the I/O runs on the socket loop; the I/O threads only talk to Redis and fill the
jobs' results. Must not import torch or vLLM.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import Any

from kvshelf.metric_types import Counters
from kvshelf.server.limits import MAX_QUEUED_PROBES
from kvshelf.server.pool import Entry
from kvshelf.server.tiers.base import Tier, TierIndex, TierLoad, TierProbe, TierStore
from kvshelf.server.tiers.disk_io import IOThreads, LogRate
from kvshelf.server.tiers.redis_format import KEY_PATTERN, CorruptValue, ValueCodec, object_key
from kvshelf.server.tiers.redis_link import FAULTS, RedisLink
from kvshelf.server.tiers.redis_resp import FramingError, ReplyReader
from kvshelf.server.tiers.redis_stream import (
    exists_each,
    get_each,
    scan_step,
    set_each,
    unlink_each,
)

logger = logging.getLogger("kvshelf.server.redis")

IO_THREADS = 2
# Keys asked of each SCAN step of a shared clear (its COUNT; the keys it finds are deleted in
# one UNLINK batch).
CLEAR_BATCH = 1000
# An operation's deadline is the link's timeout plus 1 s per this many bytes it moves: a link
# slower than this (about half a gigabit per second) counts as a slow Redis.
DEADLINE_BYTES_PER_S = 64 * 1024 * 1024
# The longest the tier's I/O goes on after close() is called.
STOP_WITHIN_S = 2.0
# The shortest time between two log lines about corrupt values (the metric counts every one).
CORRUPT_LOG_INTERVAL_S = 60.0

# Outcomes of one object's fetch.
_OK, _MISSING, _CORRUPT, _FAILED = 0, 1, 2, 3


class _Stopping(Exception):
    """The server stops: a clear ends early."""


class _Write:
    """A store's write job: the keys and views to send; ``sent`` set by the I/O thread."""

    __slots__ = ("bytes", "hashes", "sent", "store", "views")

    def __init__(self, store: TierStore) -> None:
        self.store = store
        self.hashes: list[bytes] = []
        self.views: list[memoryview] = []
        self.bytes = 0
        self.sent: bool | None = None  # None: not tried (breaker open)


class _Read:
    """A load's read job, fetched in ``parts`` pipelines on as many I/O threads; the last part
    to finish finishes the load."""

    __slots__ = ("load", "lock", "parts_left", "results")

    def __init__(self, load: TierLoad, parts: int) -> None:
        self.load = load
        self.results = [_FAILED] * len(load.entries)
        self.parts_left = parts
        self.lock = threading.Lock()

    def part_done(self) -> bool:
        """Count one part as finished; True for the last one."""
        with self.lock:
            self.parts_left -= 1
            return self.parts_left == 0


class RedisTier(Tier):
    """Objects in Redis under versioned keys, shared by every node that uses the same Redis.

    Args:
        link: the connection and its breaker.
        counters: the server's counters.
        queue_bytes: the most bytes of writes queued or being sent at once.
        secret: the secret that keys the values' tags (``--l3-secret-file``); None: checksums
            only.
        ttl_s: the keys' time to live in seconds; None: kept until Redis evicts them.
        io_threads: how many I/O threads.
    """

    name = "redis"

    def __init__(
        self,
        link: RedisLink,
        counters: Counters,
        *,
        queue_bytes: int,
        secret: bytes | None = None,
        ttl_s: float | None = None,
        io_threads: int = IO_THREADS,
    ) -> None:
        assert queue_bytes > 0
        self._link = link
        self.counters = counters
        self._queue_bytes = queue_bytes
        self._codec = ValueCodec(secret)
        # Redis's EX takes whole seconds; PX milliseconds.
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._index: TierIndex | None = None
        self._queued = 0
        self._writes: dict[TierStore, _Write] = {}
        self._reads: dict[TierLoad, _Read] = {}
        # Probes whose EXISTS failed (added by the I/O threads, taken by the loop).
        self._failed_probes: set[TierProbe] = set()
        # Probes queued or running (the loop's), at most MAX_QUEUED_PROBES.
        self._probing: set[TierProbe] = set()
        # No I/O after this time (set by close()).
        self._stop_by = float("inf")
        # Corrupt values are all counted, but logged at most once per interval.
        self._corrupt_log = LogRate(CORRUPT_LOG_INTERVAL_S)
        # Shared clears running, and keys they deleted (I/O threads and the loop, locked).
        self._clear_lock = threading.Lock()
        self._clearing = 0
        self._cleared = 0
        self._io = IOThreads(io_threads, "kvshelf-redis")

    # Tier verbs.

    def attach(self, index: TierIndex) -> None:
        self._index = index

    def discovers(self) -> bool:
        return self._link.available

    def lookup(self, entry: Entry) -> bool:
        return self._link.available

    def prepare_probe(self, probe: TierProbe) -> None:
        if len(self._probing) >= MAX_QUEUED_PROBES:
            # Redis is behind: asking it more would only queue (and keep) more keys.
            self.counters.add("l3_skipped_probes_total")
            probe.finish([None] * len(probe.keys))
            return
        self._probing.add(probe)
        self._io.read(partial(self._probe, probe))

    def complete_probe(self, probe: TierProbe) -> None:
        self._probing.discard(probe)
        if probe in self._failed_probes:
            self._failed_probes.discard(probe)
            self.counters.add("l3_errors_total")

    def prepare_store(self, store: TierStore) -> None:
        pool = store.pool
        job = _Write(store)
        # A job is taken whole while the queue is below its bound: one large commit (a long
        # prompt of a large model) is never cut in half.
        if not self._link.available or self._queued >= self._queue_bytes:
            self.counters.add("l3_dropped_writes_total", len(store.block_hashes))
            store.finish()
            return
        job.hashes = list(store.block_hashes)
        job.views = list(store.views)
        job.bytes = sum(self._codec.value_bytes(pool.name, h, pool.page_bytes) for h in job.hashes)
        self._queued += job.bytes
        self._writes[store] = job
        self._io.write(partial(self._write, job))

    def complete_store(self, store: TierStore) -> None:
        job = self._writes.pop(store, None)
        if job is None:  # dropped whole in prepare_store
            return
        self._queued -= job.bytes
        if job.sent:
            self.counters.add("l3_stored_objects_total", len(job.hashes))
            return
        self.counters.add("l3_dropped_writes_total", len(job.hashes))
        if job.sent is False:
            self.counters.add("l3_errors_total")

    def prepare_load(self, load: TierLoad) -> None:
        # One stream of GETs per I/O thread, on connections of their own, so that one thread
        # parses a value while Redis sends the next one to the other. Measured with
        # pipelines (loopback, 4 MiB values: 1.1-1.15x the bytes per second with two); with
        # streams, one part against two was within this machine's noise, in an engine too.
        parts = max(1, min(self._io.count, len(load.entries)))
        job = _Read(load, parts)
        self._reads[load] = job
        for part in range(parts):
            self._io.read(partial(self._read, job, range(part, len(load.entries), parts)))

    def complete_load(self, load: TierLoad) -> None:
        job = self._reads.pop(load)
        failed = False
        for entry, result in zip(load.entries, job.results, strict=True):
            if result == _OK:
                self.counters.add("l3_hit_objects_total")
                continue
            if result == _CORRUPT:
                self.counters.add("l3_corrupt_objects_total")
            failed = failed or result == _FAILED
            assert self._index is not None
            self._index.remove_stored(load.pool.name, entry.rank, entry.block_hash, self)
        if failed:
            self.counters.add("l3_errors_total")

    def clear_shared(self) -> bool:
        if not self._link.available:
            return False
        with self._clear_lock:
            self._clearing += 1
        self._io.write(self._clear)
        return True

    def stats(self) -> dict[str, int]:
        with self._clear_lock:
            clearing, cleared = self._clearing, self._cleared
        return {
            "l3_available": int(self._link.available),
            "l3_clearing": int(clearing > 0),
            "l3_cleared_objects_total": cleared,
            "l3_queued_probes": len(self._probing),
        }

    def close(self) -> None:
        # Every job finishes: those running end their I/O by the stop time, those never
        # started run here (with I/O only while time is left).
        self._stop_by = time.monotonic() + STOP_WITHIN_S
        for task in self._io.stop(STOP_WITHIN_S):
            task()
        self._link.close()

    # The I/O threads' side.

    def _client(self) -> Any | None:
        """The client while the breaker is closed and the tier is not stopping, else None."""
        return None if time.monotonic() >= self._stop_by else self._link.client()

    def _deadline(self, nbytes: int) -> float:
        """When an operation moving ``nbytes`` bytes must be over."""
        allowed = self._link.timeout_s + nbytes / DEADLINE_BYTES_PER_S
        return min(time.monotonic() + allowed, self._stop_by)

    def _probe(self, probe: TierProbe) -> None:
        found: list[Any | None] = [None] * len(probe.keys)
        client = self._client()
        if client is not None:
            name = probe.pool.name
            keys = [object_key(name, rank, block_hash) for rank, block_hash in probe.keys]
            try:
                exists = exists_each(client, self._link.cluster, keys, deadline=self._deadline(0))
                found = [key if hit else None for key, hit in zip(keys, exists, strict=True)]
            except (*FAULTS, FramingError) as exc:
                self._failed_probes.add(probe)
                self._link.failed("EXISTS", exc)
        probe.finish(found)

    def _write(self, job: _Write) -> None:
        client = self._client()
        if client is not None:
            pool = job.store.pool
            rank = job.store.rank
            items = []
            for block_hash, view in zip(job.hashes, job.views, strict=True):
                head, tag = self._codec.encode(pool.name, rank, block_hash, view)
                items.append((object_key(pool.name, rank, block_hash), (head, view, tag)))
            try:
                deadline = self._deadline(job.bytes)
                set_each(client, self._link.cluster, items, self._ttl_ms, deadline=deadline)
                job.sent = True
            except (*FAULTS, FramingError) as exc:
                job.sent = False
                self._link.failed("SET", exc)
        job.store.finish()

    def _clear(self) -> None:
        """Delete every kvshelf key (every master of a cluster), a SCAN step and an UNLINK
        batch at a time, each with an operation's deadline (a slow Redis fails the clear and
        opens the breaker, as any operation does). Writes queued before the clear may land
        after it: they are objects committed before it."""
        deleted = 0
        client = self._client()
        try:
            if client is not None:
                cluster = self._link.cluster
                nodes = (
                    [
                        client.get_redis_connection(node).connection_pool
                        for node in client.get_primaries()
                    ]
                    if cluster
                    else [client.connection_pool]
                )
                for node in nodes:
                    cursor = 0
                    while True:
                        if time.monotonic() >= self._stop_by:
                            raise _Stopping
                        deadline = self._deadline(0)
                        cursor, keys = scan_step(
                            node, cursor, KEY_PATTERN, CLEAR_BATCH, deadline=deadline
                        )
                        if keys:
                            deadline = self._deadline(0)
                            deleted += unlink_each(client, cluster, keys, deadline=deadline)
                        if cursor == 0:
                            break
            logger.info("Redis tier: kvshelf clear --shared deleted %d kvshelf keys", deleted)
        except _Stopping:
            logger.warning(
                "Redis tier: kvshelf clear --shared stopped after %d keys: the server stops",
                deleted,
            )
        except (*FAULTS, FramingError) as exc:
            self._link.failed("SCAN/UNLINK", exc)
            logger.warning(
                "Redis tier: kvshelf clear --shared stopped after %d keys: %s", deleted, exc
            )
        finally:
            with self._clear_lock:
                self._clearing -= 1
                self._cleared += deleted

    def _corrupt(self, location: bytes, exc: CorruptValue) -> None:
        """Log a corrupt value, rate-limited (the counter counts every one); from any thread."""
        quiet = self._corrupt_log.due()
        if quiet is None:
            return
        logger.warning(
            "Redis tier: %s: %s; not loaded%s",
            location.decode(),
            exc,
            f" ({quiet} more corrupt values since the last report)" if quiet else "",
        )

    def _read(self, job: _Read, part: range) -> None:
        """Fetch the values of entries ``part`` of a load into its pages."""
        load = job.load
        name = load.pool.name

        def receive(index: int, reader: ReplyReader, size: int) -> None:
            i = part[index]
            entry = load.entries[i]
            try:
                self._codec.receive_into(
                    reader, size, name, entry.rank, entry.block_hash, load.views[i]
                )
                job.results[i] = _OK
            except CorruptValue as exc:
                self._corrupt(entry.location, exc)
                job.results[i] = _CORRUPT

        def take(index: int, value: bytes | None) -> None:
            i = part[index]
            entry = load.entries[i]
            if value is None:
                job.results[i] = _MISSING
                return
            try:
                self._codec.decode_into(value, name, entry.rank, entry.block_hash, load.views[i])
                job.results[i] = _OK
            except CorruptValue as exc:
                self._corrupt(entry.location, exc)
                job.results[i] = _CORRUPT

        client = self._client()
        if client is not None:
            keys = [load.entries[i].location for i in part]
            deadline = self._deadline(len(keys) * load.pool.page_bytes)
            try:
                get_each(client, self._link.cluster, keys, receive, take, deadline=deadline)
            except FramingError as exc:
                # Redis answered, but not with values: this load fails (the entries not read
                # stay _FAILED), its connection is closed, and the tier stays available.
                logger.warning("Redis tier: a load's GETs failed: %s; connection closed", exc)
            except FAULTS as exc:  # the entries not taken stay _FAILED
                self._link.failed("GET", exc)
        if job.part_done():
            load.finish([result == _OK for result in job.results])
