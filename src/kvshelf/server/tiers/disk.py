"""The local disk tier (L2): a bounded, restart-safe, integrity-checked copy of L1 on disk.

- **Writes** (behind every commit): ``prepare_store`` turns the committed pages into a write job
  on the I/O threads (:class:`~kvshelf.server.tiers.disk_io.IOThreads`) and returns; it never
  delays a commit. A job is taken while the jobs queued and running hold less than
  ``queue_bytes`` (their L1 pages stay pinned until written); one that comes above that, or while
  the tier is degraded, is dropped and counted (``l2_dropped_writes_total``). The window: while
  the disk keeps up, an object is on disk (under its final name) once its job ran, i.e. within
  (``queue_bytes`` + one commit) / the disk's write bandwidth after its commit, so a crash loses at
  most the objects committed within that window; dropped writes are the stated exception. Files
  are not fsynced: after a crash of the whole machine, the kernel's writeback delay
  (``vm.dirty_expire_centisecs``, 30 s by default) adds to the window, and torn files fail their
  checksum.
- **Reads**: ``prepare_load`` reads each object into its FILLING L1 page on the I/O threads
  (reads go before writes) and checks key, pool, length and checksum
  (:mod:`~kvshelf.server.tiers.disk_format`). A bad object is a miss: counted in
  ``l2_corrupt_objects_total``, its file removed, its key forgotten.
- **Budget**: the objects' files (counted in whole 4 KiB blocks) never exceed the capacity: a
  write first evicts objects (their files are removed by the same job before it writes), and is
  dropped if objects being read or written leave no room.
- **Which objects go**: the server's eviction policy (``--eviction-policy``, one instance for
  the whole tier, :mod:`kvshelf.server.policy`) orders the objects written and not being read:
  an object is added once written, used when a lookup reads it or a store writes its key again,
  pinned while read; a lookup's prefix that ends below L1 reports its first missing block
  (:meth:`DiskTier.missed`). Every commit is written behind, so with LRU the tier keeps the most
  recently written or read objects and L1's choices barely matter; with ``reuse`` a block
  read again outlives the blocks written once (docs/cache-policy.md, "L1 + disk").
- **L1 eviction**: :meth:`DiskTier.holds` keeps a key L1 evicts as a STORED entry of this tier.
- **Restart**: :meth:`DiskTier.attach` rebuilds the pools (from each pool's ``layout.json``) and
  the index (from the file names, checked for length) before the server serves, removing
  half-written temporary files and retired pools' folders (:meth:`DiskTier.drop_pool`); the
  objects enter the policy in the order they were written, and the least recently written go
  first if the directory holds more than the budget.
- **Faults** (ENOSPC, EIO, a read-only or vanished directory): the failing operation is a
  dropped write or a miss, counted in ``l2_errors_total`` and logged once per interval; writes
  pause for ``RETRY_AFTER_S`` and then try again, recreating a vanished directory.

Everything but the I/O runs on the socket loop; the I/O threads only read and write files and
fill the jobs' results. Must not import torch or vLLM.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from functools import partial

import msgspec

from kvshelf.metric_types import Counters
from kvshelf.protocol import PageLayout
from kvshelf.server.policy import EvictionPolicy, LruPolicy
from kvshelf.server.pool import Entry, Pool
from kvshelf.server.tiers.base import Tier, TierIndex, TierLoad, TierStore
from kvshelf.server.tiers.disk_format import (
    MAX_HASH_BYTES,
    TEMP_PREFIX,
    CorruptObject,
    disk_bytes,
    file_sizes,
    object_name,
    parse_object_name,
    read_layout,
    read_object,
    write_layout,
    write_object,
)
from kvshelf.server.tiers.disk_io import FaultLog, IOThreads

logger = logging.getLogger("kvshelf.server.disk")

# Direct reads have no readahead, so the device sees only the requests the threads have in
# flight: 8 keep a virtual disk busier than 4 (measured: a cold 256 MiB load, median of 10
# rounds, 1.30 GB/s against 0.98), and they mostly wait on the device, not on a core.
IO_THREADS = 8
# A retired pool's folder is renamed to this prefix, then removed (and at start, if it was not).
RETIRED_PREFIX = ".retired-"
# After a failed write, writes are dropped for this long, then tried again.
RETRY_AFTER_S = 1.0
FAULT_LOG_INTERVAL_S = 10.0
# The longest a stop waits for the threads' tasks in progress (one file's read or write each:
# milliseconds on a working disk); a thread hung on a dead device is left behind.
DISK_STOP_S = 5.0

# An object's key within its pool: (rank, block hash).
Key = tuple[int, bytes]


class _Object(msgspec.Struct, gc=False, eq=False):
    """One object the tier holds or is writing: the location of its STORED entries, and a page
    of the tier's eviction policy (:class:`~kvshelf.server.policy.PolicyPage`) once written.

    One per object on disk, so never tracked by the cyclic garbage collector (as
    :class:`~kvshelf.server.pool.Entry`, and for the same reason); it refers to no object that
    could refer back to it."""

    pool: str
    rank: int
    block_hash: bytes
    path: str
    size: int
    # Its number in the tier (the policy's key for it), and the policy's own field.
    location: int
    stamp: int = 0
    # Reads in flight (pinned: never evicted meanwhile); whether its file is complete.
    readers: int = 0
    written: bool = False


# The objects of a pool the tier holds none of (never changed).
_NONE: dict[Key, _Object] = {}


class _Write:
    """A store's write job; ``failures[i]`` is set by the I/O thread that failed object ``i``."""

    __slots__ = ("bytes", "failures", "layout", "objects", "store", "unlinks", "views")

    def __init__(self, store: TierStore, layout: PageLayout) -> None:
        self.store = store
        self.layout = layout
        self.objects: list[_Object] = []
        self.views: list[memoryview] = []
        self.unlinks: list[str] = []
        self.failures: list[OSError | None] = []
        self.bytes = 0


