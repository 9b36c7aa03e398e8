"""The ``/dev/shm`` segments vLLM engines leave when the chaos run SIGKILLs them, and their removal.

A vLLM server in multi-process mode makes shared-memory segments for its message queues
(``psm_*``, Python's ``SharedMemory``) and named semaphores (``sem.mp-*``), each up to a few
hundred MB, and unlinks them when it stops cleanly; one killed by SIGKILL leaves them behind.
`SegmentWatch` records which such segments exist before an engine starts; after the engine is
killed, `SegmentWatch.sweep` removes only the segments that appeared since then and that no
live process maps or holds open: never a segment of another engine on the machine (it existed
before, or a live process still uses it), never a kvshelf arena (other names).

`leftovers` is the pure rule; the rest reads ``/dev/shm`` and ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Set
from dataclasses import dataclass, field

from kvshelf.platform.shm import SHM_DIR

VLLM_SEGMENT_PREFIXES = ("psm_", "sem.mp-")
"""Names of the segments a vLLM server (its engine core and workers) makes in ``/dev/shm``."""


def vllm_segments(shm_dir: str = SHM_DIR) -> set[str]:
    """The names of vLLM's segments in ``shm_dir`` now (`VLLM_SEGMENT_PREFIXES`)."""
    with contextlib.suppress(FileNotFoundError):
        return {n for n in os.listdir(shm_dir) if n.startswith(VLLM_SEGMENT_PREFIXES)}
    return set()


def segments_in_use(shm_dir: str = SHM_DIR) -> set[str]:
    """Names under ``shm_dir`` that a live process maps (``/proc/<pid>/maps``) or holds open
    (``/proc/<pid>/fd``). Processes this one may not inspect are skipped: a segment of another
    user cannot be removed by this one either (``/dev/shm`` is sticky)."""
    prefix = shm_dir.rstrip("/") + "/"
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = line.find(prefix)
                    if at >= 0:
                        used.add(line[at + len(prefix) :].split()[0])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(prefix):
                        used.add(target[len(prefix) :].split()[0])
    return used


def leftovers(before: Set[str], present: Iterable[str], in_use: Set[str]) -> set[str]:
    """The segments a killed engine left: present now, not before it started, used by nobody.

    Args:
        before: Segments that existed when the engine started (others' or older ones).
        present: Segments that exist now.
        in_use: Segments a live process maps or holds open.
    """
    return {name for name in present if name not in before and name not in in_use}


@dataclass
class SegmentWatch:
    """The vLLM segments one engine may leave: start it after `mark`, `sweep` after it ended.

    Attributes:
        before: Segments that existed at the last `mark`.
        removed: How many segments the sweeps removed so far.
        removed_bytes: Their allocated bytes.
    """

    shm_dir: str = SHM_DIR
    before: set[str] = field(default_factory=set)
    removed: int = 0
    removed_bytes: int = 0

    def mark(self) -> None:
        """Record what exists now (call just before the engine starts)."""
        self.before = vllm_segments(self.shm_dir)

    def left(self) -> set[str]:
        """The segments a sweep would remove now."""
        return leftovers(self.before, vllm_segments(self.shm_dir), segments_in_use(self.shm_dir))

    def sweep(self) -> int:
        """Remove the segments the engine left (call once its processes are gone).

        Returns:
            How many were removed.
        """
        count = 0
        for name in sorted(self.left()):
            path = os.path.join(self.shm_dir, name)
            with contextlib.suppress(FileNotFoundError, PermissionError):
                size = os.stat(path).st_blocks * 512
                os.unlink(path)
                count += 1
                self.removed_bytes += size
        self.removed += count
        return count
