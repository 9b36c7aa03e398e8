"""The copy-engine factory picks the engine by the KV cache tensors' device."""

from __future__ import annotations

import pytest
import torch

from kvshelf.transfer import (
    CpuTransferEngine,
    KVCacheLayout,
    UnsupportedKVCache,
    engine_for,
    register_engine,
)

NUM_BLOCKS = 8


def test_cpu_kv_caches_get_the_cpu_engine() -> None:
    caches = {f"layer{i}": torch.zeros(NUM_BLOCKS, 2, 16, 32) for i in range(2)}
    layout = KVCacheLayout.from_kv_caches(caches, NUM_BLOCKS)
    arena = torch.zeros(4 * layout.page_bytes, dtype=torch.uint8)
    engine = engine_for(caches)(caches, layout, arena)
    assert isinstance(engine, CpuTransferEngine)
    engine.close()


def test_a_device_without_an_engine_is_named_in_a_clear_error() -> None:
    caches = {"layer0": torch.empty(NUM_BLOCKS, 2, 16, 32, device="meta")}
    with pytest.raises(UnsupportedKVCache, match="KV caches on meta; copy engines exist for"):
        engine_for(caches)
    assert issubclass(UnsupportedKVCache, ValueError)


@pytest.mark.parametrize(
    "caches",
    [
        {},
        {"a": torch.zeros(NUM_BLOCKS, 4), "b": torch.empty(NUM_BLOCKS, 4, device="meta")},
    ],
    ids=["no tensors", "two devices"],
)
def test_kv_caches_on_no_single_device_are_unsupported(caches) -> None:
    with pytest.raises(UnsupportedKVCache, match="one device per worker"):
        engine_for(caches)


def test_a_device_type_has_one_engine() -> None:
    register_engine("cpu", CpuTransferEngine)  # the same engine again is harmless
    with pytest.raises(ValueError, match="already registered"):
        register_engine(
            "cpu", lambda kv_caches, layout, arena: CpuTransferEngine(kv_caches, layout, arena)
        )