# Outcomes of one object's read.
_OK, _CORRUPT, _FAILED = 0, 1, 2


class _Read:
    """A load's read job: one task per object; the last one to end finishes the load."""

    __slots__ = ("load", "lock", "objects", "remaining", "results")

    def __init__(self, load: TierLoad) -> None:
        self.load = load
        self.objects: list[_Object] = [entry.location for entry in load.entries]
        self.results = [_FAILED] * len(self.objects)
        self.remaining = len(self.objects)
        self.lock = threading.Lock()


class DiskTier(Tier):
    """Objects in files under one directory, within a byte budget.

    Args:
        path: the directory; created owner-only if missing.
        capacity_bytes: the budget for the objects' files.
        counters: the server's counters.
        queue_bytes: the most bytes of writes queued or running at once.
        io_threads: how many I/O threads.
        clock: monotonic time source.
        policy: which objects go first (the server's ``--eviction-policy``; LRU if None).

    Raises:
        OSError: the directory cannot be created.
    """

    name = "disk"

    def __init__(
        self,
        path: str,
        capacity_bytes: int,
        counters: Counters,
        *,
        queue_bytes: int,
        io_threads: int = IO_THREADS,
        clock: Callable[[], float] = time.monotonic,
        policy: EvictionPolicy | None = None,
    ) -> None:
        assert capacity_bytes > 0 and queue_bytes > 0
        os.makedirs(path, mode=0o700, exist_ok=True)
        self._path = path
        self._capacity = capacity_bytes
        self._queue_bytes = queue_bytes
        self.counters = counters
        self._clock = clock
        self._index: TierIndex | None = None
        # Every object held or being written, per pool name, so that a retired pool's objects
        # are found without looking at any other pool's; those written and not being read are
        # the policy's (invariant: a held object is in the policy iff written and readers == 0).
        self._objects: dict[str, dict[Key, _Object]] = {}
        self._policy = policy if policy is not None else LruPolicy()
        self._locations = itertools.count()
        self._used = 0  # budget bytes of every object in _objects
        self._queued = 0  # bytes of write jobs not completed
        self._resident_objects = 0
        self._resident_bytes = 0
        self._writes: dict[TierStore, _Write] = {}
        self._reads: dict[TierLoad, _Read] = {}
        self._retry_at = 0.0
        # Pool folders known to exist with their layout file (I/O threads add and discard).
        self._folders: set[str] = set()
        self._folders_lock = threading.Lock()
        self._temp_names = itertools.count()
        self._faults = FaultLog(FAULT_LOG_INTERVAL_S)
        self._io = IOThreads(io_threads, "kvshelf-disk")

    # Tier verbs.

    def attach(self, index: TierIndex) -> None:
        """Rebuild the pools and keys from the directory (see the module docstring)."""
        self._index = index
        started = time.perf_counter()
        found: list[tuple[int, Pool, int, bytes, str]] = []
        for folder in _scandir(self._path):
            if folder.name.startswith(RETIRED_PREFIX):
                # A retired pool's folder that was being removed when the server stopped.
                shutil.rmtree(folder.path, ignore_errors=True)
            elif folder.is_dir(follow_symlinks=False):
                found.extend(self._scan_pool(index, folder.path, folder.name))
        # Oldest first: the least recently written objects are the first to go.
        found.sort(key=lambda item: item[0])
        for _, pool, rank, block_hash, path in found:
            size = disk_bytes(pool.name, block_hash, pool.page_bytes)
            obj = _Object(pool.name, rank, block_hash, path, size, next(self._locations))
            obj.written = True
            self._objects.setdefault(pool.name, {})[rank, block_hash] = obj
            self._policy.add(obj)
            self._used += size
            self._resident_objects += 1
            self._resident_bytes += size
            index.add_stored(pool.name, rank, block_hash, self, obj)
        over: list[str] = []
        self._make_room(0, over)
        for path in over:
            _unlink(path)
        logger.info(
            "disk tier %s: %d objects (%.3f GiB of %.3f GiB) restored in %.2f s%s",
            self._path,
            self._resident_objects,
            self._resident_bytes / (1 << 30),
            self._capacity / (1 << 30),
            time.perf_counter() - started,
            f"; {len(over)} removed to fit the budget" if over else "",
        )

    def lookup(self, entry: Entry) -> bool:
        return entry.location.written

    def holds(self, pool: Pool, rank: int, block_hash: bytes) -> _Object | None:
        obj = self._objects.get(pool.name, _NONE).get((rank, block_hash))
        return obj if obj is not None and obj.written else None

    def prepare_store(self, store: TierStore) -> None:
        pool = store.pool
        assert pool.layout is not None
        job = _Write(store, pool.layout)
        folder = os.path.join(self._path, pool.name)
        # A job is taken whole while the queue is below its bound (so one commit larger than
        # the bound is still written), and dropped whole above it.
        degraded = self._clock() < self._retry_at or self._queued >= self._queue_bytes
        for block_hash, view in zip(store.block_hashes, store.views, strict=True):
            key = (store.rank, block_hash)
            held = self._objects.get(pool.name, _NONE).get(key)
            if held is not None:
                if held in self._policy:
                    self._policy.touch(held)  # stored again: a use of its key
                continue
            size = disk_bytes(pool.name, block_hash, pool.page_bytes)
            if (
                degraded
                or len(block_hash) > MAX_HASH_BYTES
                or not self._make_room(size, job.unlinks)
            ):
                self.counters.add("l2_dropped_writes_total")
                continue
            path = os.path.join(folder, object_name(store.rank, block_hash))
            obj = _Object(pool.name, store.rank, block_hash, path, size, next(self._locations))
            # Not kept across the loop: making room may have forgotten the pool's last object.
            self._objects.setdefault(pool.name, {})[key] = obj
            self._used += size
            job.objects.append(obj)
            job.views.append(view)
            job.bytes += size
        job.failures = [None] * len(job.objects)
        self._queued += job.bytes
        self._writes[store] = job
        self._io.write(partial(self._write, job))

    def complete_store(self, store: TierStore) -> None:
        job = self._writes.pop(store)
        self._queued -= job.bytes
        for obj, failure in zip(job.objects, job.failures, strict=True):
            if failure is None:
                obj.written = True
                self._policy.add(obj)
                self._resident_objects += 1
                self._resident_bytes += obj.size
                self.counters.add("l2_stored_objects_total")
            else:
                self.counters.add("l2_errors_total")
                self._retry_at = self._clock() + RETRY_AFTER_S
                self._forget(obj)

    def prepare_load(self, load: TierLoad) -> None:
        job = _Read(load)
        self._reads[load] = job
        for obj in job.objects:
            if not obj.readers:
                # A lookup's hit: used, then pinned until its last read ends.
                self._policy.touch(obj)
                self._policy.pin(obj)
            obj.readers += 1
        for i in range(len(job.objects)):
            self._io.read(partial(self._read, job, i))

    def complete_load(self, load: TierLoad) -> None:
        job = self._reads.pop(load)
        for obj, result in zip(job.objects, job.results, strict=True):
            obj.readers -= 1
            if not obj.readers and self._held(obj):
                self._policy.unpin(obj)
            if result == _OK:
                self.counters.add("l2_hit_objects_total")
                continue
            self.counters.add(
                "l2_corrupt_objects_total" if result == _CORRUPT else "l2_errors_total"
            )
            self._forget(obj)

    def clear(self) -> int:
        # Objects being read or written stay: their jobs end as usual.
        dropped = [
            obj
            for objects in self._objects.values()
            for obj in objects.values()
            if obj.written and obj.readers == 0
        ]
        for obj in dropped:
            self._forget(obj)
        if dropped:
            self._io.write(partial(_unlink_all, [obj.path for obj in dropped]))
        return len(dropped)

    def drop_pool(self, pool: Pool) -> None:
        """Forget a retired pool's objects (O(its objects), none of another pool's) and remove
        its folder: renamed on the loop (a restart never restores it, a new pool of the same
        name starts a fresh folder), then removed on an I/O thread."""
        for obj in self._objects.pop(pool.name, _NONE).values():
            assert obj.readers == 0 and obj.written, "a retired pool's object in use"
            self._policy.remove(obj)
            self._used -= obj.size
            self._resident_objects -= 1
            self._resident_bytes -= obj.size
        folder = os.path.join(self._path, pool.name)
        with self._folders_lock:
            self._folders.discard(folder)
        trash = os.path.join(self._path, f"{RETIRED_PREFIX}{pool.name}-{next(self._temp_names)}")
        try:
            os.rename(folder, trash)
        except FileNotFoundError:
            return
        except OSError as exc:
            self._faults.fault(f"removing the retired pool folder {folder}", exc)
            return
        self._io.write(partial(shutil.rmtree, trash, ignore_errors=True))

    def stats(self) -> dict[str, int]:
        return {
            "l2_resident_objects": self._resident_objects,
            "l2_resident_bytes": self._resident_bytes,
            "l2_capacity_bytes": self._capacity,
        }

    def missed(self, block_hash: bytes) -> None:
        self._policy.missed(block_hash)

    def close(self) -> None:
        # Jobs never started run here: every job finishes before this returns (a task in
        # progress is one local file's read or write).
        for task in self._io.stop(DISK_STOP_S):
            task()

    # The loop's side.

    def _make_room(self, size: int, unlinks: list[str]) -> bool:
        """Evict the policy's victims until ``size`` more bytes fit the budget.

        Their files go into ``unlinks`` (the caller removes them before writing).

        Returns:
            Whether it fits: False when the objects left are all being read or written.
        """
        while self._used + size > self._capacity:
            if not self._policy:
                return False
            victim = self._policy.pop_victim()
            self._forget(victim)
            unlinks.append(victim.path)
        return True

    def _held(self, obj: _Object) -> bool:
        return self._objects.get(obj.pool, _NONE).get((obj.rank, obj.block_hash)) is obj

    def _forget(self, obj: _Object) -> None:
        """Stop holding an object (its file is removed by whoever calls this)."""
        if not self._held(obj):
            return
        if obj.readers:
            # Pinned by reads still in flight: out of the policy's pin count as well.
            self._policy.unpin(obj)
        if obj in self._policy:
            self._policy.remove(obj)
        objects = self._objects[obj.pool]
        del objects[obj.rank, obj.block_hash]
        if not objects:
            del self._objects[obj.pool]
        self._used -= obj.size
        if obj.written:
            obj.written = False
            self._resident_objects -= 1
            self._resident_bytes -= obj.size
        assert self._index is not None
        self._index.remove_stored(obj.pool, obj.rank, obj.block_hash, self)

    def _scan_pool(
        self, index: TierIndex, folder: str, name: str
    ) -> list[tuple[int, Pool, int, bytes, str]]:
        """The objects of one pool folder as ``(mtime, pool, rank, hash, path)``; the pool is
        registered. Temporary files and objects of the wrong length are removed."""
        layout = read_layout(folder)
        pool = None
        if layout is not None:
            try:
                pool = index.register(layout, restoring=True)
            except Exception as exc:  # RequestRejected: e.g. pages larger than this arena
                logger.warning("disk tier: pool folder %s not restored: %s", folder, exc)
                return []
        if pool is None or pool.name != name:
            logger.warning("disk tier: %s has no valid layout file; left alone", folder)
            return []
        self._folders.add(folder)
        found = []
        for item in _scandir(folder):
            if item.name.startswith(TEMP_PREFIX):
                _unlink(item.path)  # a write a crash interrupted
                continue
            parsed = parse_object_name(item.name)
            if parsed is None:
                continue
            rank, block_hash = parsed
            try:
                stat = item.stat(follow_symlinks=False)
            except OSError:
                continue
            sizes = file_sizes(name, block_hash, pool.page_bytes)
            if rank >= pool.world_size or stat.st_size not in sizes:
                self.counters.add("l2_corrupt_objects_total")
                _unlink(item.path)
                continue
            found.append((stat.st_mtime_ns, pool, rank, block_hash, item.path))
        return found

    # The I/O threads' side.

    def _write(self, job: _Write) -> None:
        for path in job.unlinks:
            _unlink(path)
        folder = os.path.join(self._path, job.store.pool.name)
        for i, (obj, view) in enumerate(zip(job.objects, job.views, strict=True)):
            temp = os.path.join(folder, f"{TEMP_PREFIX}{os.getpid()}-{next(self._temp_names)}")
            try:
                self._ensure_folder(folder, job.layout)
                try:
                    write_object(obj.path, temp, obj.pool, obj.rank, obj.block_hash, view)
                except FileNotFoundError:
                    # The folder went (removed under us): make it again once.
                    with self._folders_lock:
                        self._folders.discard(folder)
                    self._ensure_folder(folder, job.layout)
                    write_object(obj.path, temp, obj.pool, obj.rank, obj.block_hash, view)
            except OSError as exc:
                self._faults.fault(f"writing {obj.path}", exc)
                # Full, read-only or gone: the rest of the job would fail the same way.
                job.failures[i:] = [exc] * (len(job.objects) - i)
                break
        job.store.finish()

    def _ensure_folder(self, folder: str, layout: PageLayout) -> None:
        # One thread makes a folder; the others wait for it rather than race its layout file.
        with self._folders_lock:
            if folder in self._folders:
                return
            os.makedirs(self._path, mode=0o700, exist_ok=True)
            write_layout(folder, layout)
            self._folders.add(folder)

    def _read(self, job: _Read, i: int) -> None:
        obj = job.objects[i]
        try:
            read_object(obj.path, obj.pool, obj.rank, obj.block_hash, job.load.views[i])
            result = _OK
        except CorruptObject as exc:
            logger.warning("disk tier: %s; removed", exc)
            _unlink(obj.path)
            result = _CORRUPT
        except OSError as exc:
            self._faults.fault(f"reading {obj.path}", exc)
            # The object is forgotten: do not leave its file outside the budget.
            _unlink(obj.path)
            result = _FAILED
        with job.lock:
            job.results[i] = result
            job.remaining -= 1
            last = job.remaining == 0
        if last:
            job.load.finish([r == _OK for r in job.results])


def _scandir(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except OSError:
        return []


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.debug("cannot remove %s: %s", path, exc)
