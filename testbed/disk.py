"""The disk tier's directory as tests and benchmarks see it: its objects, their size, damage.

`object_files` lists a directory's object files, `object_bytes` adds up what they take in
whole 4 KiB blocks (what the tier counts against ``--l2-disk-size-gb``), `flip_middle_bytes`
damages files as a failing disk would, `small_tmpfs` mounts a tiny file system that fills up
(ENOSPC), and `drop_page_cache` makes the next read of a file come from the device. Imports
neither torch nor vLLM.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator

from kvshelf.server.tiers.disk_format import BLOCK_BYTES, OBJECT_SUFFIX


def object_files(path: str) -> list[str]:
    """Every object file under ``path`` (temporary files excluded)."""
    found = []
    for folder, _, names in os.walk(path):
        found.extend(
            os.path.join(folder, name)
            for name in names
            if name.endswith(OBJECT_SUFFIX) and not name.startswith(".")
        )
    return sorted(found)


def object_bytes(path: str) -> int:
    """What the object files and files being written under ``path`` take, in whole blocks."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            if name.endswith(".json"):
                continue
            with contextlib.suppress(FileNotFoundError):
                size = os.stat(os.path.join(folder, name)).st_size
                total += -(-size // BLOCK_BYTES) * BLOCK_BYTES
    return total


def flip_middle_bytes(paths: list[str], count: int = 16) -> None:
    """Invert ``count`` bytes in the middle of each file, in place."""
    for path in paths:
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(size // 2)
            data = f.read(count)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in data))


def flip_byte(path: str | os.PathLike[str], offset: int) -> None:
    """Invert the byte at ``offset`` of a file, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def drop_page_cache(paths: list[str]) -> None:
    """Ask the kernel to drop the cached pages of ``paths`` (POSIX_FADV_DONTNEED)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@contextlib.contextmanager
def small_tmpfs(size_bytes: int) -> Iterator[str]:
    """A fresh tmpfs of ``size_bytes`` mounted on a temporary folder (needs root).

    Raises:
        OSError: it cannot be mounted here (not root, or no mount permission).
    """
    folder = tempfile.mkdtemp(prefix="kvshelf-tmpfs-")
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", folder],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        os.rmdir(folder)
        raise OSError(f"cannot mount a tmpfs: {result.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", folder], check=False)
        os.rmdir(folder)
