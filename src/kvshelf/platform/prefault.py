"""Pre-fault memory mappings with ``madvise(MADV_POPULATE_*)``, chunk by chunk.

The first touch of a shared-memory page costs a minor page fault (about a microsecond per
4 KiB page, a third of a copy's time), and for a page tmpfs has not allocated yet also its
allocation and zeroing. Populating a mapping ahead of time takes that cost off the copy path.
``madvise`` is called through ctypes, which releases the GIL for the call, so a populate in a
background thread does not stall the other Python threads.

No torch import: the server uses this module too.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Collection

from kvshelf.platform.affinity import pin_current_thread

logger = logging.getLogger(__name__)

# From <linux/mman.h>; both arrived in Linux 5.14, older kernels reject them with EINVAL.
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23

CHUNK_BYTES = 64 << 20
"""Bytes populated per ``madvise`` call: large enough that the calls cost nothing, small enough
that a stop request waits at most a few tens of milliseconds."""


@functools.cache
def _libc_madvise() -> Callable[[int, int, int], int]:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def mapping_address(mm: mmap.mmap) -> int:
    """Return the address of a mapping's first byte.

    Args:
        mm: an open mapping.

    Returns:
        The virtual address. The buffer export this takes ends when the temporary ctypes object
        dies, before this function returns, so ``mm.close()`` still works afterwards.
    """
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def madvise(address: int, length: int, advice: int) -> None:
    """Call ``madvise(2)``.

    Args:
        address: page-aligned start.
        length: bytes (rounded up to whole pages by the kernel).
        advice: an ``MADV_*`` value.

    Raises:
        OSError: the call failed (``errno`` says why).
    """
    if _libc_madvise()(address, length, advice) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"madvise(advice={advice}): {os.strerror(code)}")


def populate(
    address: int,
    length: int,
    *,
    stop: Callable[[], bool] = lambda: False,
    chunk_bytes: int = CHUNK_BYTES,
) -> int:
    """Pre-fault ``[address, address + length)``, writable where the kernel allows it.

    Uses ``MADV_POPULATE_WRITE``, or ``MADV_POPULATE_READ`` when the kernel rejects it. For a
    shared file mapping either one also allocates (and zeroes) pages the file does not have yet.

    Args:
        address: page-aligned start of a mapping.
        length: bytes to populate.
        stop: checked before every chunk; populating ends early once it returns true.
        chunk_bytes: bytes per ``madvise`` call, a multiple of the page size.

    Returns:
        The bytes populated: ``length``, or fewer when ``stop`` ended it early.

    Raises:
        OSError: ``EINVAL`` when the kernel supports neither advice (before Linux 5.14);
            ``ENOMEM`` when the range is not mapped or memory ran out; ``EFAULT`` when a page
            could not be provided (for example a full tmpfs).
    """
    if address % mmap.PAGESIZE or chunk_bytes <= 0 or chunk_bytes % mmap.PAGESIZE:
        raise ValueError("address and chunk_bytes must be multiples of the page size")
    advice = MADV_POPULATE_WRITE
    done = 0
    while done < length and not stop():
        size = min(chunk_bytes, length - done)
        try:
            madvise(address + done, size, advice)
        except OSError as exc:
            if exc.errno != errno.EINVAL or advice == MADV_POPULATE_READ:
                raise
            advice = MADV_POPULATE_READ
            continue
        done += size
    return done


class BackgroundPrefault:
    """Populates one mapping in a daemon thread, until it is done or stopped.

    The owner must call :meth:`stop` before it unmaps the range: a ``madvise`` on an address
    range that was unmapped and mapped again for something else would fault in that instead.
    :meth:`stop` waits for at most the chunk in progress. Anything that touches the range
    meanwhile is still correct; its pages fault on demand as they would without this.

    Args:
        address: page-aligned start of the mapping.
        length: bytes to populate.
        what: names the mapping in log lines.
        cpus: cores to run the thread on; None keeps the affinity it inherits.
        chunk_bytes: bytes per ``madvise`` call.
    """

    def __init__(
        self,
        address: int,
        length: int,
        what: str,
        *,
        cpus: Collection[int] | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self._address = address
        self._length = length
        self._what = what
        self._cpus = cpus
        self._chunk_bytes = chunk_bytes
        self._stop = threading.Event()
        self.populated_bytes = 0
        """Bytes populated, set when the thread ends."""
        self._thread = threading.Thread(target=self._run, name="kvshelf-prefault", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until the thread has ended.

        Args:
            timeout_s: the longest wait; None waits until it ends.

        Returns:
            Whether it has ended.
        """
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Ask the thread to stop after its current chunk and wait until it has. Idempotent."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        pin_current_thread(self._cpus)
        started = time.perf_counter()
        try:
            self.populated_bytes = populate(
                self._address,
                self._length,
                stop=self._stop.is_set,
                chunk_bytes=self._chunk_bytes,
            )
        except OSError as exc:
            # Not fatal: pages fault on first touch as they would without a prefault.
            level = logging.DEBUG if exc.errno == errno.EINVAL else logging.WARNING
            logger.log(
                level, "cannot pre-fault %s (%s); pages fault on first touch", self._what, exc
            )
            return
        if self.populated_bytes == self._length:
            logger.info(
                "pre-faulted %s: %.3f GiB in %.2f s",
                self._what,
                self._length / (1 << 30),
                time.perf_counter() - started,
            )
