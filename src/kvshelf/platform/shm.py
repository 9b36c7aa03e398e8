"""Where POSIX shared-memory objects live, and how kvshelf names its arenas."""

from __future__ import annotations

import os

# The tmpfs behind shm_open(3) on Linux; the arena is a file in it.
SHM_DIR = "/dev/shm"
# Every kvshelf arena's name starts with this (``kvshelf-<port>-<boot id>``).
ARENA_PREFIX = "kvshelf-"


def shm_path(name: str) -> str:
    """The file of the shared-memory object ``name``."""
    return os.path.join(SHM_DIR, name)


def arena_name(port: int, boot_id: str) -> str:
    """The shared-memory name of the arena of the server on ``port`` in boot ``boot_id``."""
    return f"{ARENA_PREFIX}{port}-{boot_id}"
