"""The reference a disk load is compared with: a plain sequential read of the same bytes.

`set_cache_state` makes files cold (their cached pages dropped with
``posix_fadvise(POSIX_FADV_DONTNEED)``) or warm (read once); `raw_read_gbps` times one thread
reading them front to back into one buffer. Imports neither torch nor vLLM.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from testbed.disk import drop_page_cache

READ_CHUNK = 16 << 20


def set_cache_state(paths: Sequence[str], cache: str) -> None:
    """Put ``paths`` in the page cache (``warm``) or out of it (``cold``)."""
    if cache == "cold":
        drop_page_cache(list(paths))
    else:
        _read_all(paths)


def raw_read_gbps(paths: Sequence[str]) -> float:
    """Read ``paths`` sequentially, one thread; return the rate in 1e9 bytes/s."""
    start = time.perf_counter()
    total = _read_all(paths)
    return total / (time.perf_counter() - start) / 1e9


def _read_all(paths: Sequence[str]) -> int:
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while got := os.readv(fd, [view]):
                total += got
        finally:
            os.close(fd)
    return total
