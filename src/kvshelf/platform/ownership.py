"""Who owns an arena: the ownership lock, and the scan that finds arenas whose owner is gone.

A server holds ``flock(LOCK_EX)`` on its arena's file for its whole life, through a descriptor
opened with ``O_CLOEXEC``; the kernel drops the lock when the process dies, however it dies
(SIGKILL, OOM kill). So an arena that carries kvshelf's header (the caller says how to
recognise it: :mod:`kvshelf.server.page_table`) and whose lock can be taken has provably no
owner. An arena without that header (made by an older kvshelf, which took no lock) or one
whose lock is held is left alone. Workers map arenas but never lock them.

The header is written only after its creator holds the lock (:func:`create_locked`), so a scan
never takes the lock of an arena that is still being made.

Must not import torch or vLLM.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvshelf.platform.shm import ARENA_PREFIX, SHM_DIR


class Owner(enum.Enum):
    """What a scan found out about an arena's owner."""

    DEAD = "dead"  # ours, and its lock was free: the scan now holds it
    LIVE = "live"  # ours, and its lock is held by a running process
    UNPROVABLE = "unprovable"  # no kvshelf header that this kvshelf knows: left alone


@dataclass
class ArenaFile:
    """One ``/dev/shm/kvshelf-*`` object seen by :func:`scan`.

    Attributes:
        name: its shared-memory name.
        port: the server port in its name, or None when the name has none.
        size_bytes: its file size.
        mtime: its last modification time (newest first when several are adoptable).
        owner: what the scan found.
        fd: for a DEAD arena, the descriptor holding its lock; the caller adopts it or calls
            :meth:`remove`.
    """

    name: str
    port: int | None
    size_bytes: int
    mtime: float
    owner: Owner
    fd: int = -1

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    def remove(self) -> None:
        """Unlink a DEAD arena and drop its lock."""
        assert self.owner is Owner.DEAD and self.fd >= 0
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.release()

    def release(self) -> None:
        """Drop the lock without removing anything."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def port_of(name: str) -> int | None:
    """The port in an arena name ``kvshelf-<port>-<boot id>``, or None."""
    port, sep, _ = name.removeprefix(ARENA_PREFIX).partition("-")
    return int(port) if sep and port.isdigit() else None


def create_locked(path: str, size_bytes: int) -> int:
    """Create ``path`` (never an existing one), lock it, then size it.

    Returns:
        The descriptor holding the lock (``O_CLOEXEC``): keep it open for the owner's life.

    Raises:
        FileExistsError: the name exists.
        OSError: it cannot be locked or sized (the file is removed again).
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, size_bytes)
    except BaseException:
        os.unlink(path)
        os.close(fd)
        raise
    return fd


def _probe(name: str, recognise: Callable[[int, int], bool]) -> ArenaFile | None:
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None  # gone meanwhile, or not ours to open
    try:
        stat = os.fstat(fd)
        found = ArenaFile(name, port_of(name), stat.st_size, stat.st_mtime, Owner.UNPROVABLE)
        if not recognise(fd, stat.st_size):
            return found
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            found.owner = Owner.LIVE
            return found
        # Renamed or unlinked between the open and the lock (adopted by another server)?
        try:
            same = os.stat(path).st_ino == stat.st_ino
        except FileNotFoundError:
            same = False
        if not same:
            return None
        found.owner, found.fd = Owner.DEAD, fd
        fd = -1
        return found
    finally:
        if fd >= 0:
            os.close(fd)


def scan(recognise: Callable[[int, int], bool], *, port: int | None = None) -> Iterator[ArenaFile]:
    """The kvshelf arenas in ``/dev/shm`` (of ``port`` only, when given).

    Args:
        recognise: ``(fd, size) -> bool``: whether the object carries this kvshelf's header.
        port: only arenas named for this server port.

    Yields:
        Each arena; a DEAD one holds its lock until the caller removes, adopts or releases it.
    """
    try:
        names = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return
    for name in names:
        if not name.startswith(ARENA_PREFIX):
            continue
        if port is not None and port_of(name) != port:
            continue
        found = _probe(name, recognise)
        if found is not None:
            yield found
