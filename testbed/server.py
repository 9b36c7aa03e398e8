"""A real kvshelf server process for tests and benchmarks, and helpers around its arena.

`ServerProcess` (a ``python -m kvshelf.server`` child on a free loopback port, `free_port`) is
kvshelf's own, from :mod:`kvshelf.bench.server_process`: ``kvshelf bench transfer`` starts its
server with it. `map_arena_file` maps a server's arena, `resident_bytes` counts what a mapping
has faulted in, `run_kvshelf` runs the ``kvshelf`` command. Imports neither torch nor vLLM (a
test checks it): server tests run without them.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

from kvshelf.bench.server_process import ServerProcess, free_port
from kvshelf.platform.shm import shm_path

__all__ = ["ServerProcess", "free_port", "map_arena_file", "resident_bytes", "run_kvshelf"]


def map_arena_file(shm_name: str) -> mmap.mmap:
    """Map a server's arena read-write, to put page bytes in and read them back in tests.

    Args:
        shm_name: ``Registration.shm_name``.

    Returns:
        A shared mapping of the whole arena; the caller closes it.
    """
    fd = os.open(shm_path(shm_name), os.O_RDWR)
    try:
        return mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def resident_bytes(*, address: int | None = None, path: str | None = None) -> int:
    """Bytes of this process's mappings that have page table entries (``Rss`` in smaps).

    Args:
        address: count the mapping that starts at this address.
        path: count every mapping of this file.

    Returns:
        The resident bytes of the matching mappings (0 when none match).
    """
    total = 0
    matching = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields[0].endswith(":"):
                if matching and fields[0] == "Rss:":
                    total += int(fields[1]) * 1024
                continue
            # A mapping's header: "start-end perms offset dev inode [path]".
            start = int(fields[0].split("-")[0], 16)
            matching = start == address or (path is not None and fields[-1] == path)
    return total


def run_kvshelf(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run ``kvshelf ARGS...`` (this interpreter's) to its end; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "kvshelf", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
