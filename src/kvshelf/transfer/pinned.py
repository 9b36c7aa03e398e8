"""The server's arena made DMA-able for a CUDA device: registered as pinned host memory.

The arena is a shared-memory mapping; ``cudaHostRegister`` (torch's cudart binding) page-locks
a range of it and maps it into the device's address space, so that copy engines and kernels
reach it directly. Registering locks (and so allocates) every page of the range.

Decision (against the server's ``--no-prefault``): the arena is registered in fixed chunks of
:data:`CHUNK_BYTES`, each the first time a copy touches a page in it, and all are unregistered
on close. A server that pre-allocated its arena (the default) loses nothing; one started with
``--no-prefault`` keeps most of what it asked for: memory is allocated and pinned chunk by
chunk as pages are used, never the whole arena at attach. Registering everything at attach
would pin (and allocate) the whole arena at once and take seconds for a large one. The price is
one registration (milliseconds per chunk) on the first copy that reaches a new chunk.

No vLLM import; ``torch.cuda`` only when a :class:`PinnedArena` is made with a device.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 30
"""Bytes registered at once (a multiple of the OS page size)."""

_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02
"""``cudaHostRegisterPortable | cudaHostRegisterMapped``."""


class PinningError(RuntimeError):
    """CUDA refused to register (pin) part of the arena."""


class PinnedArena:
    """Registers chunks of the arena with CUDA on demand; :meth:`close` unregisters them.

    Args:
        arena: the arena, a 1-D contiguous uint8 CPU tensor (the shared-memory mapping).
        page_bytes: bytes per page: chunks hold whole pages, so that no page straddles two
            registrations.
        chunk_bytes: bytes registered at once (rounded down to whole pages, at least one).
        register: ``(address, nbytes) -> None``, raising :class:`PinningError`; the default
            calls ``cudaHostRegister``.
        unregister: ``address -> None``; the default calls ``cudaHostUnregister``.
    """

    def __init__(
        self,
        arena: torch.Tensor,
        page_bytes: int,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        register: Callable[[int, int], None] | None = None,
        unregister: Callable[[int], None] | None = None,
    ) -> None:
        self._base = arena.data_ptr()
        self._bytes = arena.numel()
        self.pages_per_chunk = max(1, chunk_bytes // page_bytes)
        self._page_bytes = page_bytes
        self._register = register or _cuda_register
        self._unregister = unregister or _cuda_unregister
        self._registered: set[int] = set()
        self._lock = threading.Lock()

    @property
    def registered_chunks(self) -> frozenset[int]:
        """Chunk numbers registered so far."""
        with self._lock:
            return frozenset(self._registered)

    def ensure(self, page_indices: Sequence[int]) -> None:
        """Register every chunk holding one of these pages (thread-safe, idempotent).

        Raises:
            PinningError: a registration failed; nothing of that chunk is registered.
        """
        chunks = sorted({page // self.pages_per_chunk for page in page_indices})
        with self._lock:
            for chunk in chunks:
                if chunk in self._registered:
                    continue
                start = chunk * self.pages_per_chunk * self._page_bytes
                end = min(start + self.pages_per_chunk * self._page_bytes, self._bytes)
                self._register(self._base + start, end - start)
                self._registered.add(chunk)

    def close(self) -> None:
        """Unregister every registered chunk (call after every copy through them finished)."""
        with self._lock:
            for chunk in sorted(self._registered):
                self._unregister(self._base + chunk * self.pages_per_chunk * self._page_bytes)
            self._registered.clear()


def _cuda_register(address: int, nbytes: int) -> None:
    error = torch.cuda.cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE_MAPPED)
    if int(error) != 0:
        raise PinningError(
            f"cudaHostRegister of {nbytes} bytes of the kvshelf arena failed (error "
            f"{int(error)}): is the locked-memory limit (ulimit -l) too low?"
        )


def _cuda_unregister(address: int) -> None:
    error = torch.cuda.cudart().cudaHostUnregister(address)
    if int(error) != 0:
        logger.warning("cudaHostUnregister of the kvshelf arena failed (error %d)", int(error))


def device_address(host_address: int) -> int:
    """The device address of registered host memory.

    With unified addressing (every 64-bit Linux CUDA system kvshelf supports) it is usually the
    host address; ``cudaHostGetDevicePointer`` says for sure when the CUDA runtime library
    torch loaded can be found, and the host address is assumed otherwise.
    """
    for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so"):
        try:
            cudart = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        pointer = ctypes.c_void_p()
        error = cudart.cudaHostGetDevicePointer(
            ctypes.byref(pointer), ctypes.c_void_p(host_address), 0
        )
        if error != 0:
            raise PinningError(f"cudaHostGetDevicePointer failed (error {error})")
        return int(pointer.value or 0)
    logger.debug("no CUDA runtime library found by name: assuming unified addressing")
    return host_address
