"""The L1 arena's memory: one POSIX shared-memory object, carved into page-aligned extents.

The server creates, sizes, pre-faults and unlinks the object; workers map it and copy page
contents. The server itself touches page bytes only through :meth:`SharedMemoryArena.view`, for
tiers below L1 that copy pages to and from it. Must not import torch or vLLM.
"""

from __future__ import annotations

import logging
import mmap
import os

from kvshelf.platform.ownership import ArenaFile, create_locked
from kvshelf.platform.prefault import BackgroundPrefault, mapping_address
from kvshelf.platform.shm import shm_path
from kvshelf.server.limits import DEFAULT_MAX_POOLS
from kvshelf.server.page_table import HEADER_BYTES, Geometry, PageTable, encode_header

logger = logging.getLogger(__name__)


class SharedMemoryArena:
    """Owns one ``/dev/shm/<name>`` object of a fixed size for the server's lifetime.

    The object is ``size_bytes`` of pages (what workers map) followed by the page table's
    trailer (:mod:`kvshelf.server.page_table`). The owner holds the object's ownership lock
    (:mod:`kvshelf.platform.ownership`) until :meth:`close`.

    Args:
        name: the object's name (no slash), e.g. ``kvshelf-5555-<boot id>``.
        size_bytes: its pages' size; tmpfs allocates memory only when a page is first
            touched, unless :meth:`prefault` allocates it all up front.
        pool_slots: how many pools the page table records.

    Raises:
        FileExistsError: when an object of that name exists already (never reuse one).
    """

    def __init__(self, name: str, size_bytes: int, *, pool_slots: int = DEFAULT_MAX_POOLS) -> None:
        assert "/" not in name and size_bytes > 0
        geometry = Geometry.for_capacity(size_bytes, pool_slots)
        path = shm_path(name)
        # O_EXCL: a name collision must fail loudly rather than share another server's pages.
        fd = create_locked(path, geometry.file_bytes)
        try:
            os.pwrite(fd, encode_header(geometry), geometry.file_bytes - HEADER_BYTES)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        self._own(name, fd, geometry)

    @classmethod
    def adopt(cls, found: ArenaFile, name: str, geometry: Geometry) -> SharedMemoryArena:
        """Take over a dead server's arena (its lock held by ``found``), renamed to ``name``.

        The pages and the page table stay as they are; workers map the new name.

        Raises:
            OSError: the rename failed (``found`` still holds the lock).
        """
        os.rename(found.path, shm_path(name))
        arena = cls.__new__(cls)
        arena._own(name, found.fd, geometry)
        found.fd = -1
        return arena

    def _own(self, name: str, fd: int, geometry: Geometry) -> None:
        self.name = name
        self.size_bytes = geometry.capacity
        self.geometry = geometry
        self.path = shm_path(name)
        # Held open (O_CLOEXEC) for the server's life: it carries the ownership lock.
        self._fd = fd
        self._closed = False
        self._mapping: mmap.mmap | None = None
        self._zeroing: BackgroundPrefault | None = None
        self._table: PageTable | None = None
        # Leave the object for the next server on the port (--keep-arena-on-exit).
        self.keep_on_close = False

    def table(self) -> PageTable:
        """The page table in the object's trailer (through the server's mapping); one per
        arena, released by :meth:`close`."""
        if self._table is None:
            whole = memoryview(self._mapped())
            self._table = PageTable(
                whole[self.size_bytes :], self.geometry, self._fd, self.size_bytes
            )
            whole.release()
        return self._table

    def prefault(self) -> BackgroundPrefault:
        """Allocate every page of the object now and zero them in the background.

        ``posix_fallocate`` reserves the pages before this returns (about 0.1 s per GiB), fails
        cleanly when the file system is full, and makes workers see a fully allocated object.
        tmpfs leaves the zeroing of such pages to their first touch (about 0.3 s per GiB, more
        where the memory was never used before), so a daemon thread populates a writable
        mapping of the object meanwhile; the server answers requests during that time, and
        a store or a worker that touches a page first just zeroes it itself. :meth:`close`
        stops the thread.

        Returns:
            The running zeroing thread.

        Raises:
            OSError: no space (``ENOSPC``) or memory (``ENOMEM``) for the whole object.
        """
        assert self._zeroing is None, "already pre-faulted"
        os.posix_fallocate(self._fd, 0, self.size_bytes)
        self._zeroing = BackgroundPrefault(
            mapping_address(self._mapped()), self.size_bytes, f"arena {self.path}"
        )
        return self._zeroing

    def view(self, offset: int, length: int) -> memoryview:
        """A writable view of ``length`` bytes at ``offset``, through the server's own mapping.

        Mapping the object costs no memory until its pages are touched; it is made on first use
        (or by :meth:`prefault`) and lives until :meth:`close`.
        """
        assert offset >= 0 and offset + length <= self.size_bytes
        return memoryview(self._mapped())[offset : offset + length]

    def _mapped(self) -> mmap.mmap:
        """The server's writable mapping of the whole object, made on first use."""
        if self._mapping is None:
            self._mapping = mmap.mmap(
                self._fd,
                self.geometry.file_bytes,
                mmap.MAP_SHARED,
                mmap.PROT_READ | mmap.PROT_WRITE,
            )
        return self._mapping

    @property
    def zeroing(self) -> bool:
        """Whether the background zeroing started by :meth:`prefault` is still running."""
        return self._zeroing is not None and not self._zeroing.wait(0)

    def close(self) -> None:
        """Stop zeroing, unlink the object (unless :attr:`keep_on_close`: the next server on
        the port adopts it), and drop the ownership lock.

        Workers that still map it keep their mapping until they unmap it.
        """
        if self._closed:
            return
        self._closed = True
        if self._zeroing is not None:
            self._zeroing.stop()
        if self._table is not None:
            self._table.release()
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:
                # A tier still holds a view; the mapping goes when the process exits.
                logger.warning("the arena is still viewed by a tier at shutdown")
        if not self.keep_on_close:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                logger.warning("shared-memory object %s was already removed", self.path)
        os.close(self._fd)


