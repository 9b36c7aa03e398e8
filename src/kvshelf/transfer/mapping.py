"""Map the server's shared-memory arena into a worker process as a uint8 torch tensor."""

from __future__ import annotations

import gc
import mmap
import os
from collections.abc import Collection

import torch

from kvshelf.platform.prefault import BackgroundPrefault
from kvshelf.platform.shm import ACCESS_ERRNOS, arena_access_error, shm_path


class ArenaMapping:
    """A read-write mapping of the server's L1 arena (one POSIX shared-memory object).

    ``buffer`` is a 1-D uint8 tensor over the whole arena that shares memory with the server.
    Every tensor viewed from it keeps the mapping alive; :meth:`close` drops this object's
    tensor first, so it succeeds as soon as the caller has dropped its own views (for example by
    closing the transfer engine built on it). :meth:`start_prefault` populates the mapping in
    the background, so that copies do not take a page fault per 4 KiB page.

    Args:
        shm_name: the shared-memory object's name, as the server registered it (with or
            without a leading ``/``).
        arena_bytes: bytes to map; the object must be at least this large.
        populate: pre-fault every page of the mapping now (``MAP_POPULATE``) instead of on
            first touch. This allocates the whole arena if the server has not done so yet.

    Raises:
        ArenaAccessError: no such shared-memory object here (another IPC namespace), or one
            this user may not open (another user's).
        ValueError: a bad name, a non-positive size, or an object smaller than ``arena_bytes``.
    """

    def __init__(self, shm_name: str, arena_bytes: int, *, populate: bool = False) -> None:
        name = shm_name.lstrip("/")
        if not name or "/" in name:
            raise ValueError(f"invalid shared-memory name {shm_name!r}")
        if arena_bytes <= 0:
            raise ValueError(f"arena_bytes must be positive, got {arena_bytes}")
        self.shm_name = name
        self.arena_bytes = arena_bytes
        self.path = shm_path(name)
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError as exc:
            if exc.errno in ACCESS_ERRNOS:
                raise arena_access_error(self.path, exc) from exc
            raise
        try:
            size = os.fstat(fd).st_size
            if size < arena_bytes:
                raise ValueError(
                    f"shared-memory object {self.path} has {size} bytes, fewer than the "
                    f"{arena_bytes} expected"
                )
            flags = mmap.MAP_SHARED
            if populate and hasattr(mmap, "MAP_POPULATE"):
                flags |= mmap.MAP_POPULATE
            self._mmap: mmap.mmap | None = mmap.mmap(
                fd, arena_bytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)
        self._buffer: torch.Tensor | None = self._export()
        assert self._buffer.numel() == arena_bytes
        self._prefault: BackgroundPrefault | None = None

    def _export(self) -> torch.Tensor:
        """Wrap the mapping in a tensor that pins it.

        ``torch.frombuffer`` keeps a reference to the object it is given but no buffer export,
        so ``mmap.close()`` would unmap memory that tensors still point to. Handing it a
        ``memoryview`` instead makes every tensor keep that view, and so an export, alive:
        ``mmap.close()`` then raises ``BufferError`` until the last tensor is gone.
        """
        assert self._mmap is not None
        return torch.frombuffer(memoryview(self._mmap), dtype=torch.uint8, count=self.arena_bytes)

    @property
    def buffer(self) -> torch.Tensor:
        """The whole arena as a 1-D uint8 tensor (shared memory, writable)."""
        if self._buffer is None:
            raise ValueError(f"arena mapping {self.shm_name!r} is closed")
        return self._buffer

    @property
    def allocated_bytes(self) -> int:
        """Bytes of memory the shared-memory object has allocated (0 once it is unlinked)."""
        try:
            return os.stat(self.path).st_blocks * 512
        except FileNotFoundError:
            return 0

    def start_prefault(self, cpus: Collection[int] | None = None) -> BackgroundPrefault:
        """Populate the whole mapping in a background thread; :meth:`close` stops it.

        Copies that run meanwhile stay correct (their pages fault on demand). Pages the object
        has not allocated yet are allocated, as by a write.

        Args:
            cpus: cores to run the thread on; None keeps the caller's affinity.

        Returns:
            The running prefault.

        Raises:
            ValueError: the mapping is closed or already has a prefault.
        """
        if self._prefault is not None:
            raise ValueError(f"arena mapping {self.shm_name!r} is already being pre-faulted")
        self._prefault = BackgroundPrefault(
            self.buffer.data_ptr(), self.arena_bytes, f"arena {self.shm_name}", cpus=cpus
        )
        return self._prefault

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._mmap is None

    def close(self) -> None:
        """Unmap the arena. Idempotent.

        Raises:
            BufferError: some tensor viewing the arena is still alive elsewhere; drop it (close
                the engine using this arena) and call again.
        """
        if self._mmap is None:
            return
        if self._prefault is not None:
            # Before unmapping: the thread must not populate whatever is mapped there next.
            self._prefault.stop()
        self._buffer = None
        try:
            self._mmap.close()
        except BufferError:
            # A view may only be waiting for a reference cycle to be collected.
            gc.collect()
            try:
                self._mmap.close()
            except BufferError as exc:
                # Still open: keep the mapping usable so that close() can be retried.
                self._buffer = self._export()
                raise BufferError(
                    f"cannot unmap arena {self.shm_name!r}: tensors viewing it are still alive; "
                    "close the transfer engine (and drop other views) first"
                ) from exc
        self._mmap = None

    def __enter__(self) -> ArenaMapping:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"ArenaMapping({self.shm_name!r}, arena_bytes={self.arena_bytes}, {state})"


def map_arena(shm_name: str, arena_bytes: int, *, populate: bool = False) -> ArenaMapping:
    """Map the server's arena read-write.

    Args:
        shm_name: the shared-memory object's name from the server's registration reply.
        arena_bytes: the arena's size from the same reply.
        populate: pre-fault the whole mapping now (see :class:`ArenaMapping`).

    Returns:
        The mapping; call :meth:`ArenaMapping.close` (or use it as a context manager) when done.
    """
    return ArenaMapping(shm_name, arena_bytes, populate=populate)
