"""Choosing the copy engine for a KV cache: a registry of engines by torch device type.

Each engine module registers its engine for the device type it copies from when it is imported
(``register_engine("cpu", CpuTransferEngine)``), and :mod:`kvshelf.transfer` imports every
engine module, so a new engine (CUDA) plugs in as one more module and one more import there.
The worker asks :func:`engine_for` once, when vLLM registers its KV caches.

Imports no engine module (they import this one) and no vLLM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch

from kvshelf.transfer.base import TransferEngine
from kvshelf.transfer.layout import KVCacheLayout

EngineFactory = Callable[[Mapping[str, torch.Tensor], KVCacheLayout, torch.Tensor], TransferEngine]
"""Builds an engine from ``(kv_caches, layout, arena)``, the arena a 1-D uint8 CPU tensor."""

_ENGINES: dict[str, EngineFactory] = {}


class UnsupportedKVCache(ValueError):
    """No registered engine can copy this KV cache (its device, or its tensors on several)."""


def register_engine(device_type: str, factory: EngineFactory) -> None:
    """Make ``factory`` the engine for KV caches on devices of type ``device_type``.

    Raises:
        ValueError: another engine is already registered for that device type.
    """
    current = _ENGINES.setdefault(device_type, factory)
    if current is not factory:
        raise ValueError(f"a copy engine for {device_type!r} tensors is already registered")


@contextlib.contextmanager
def engine_override(device_type: str, factory: EngineFactory) -> Iterator[None]:
    """Use ``factory`` for ``device_type`` tensors inside the ``with`` block, then restore.

    For tests and the GPU check's dry run, which drive one engine's code with another device's
    tensors (the CUDA engine on CPU tensors with fake streams).
    """
    previous = _ENGINES.get(device_type)
    _ENGINES[device_type] = factory
    try:
        yield
    finally:
        if previous is None:
            del _ENGINES[device_type]
        else:
            _ENGINES[device_type] = previous


def engine_for(kv_caches: Mapping[str, torch.Tensor]) -> EngineFactory:
    """Return the engine factory for these KV cache tensors' device.

    Args:
        kv_caches: layer name -> KV cache tensor.

    Raises:
        UnsupportedKVCache: no tensors, tensors on more than one device, or a device type no
            engine is registered for; the message names the devices.
    """
    devices = sorted({str(tensor.device) for tensor in kv_caches.values()})
    if len(devices) != 1:
        raise UnsupportedKVCache(
            f"KV caches on {', '.join(devices) or 'no device'}; one device per worker is needed"
        )
    device_type = torch.device(devices[0]).type
    factory = _ENGINES.get(device_type)
    if factory is None:
        raise UnsupportedKVCache(
            f"KV caches on {devices[0]}; copy engines exist for "
            f"{', '.join(sorted(_ENGINES))} tensors only"
        )
    return factory
