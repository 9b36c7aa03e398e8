"""The server's arena made DMA-able for one CUDA device: pinned chunk by chunk, in the background.

The arena is a shared-memory mapping; registering a range of it with CUDA page-locks it and maps
it into the device's address space, so that copy engines and kernels reach it directly.
Registering locks (and so allocates) every page of the range, and takes time: 1 GiB is 262,144
pages, tens to hundreds of milliseconds.

Decisions:

- **The driver API** (``libcuda.so.1``: ``cuMemHostRegister_v2``,
  ``cuMemHostGetDevicePointer_v2``, ``cuMemHostUnregister``), not the runtime's
  ``cudaHostRegister``: a refused runtime call leaves the runtime's per-thread error set, and
  torch's next kernel launch on that thread would raise it inside vLLM. A driver call returns
  its error and leaves nothing behind. ``libcuda.so.1`` is the driver's one stable name (torch
  has it loaded already); without it the arena is not pinned and the engine refuses to start.
- **The rank's device in every thread:** each driver call runs with the device's primary
  context pushed on the calling thread (:meth:`CudaDriver.on_device`), so that no thread of
  kvshelf's ever creates a context on another GPU.
- **Chunks of** :data:`CHUNK_BYTES`, each registered the first time a copy needs a page in it,
  all unregistered on close: a server started with ``--no-prefault`` keeps most of what it
  asked for (memory is pinned chunk by chunk as pages are used, never the whole arena).
- **Never on the step loop:** :meth:`PinnedArena.pinned` only asks; a background thread
  registers. A load whose pages are not pinned yet is a miss for that step (vLLM recomputes),
  never a wait. The store thread, already in the background, registers what it needs itself
  (:meth:`PinnedArena.ensure`).
- **Closed is a state under the lock:** nothing is registered once :meth:`PinnedArena.close`
  began, and close waits for a registration in flight, then unregisters it with the rest.

Also :func:`host_alias`: a tensor on the device over pinned host memory, built through DLPack
(no numpy). No vLLM import, no ``torch.cuda``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 30
"""Bytes registered at once (a multiple of the OS page size)."""

DRIVER_LIBRARY = "libcuda.so.1"

_REGISTER_PORTABLE_DEVICEMAP = 0x01 | 0x02
"""``CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP``."""

_ATTRIBUTE_HOST_POINTER_FOR_REGISTERED_MEM = 91
"""``CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM``: registered host memory has
the same address on the device."""

_CUresult = ctypes.c_int
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    # name: (restype, *argtypes), as cuda.h declares them.
    "cuInit": (_CUresult, ctypes.c_uint),
    "cuDeviceGet": (_CUresult, ctypes.POINTER(ctypes.c_int), ctypes.c_int),
    "cuDeviceGetAttribute": (_CUresult, ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int),
    "cuDevicePrimaryCtxRetain": (_CUresult, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int),
    "cuDevicePrimaryCtxRelease_v2": (_CUresult, ctypes.c_int),
    "cuCtxPushCurrent_v2": (_CUresult, ctypes.c_void_p),
    "cuCtxPopCurrent_v2": (_CUresult, ctypes.POINTER(ctypes.c_void_p)),
    "cuMemHostRegister_v2": (_CUresult, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint),
    "cuMemHostGetDevicePointer_v2": (
        _CUresult,
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.c_void_p,
        ctypes.c_uint,
    ),
    "cuMemHostUnregister": (_CUresult, ctypes.c_void_p),
    "cuGetErrorName": (_CUresult, _CUresult, ctypes.POINTER(ctypes.c_char_p)),
}


class PinningError(RuntimeError):
    """CUDA refused to register (pin) part of the arena, or cannot be reached at all."""


class CudaDriver:
    """The CUDA driver calls kvshelf makes, bound once from a library.

    Args:
        library: ``ctypes.CDLL("libcuda.so.1")`` or a stand-in with the same functions (tests).
    """

    def __init__(self, library: Any) -> None:
        self._fns: dict[str, Callable[..., int]] = {}
        for name, (restype, *argtypes) in _SIGNATURES.items():
            fn = getattr(library, name)
            fn.restype = restype
            fn.argtypes = argtypes
            self._fns[name] = fn
        self._call("cuInit", 0)

    @classmethod
    def load(cls) -> CudaDriver:
        """The driver torch's CUDA runtime uses.

        Raises:
            PinningError: ``libcuda.so.1`` cannot be loaded, or lacks a function.
        """
        try:
            return cls(ctypes.CDLL(DRIVER_LIBRARY))
        except (OSError, AttributeError) as exc:
            raise PinningError(f"the CUDA driver ({DRIVER_LIBRARY}) cannot be used: {exc}") from exc

    def _call(self, name: str, *args: object) -> None:
        result = self._fns[name](*args)
        if result != 0:
            raise PinningError(f"{name} failed with {self._error_name(result)}")

    def _error_name(self, result: int) -> str:
        text = ctypes.c_char_p()
        if self._fns["cuGetErrorName"](result, ctypes.byref(text)) != 0 or not text.value:
            return f"CUresult {result}"
        return f"{text.value.decode()} ({result})"

    @contextlib.contextmanager
    def on_device(self, index: int) -> Iterator[None]:
        """Make device ``index``'s primary context current on this thread (the one vLLM's
        CUDA runtime uses for that device) for the driver calls inside."""
        device = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(device), index)
        context = ctypes.c_void_p()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
        try:
            self._call("cuCtxPushCurrent_v2", context)
            try:
                yield
            finally:
                self._call("cuCtxPopCurrent_v2", ctypes.byref(ctypes.c_void_p()))
        finally:
            self._call("cuDevicePrimaryCtxRelease_v2", device)

    def reaches_host_pointers(self, index: int) -> bool:
        """Whether device ``index`` addresses registered host memory at its host address."""
        value = ctypes.c_int()
        device = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(device), index)
        self._call(
            "cuDeviceGetAttribute",
            ctypes.byref(value),
            _ATTRIBUTE_HOST_POINTER_FOR_REGISTERED_MEM,
            device,
        )
        return bool(value.value)

    def register(self, address: int, nbytes: int) -> None:
        """Page-lock ``[address, address + nbytes)`` and map it for every device (current
        context needed: :meth:`on_device`)."""
        self._call("cuMemHostRegister_v2", address, nbytes, _REGISTER_PORTABLE_DEVICEMAP)

    def device_pointer(self, address: int) -> int:
        """The device address of registered host memory at ``address``."""
        pointer = ctypes.c_uint64()
        self._call("cuMemHostGetDevicePointer_v2", ctypes.byref(pointer), address, 0)
        return pointer.value

    def unregister(self, address: int) -> None:
        self._call("cuMemHostUnregister", address)


class PinnedArena:
    """Registers chunks of the arena with the CUDA driver, in the background, for one device.

    Thread-safe: the step loop asks (:meth:`pinned`), the store thread registers what it needs
    (:meth:`ensure`), a background thread registers what was asked, and :meth:`close` may race
    them all.

    Args:
        arena: the arena, a 1-D contiguous uint8 CPU tensor (the shared-memory mapping).
        page_bytes: bytes per page: chunks hold whole pages, so that no page straddles two
            registrations.
        driver: the CUDA driver.
        device_index: the rank's CUDA device; every driver call runs in its primary context.
        chunk_bytes: bytes registered at once (rounded down to whole pages, at least one).
    """

    def __init__(
        self,
        arena: torch.Tensor,
        page_bytes: int,
        driver: CudaDriver,
        device_index: int,
        *,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self._base = arena.data_ptr()
        self._bytes = arena.numel()
        self.pages_per_chunk = max(1, chunk_bytes // page_bytes)
        self._chunk_bytes = self.pages_per_chunk * page_bytes
        self._driver = driver
        self._device_index = device_index
        # Guards everything below; notified whenever a registration ends or close begins.
        self._state = threading.Condition()
        self._registered: set[int] = set()
        self._registering: set[int] = set()
        self._asked: set[int] = set()
        self._refused: set[int] = set()
        self._closed = False
        self._requests: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def registered_chunks(self) -> frozenset[int]:
        """Chunk numbers registered so far."""
        with self._state:
            return frozenset(self._registered)

    def chunks_of(self, page_indices: Iterable[int]) -> set[int]:
        """The chunk numbers holding these pages."""
        return {page // self.pages_per_chunk for page in page_indices}

    def pinned(self, page_indices: Sequence[int]) -> bool:
        """Whether every chunk holding these pages is registered; never waits.

        The chunks that are not are registered in the background (a refused one is never
        asked again): a later call may say True.
        """
        chunks = self.chunks_of(page_indices)
        with self._state:
            missing = chunks - self._registered
            if not missing:
                return True
            if self._closed:
                return False
            for chunk in missing - self._asked - self._refused:
                self._asked.add(chunk)
                self._requests.put(chunk)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._register_asked, name="kvshelf-pin", daemon=True
                )
                self._thread.start()
        return False

    def ensure(self, page_indices: Sequence[int]) -> None:
        """Register every chunk holding these pages, on the calling thread (the store thread:
        never the step loop); idempotent.

        Raises:
            PinningError: a registration failed (nothing of that chunk is registered), or the
                arena is closed.
        """
        for chunk in sorted(self.chunks_of(page_indices)):
            self._register(chunk)

    def close(self) -> None:
        """Stop registering, wait for a registration in flight, unregister every chunk.

        Call once every copy through the chunks has finished.
        """
        with self._state:
            self._closed = True
            self._state.notify_all()
            while self._registering:
                self._state.wait()
            chunks, self._registered = sorted(self._registered), set()
            thread, self._thread = self._thread, None
        if chunks:
            with self._driver.on_device(self._device_index):
                for chunk in chunks:
                    try:
                        self._driver.unregister(self._base + chunk * self._chunk_bytes)
                    except PinningError as exc:
                        logger.warning("kvshelf arena chunk %d: %s", chunk, exc)
        if thread is not None:
            self._requests.put(None)
            thread.join()

    def _register(self, chunk: int) -> None:
        with self._state:
            while chunk in self._registering:
                self._state.wait()
            if self._closed:
                raise PinningError("the kvshelf arena is being unmapped")
            if chunk in self._registered:
                return
            if chunk in self._refused:
                raise PinningError(f"CUDA refused to register chunk {chunk} of the kvshelf arena")
            self._registering.add(chunk)
        start = chunk * self._chunk_bytes
        nbytes = min(self._chunk_bytes, self._bytes - start)
        address = self._base + start
        try:
            with self._driver.on_device(self._device_index):
                self._driver.register(address, nbytes)
                try:
                    if self._driver.device_pointer(address) != address:
                        raise PinningError(
                            f"device {self._device_index} maps the arena at another address"
                        )
                except Exception:
                    self._driver.unregister(address)
                    raise
        except Exception as exc:
            with self._state:
                self._registering.discard(chunk)
                self._refused.add(chunk)
                self._state.notify_all()
            message = (
                f"registering {nbytes} bytes of the kvshelf arena (chunk {chunk}) with CUDA "
                f"failed: {exc}; is the locked-memory limit (ulimit -l) too low?"
            )
            # Once per chunk: a refused chunk is never asked for again.
            logger.warning("%s Its pages are served uncached.", message)
            raise PinningError(message) from exc
        with self._state:
            self._registering.discard(chunk)
            self._registered.add(chunk)
            self._state.notify_all()

    def _register_asked(self) -> None:
        """The background registrations, in the order asked."""
        while (chunk := self._requests.get()) is not None:
            # A refusal was logged where it happened; a closing arena registers nothing.
            with contextlib.suppress(PinningError):
                self._register(chunk)


def host_alias(pages: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` over the same bytes as ``pages`` (pinned host memory that the
    device addresses at its host address), made through DLPack: no numpy, no copy.

    Args:
        pages: a contiguous uint8 CPU tensor; it must outlive the alias.
        device: a CUDA device (or ``cpu``, which aliases on the host).
    """
    if pages.dtype != torch.uint8 or not pages.is_contiguous():
        raise ValueError("host_alias takes a contiguous uint8 tensor")
    device_type = _DL_CUDA if device.type == "cuda" else _DL_CPU
    index = (device.index or 0) if device.type == "cuda" else 0
    shape = (ctypes.c_int64 * pages.dim())(*pages.shape)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(
        ctypes.c_void_p(pages.data_ptr()),
        _DLDevice(device_type, index),
        pages.dim(),
        _DLDataType(_DL_UINT, 8, 1),
        ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)),
        None,
        0,
    )
    managed.deleter = _dl_deleter
    address = ctypes.addressof(managed)
    # Kept alive until torch frees the alias and calls the deleter.
    _DL_ALIVE[address] = (managed, shape)
    capsule = _PyCapsule_New(address, b"dltensor", None)
    try:
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        _DL_ALIVE.pop(address, None)
        raise


# DLPack's ABI (dlpack.h), for host_alias.
_DL_CPU, _DL_CUDA, _DL_UINT = 1, 2, 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DLDeleter),
]
_DL_ALIVE: dict[int, object] = {}


@_DLDeleter
def _dl_deleter(managed: Any) -> None:
    _DL_ALIVE.pop(ctypes.addressof(managed.contents), None)


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