class ExtentAllocator:
    """Hands out page-aligned extents of the arena to pools, and takes them back.

    Every extent starts at a multiple of the requesting pool's ``page_bytes``, so a page is named
    by ``offset // page_bytes`` and a worker can view the arena as one
    ``[capacity_bytes // page_bytes, page_bytes]`` array. A returned extent's bytes are reused
    first (lowest address first), then the unallocated tail; alignment gaps stay free.

    Args:
        capacity_bytes: the arena's size.
    """

    def __init__(self, capacity_bytes: int) -> None:
        assert capacity_bytes > 0
        self.capacity_bytes = capacity_bytes
        # Invariant: every byte below _cursor belongs to an extent or to a free range.
        self._cursor = 0
        # Free byte ranges below the cursor, [start, end), sorted and never adjacent.
        self._free: list[tuple[int, int]] = []
        # Bytes of the extents handed out; the rest below the cursor is alignment gaps.
        self.extent_bytes = 0

    @property
    def free_bytes(self) -> int:
        """Bytes no extent holds: free ranges and the unallocated tail."""
        return self.capacity_bytes - self._cursor + sum(end - start for start, end in self._free)

    @property
    def gap_bytes(self) -> int:
        """Bytes below the cursor in neither an extent nor a free range: the alignment gaps
        skipped when an extent of larger pages was taken from the tail."""
        return self.capacity_bytes - self.free_bytes - self.extent_bytes

    def claim(self, start: int, end: int) -> None:
        """Mark ``[start, end)`` as an extent of an adopted arena; claims come in address
        order, on an allocator nothing was allocated from, and what lies between them is free.
        """
        assert self._cursor <= start < end <= self.capacity_bytes
        if start > self._cursor:
            self._free.append((self._cursor, start))
        self._cursor = end
        self.extent_bytes += end - start

    @property
    def used_bytes(self) -> int:
        """Bytes handed out to extents now."""
        return self._cursor - sum(end - start for start, end in self._free)

    def release(self, extent: range, page_bytes: int) -> None:
        """Take back an extent of ``page_bytes`` pages (from :meth:`allocate`)."""
        start, end = extent.start * page_bytes, extent.stop * page_bytes
        assert 0 <= start < end <= self._cursor
        self.extent_bytes -= end - start
        ranges = [*self._free, (start, end)]
        ranges.sort()
        merged: list[tuple[int, int]] = []
        for lo, hi in ranges:
            if merged and lo <= merged[-1][1]:
                assert lo == merged[-1][1], "an extent released twice"
                merged[-1] = (merged[-1][0], hi)
            else:
                merged.append((lo, hi))
        if merged and merged[-1][1] == self._cursor:
            self._cursor = merged.pop()[0]
        self._free = merged

    def allocate(self, page_bytes: int, max_pages: int) -> range:
        """Take up to ``max_pages`` pages of ``page_bytes`` from the unallocated tail.

        Args:
            page_bytes: the pool's page size.
            max_pages: the most pages wanted; fewer are returned near the end of the arena.

        Returns:
            The page indices (in units of ``page_bytes``) of the new extent; empty when full.
        """
        assert page_bytes > 0 and max_pages > 0
        for i, (lo, hi) in enumerate(self._free):
            first = -(-lo // page_bytes)
            count = min(max_pages, hi // page_bytes - first)
            if count > 0:
                taken_lo, taken_hi = first * page_bytes, (first + count) * page_bytes
                rest = [(a, b) for a, b in ((lo, taken_lo), (taken_hi, hi)) if b > a]
                self._free[i : i + 1] = rest
                self.extent_bytes += count * page_bytes
                return range(first, first + count)
        first = -(-self._cursor // page_bytes)  # ceil: align the extent to the page size
        count = min(max_pages, self.capacity_bytes // page_bytes - first)
        if count <= 0:
            return range(0)
        self._cursor = (first + count) * page_bytes
        assert self._cursor <= self.capacity_bytes
        self.extent_bytes += count * page_bytes
        return range(first, first + count)
