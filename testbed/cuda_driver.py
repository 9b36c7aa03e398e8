"""A fake CUDA driver library (``libcuda.so.1``) for CPU tests of the pinning code.

Its functions are ctypes function pointers with the signatures ``cuda.h`` declares, so
:class:`kvshelf.transfer.pinned.CudaDriver` binds and calls them exactly as it does the real
library (argument conversion, out-pointers, ``CUresult`` returns). It models what the pinning
code relies on: each thread's context stack (a driver call that needs a context fails with
``CUDA_ERROR_INVALID_CONTEXT`` when none is current), device primary contexts, registrations
that fail (``refuse``) or take as long as a test wants (``gate``), and it logs every call with
the calling thread and the device of its current context.

Imports no kvshelf module and no vLLM.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713

_NAMES = {
    CUDA_ERROR_INVALID_VALUE: b"CUDA_ERROR_INVALID_VALUE",
    CUDA_ERROR_OUT_OF_MEMORY: b"CUDA_ERROR_OUT_OF_MEMORY",
    CUDA_ERROR_INVALID_CONTEXT: b"CUDA_ERROR_INVALID_CONTEXT",
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: b"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: b"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
}
_CONTEXT_BASE = 0x1000

_c = ctypes
_CUresult = _c.c_int
_PROTOTYPES = {
    "cuInit": _c.CFUNCTYPE(_CUresult, _c.c_uint),
    "cuDeviceGet": _c.CFUNCTYPE(_CUresult, _c.POINTER(_c.c_int), _c.c_int),
    "cuDeviceGetAttribute": _c.CFUNCTYPE(_CUresult, _c.POINTER(_c.c_int), _c.c_int, _c.c_int),
    "cuDevicePrimaryCtxRetain": _c.CFUNCTYPE(_CUresult, _c.POINTER(_c.c_void_p), _c.c_int),
    "cuDevicePrimaryCtxRelease_v2": _c.CFUNCTYPE(_CUresult, _c.c_int),
    "cuCtxPushCurrent_v2": _c.CFUNCTYPE(_CUresult, _c.c_void_p),
    "cuCtxPopCurrent_v2": _c.CFUNCTYPE(_CUresult, _c.POINTER(_c.c_void_p)),
    "cuMemHostRegister_v2": _c.CFUNCTYPE(_CUresult, _c.c_void_p, _c.c_size_t, _c.c_uint),
    "cuMemHostGetDevicePointer_v2": _c.CFUNCTYPE(
        _CUresult, _c.POINTER(_c.c_uint64), _c.c_void_p, _c.c_uint
    ),
    "cuMemHostUnregister": _c.CFUNCTYPE(_CUresult, _c.c_void_p),
    "cuGetErrorName": _c.CFUNCTYPE(_CUresult, _CUresult, _c.POINTER(_c.c_char_p)),
}


@dataclass(frozen=True)
class DriverCall:
    """One call: the function, its main argument, the calling thread, the current device."""

    name: str
    arg: int
    thread: str
    device: int | None


class FakeCudaDriver:
    """Stands for ``ctypes.CDLL("libcuda.so.1")`` (pass it to ``CudaDriver``).

    Args:
        devices: how many devices exist.
        unified: the ``CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`` attribute of every device.

    Attributes:
        refuse: addresses whose registration fails with ``CUDA_ERROR_OUT_OF_MEMORY`` (as a
            too low ``ulimit -l`` makes it fail); ``refuse_all``: every registration fails.
        gate: while cleared, a registration waits for it (a slow 1 GiB registration);
            ``entered`` is set when one starts waiting.
        registered: address -> bytes of the ranges registered now.
        calls: every call, in order.
        retained: device -> how many times its primary context is retained now.
    """

    def __init__(self, devices: int = 8, *, unified: bool = True) -> None:
        self._devices = devices
        self._unified = unified
        self._lock = threading.Lock()
        self._stacks = threading.local()
        self.refuse: set[int] = set()
        self.refuse_all = False
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.registered: dict[int, int] = {}
        self.calls: list[DriverCall] = []
        self.retained: dict[int, int] = {}
        for name, prototype in _PROTOTYPES.items():
            setattr(self, name, prototype(getattr(self, "_" + name)))

    def calls_to(self, name: str) -> list[DriverCall]:
        return [call for call in self.calls if call.name == name]

    def _stack(self) -> list[int]:
        if not hasattr(self._stacks, "contexts"):
            self._stacks.contexts = []
        return self._stacks.contexts

    def _current(self) -> int | None:
        stack = self._stack()
        return stack[-1] - _CONTEXT_BASE if stack else None

    def _log(self, name: str, arg: int | None) -> None:
        call = DriverCall(name, arg or 0, threading.current_thread().name, self._current())
        with self._lock:
            self.calls.append(call)

    def _cuInit(self, flags: int) -> int:
        return CUDA_SUCCESS

    def _cuDeviceGet(self, device, ordinal: int) -> int:
        if not 0 <= ordinal < self._devices:
            return CUDA_ERROR_INVALID_VALUE
        device[0] = ordinal
        return CUDA_SUCCESS

    def _cuDeviceGetAttribute(self, value, attribute: int, device: int) -> int:
        value[0] = int(self._unified) if attribute == 91 else 0
        return CUDA_SUCCESS

    def _cuDevicePrimaryCtxRetain(self, context, device: int) -> int:
        self._log("cuDevicePrimaryCtxRetain", device)
        with self._lock:
            self.retained[device] = self.retained.get(device, 0) + 1
        context[0] = _CONTEXT_BASE + device
        return CUDA_SUCCESS

    def _cuDevicePrimaryCtxRelease_v2(self, device: int) -> int:
        with self._lock:
            self.retained[device] -= 1
        return CUDA_SUCCESS

    def _cuCtxPushCurrent_v2(self, context: int) -> int:
        self._stack().append(context)
        return CUDA_SUCCESS

    def _cuCtxPopCurrent_v2(self, context) -> int:
        stack = self._stack()
        if not stack:
            return CUDA_ERROR_INVALID_CONTEXT
        context[0] = stack.pop()
        return CUDA_SUCCESS

    def _cuMemHostRegister_v2(self, address: int, nbytes: int, flags: int) -> int:
        self._log("cuMemHostRegister_v2", address)
        if self._current() is None:
            return CUDA_ERROR_INVALID_CONTEXT
        if not self.gate.is_set():
            self.entered.set()
            self.gate.wait(10.0)
        with self._lock:
            if self.refuse_all or address in self.refuse:
                return CUDA_ERROR_OUT_OF_MEMORY
            if address in self.registered:
                return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
            self.registered[address] = nbytes
        return CUDA_SUCCESS

    def _cuMemHostGetDevicePointer_v2(self, pointer, address: int, flags: int) -> int:
        if self._current() is None:
            return CUDA_ERROR_INVALID_CONTEXT
        with self._lock:
            if not any(a <= address < a + n for a, n in self.registered.items()):
                return CUDA_ERROR_INVALID_VALUE
        pointer[0] = address
        return CUDA_SUCCESS

    def _cuMemHostUnregister(self, address: int) -> int:
        self._log("cuMemHostUnregister", address)
        if self._current() is None:
            return CUDA_ERROR_INVALID_CONTEXT
        with self._lock:
            if self.registered.pop(address, None) is None:
                return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
        return CUDA_SUCCESS

    def _cuGetErrorName(self, error: int, name) -> int:
        text = _NAMES.get(error)
        if text is None:
            return CUDA_ERROR_INVALID_VALUE
        name[0] = text
        return CUDA_SUCCESS
