"""The L1 arena's memory: one POSIX shared-memory object, carved into page-aligned extents.

The server creates, sizes, pre-faults and unlinks the object; workers map it and copy page
contents. The server itself touches page bytes only through :meth:`SharedMemoryArena.view`, for
tiers below L1 that copy pages to and from it. Must not import torch or vLLM.
"""

from __future__ import annotations

import logging
import mmap
import os

from kvshelf.platform.prefault import BackgroundPrefault, mapping_address
from kvshelf.platform.shm import shm_path

logger = logging.getLogger(__name__)


class SharedMemoryArena:
    """Owns one ``/dev/shm/<name>`` object of a fixed size for the server's lifetime.

    Args:
        name: the object's name (no slash), e.g. ``kvshelf-5555-<boot id>``.
        size_bytes: its size; tmpfs allocates memory only when a page is first touched, unless
            :meth:`prefault` allocates it all up front.

    Raises:
        FileExistsError: when an object of that name exists already (never reuse one).
    """

    def __init__(self, name: str, size_bytes: int) -> None:
        assert "/" not in name and size_bytes > 0
        self.name = name
        self.size_bytes = size_bytes
        self.path = shm_path(name)
        # O_EXCL: a name collision must fail loudly rather than share another server's pages.
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size_bytes)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._closed = False
        self._mapping: mmap.mmap | None = None
        self._zeroing: BackgroundPrefault | None = None

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
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, self.size_bytes)
        finally:
            os.close(fd)
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
            fd = os.open(self.path, os.O_RDWR)
            try:
                self._mapping = mmap.mmap(
                    fd, self.size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
                )
            finally:
                os.close(fd)
        return self._mapping

    @property
    def zeroing(self) -> bool:
        """Whether the background zeroing started by :meth:`prefault` is still running."""
        return self._zeroing is not None and not self._zeroing.wait(0)

    def close(self) -> None:
        """Stop zeroing and unlink the object.

        Workers that still map it keep their mapping until they unmap it.
        """
        if self._closed:
            return
        self._closed = True
        if self._zeroing is not None:
            self._zeroing.stop()
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:
                # A tier still holds a view; the mapping goes when the process exits.
                logger.warning("the arena is still viewed by a tier at shutdown")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            logger.warning("shared-memory object %s was already removed", self.path)


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

    @property
    def used_bytes(self) -> int:
        """Bytes handed out to extents now."""
        return self._cursor - sum(end - start for start, end in self._free)

    def release(self, extent: range, page_bytes: int) -> None:
        """Take back an extent of ``page_bytes`` pages (from :meth:`allocate`)."""
        start, end = extent.start * page_bytes, extent.stop * page_bytes
        assert 0 <= start < end <= self._cursor
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
                return range(first, first + count)
        first = -(-self._cursor // page_bytes)  # ceil: align the extent to the page size
        count = min(max_pages, self.capacity_bytes // page_bytes - first)
        if count <= 0:
            return range(0)
        self._cursor = (first + count) * page_bytes
        assert self._cursor <= self.capacity_bytes
        return range(first, first + count)
