"""Where POSIX shared-memory objects live, how kvshelf names its arenas, and the error a
process gets when it cannot open another process's arena."""

from __future__ import annotations

import errno
import os
import pwd

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


# open(2) errors that mean "this process may not, or cannot, see that arena".
ACCESS_ERRNOS = (errno.EACCES, errno.EPERM, errno.ENOENT)


class ArenaAccessError(OSError):
    """A process could not open the server's arena: another user, or another IPC namespace.

    The arena is owner-only shared memory in ``/dev/shm``, so vLLM must run as the server's
    user and see the server's ``/dev/shm``. The message says which, with both users' names.
    """


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def arena_access_error(path: str, exc: OSError) -> ArenaAccessError:
    """Explain why opening the arena ``path`` failed with ``exc`` (one of ACCESS_ERRNOS)."""
    me = _user(os.geteuid())
    if exc.errno == errno.ENOENT:
        why = (
            f"{path} does not exist here: this process does not share the server's /dev/shm. "
            "vLLM and kvshelf server must run in the same IPC namespace (same host; in "
            "containers, the same --ipc or a shared /dev/shm)"
        )
    else:
        try:
            owner = _user(os.stat(path).st_uid)
        except OSError:
            owner = "another user"
        why = (
            f"{path} belongs to {owner} and is owner-only, and this process runs as {me}. "
            "vLLM and kvshelf server must run as the same user"
        )
    return ArenaAccessError(exc.errno, f"cannot open the kvshelf arena: {why}", path)
