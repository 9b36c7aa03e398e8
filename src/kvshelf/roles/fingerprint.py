"""Stable fingerprints of the model and of its KV cache layout.

Both connector roles compute them from vLLM's config alone, so that the scheduler can look up
pages that workers in other processes (or other engines) stored. They must never depend on
the process, the run or the number of blocks.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def _digest(fields: Any) -> str:
    encoded = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(encoded).hexdigest()[:32]


def model_fingerprint(vllm_config: Any) -> str:
    """Identify the weights and numerics that produce the KV cache.

    Args:
        vllm_config: vLLM's ``VllmConfig``.

    Returns:
        A hex digest over the model name, revision, dtype and quantization.
    """
    model_config = vllm_config.model_config
    return _digest(
        {
            "model": model_config.model,
            "revision": getattr(model_config, "revision", None),
            "dtype": str(model_config.dtype),
            "quantization": getattr(model_config, "quantization", None),
        }
    )


def layout_fingerprint(vllm_config: Any, kv_cache_config: Any) -> str:
    """Identify the byte layout of one KV block of one rank.

    Args:
        vllm_config: vLLM's ``VllmConfig`` (device type).
        kv_cache_config: vLLM's ``KVCacheConfig`` (groups, specs, layer names).

    Returns:
        A hex digest over everything that decides a page's bytes, except the block count.
    """
    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append(
            {
                "spec": type(spec).__name__,
                "block_size": spec.block_size,
                "num_kv_heads": getattr(spec, "num_kv_heads", None),
                "head_size": getattr(spec, "head_size", None),
                "head_size_v": getattr(spec, "head_size_v", None),
                "dtype": str(getattr(spec, "dtype", None)),
                "layers": list(group.layer_names),
            }
        )
    return _digest(
        {
            "device": vllm_config.device_config.device_type,
            "kv_cache_layout": getattr(kv_cache_config, "kv_cache_layout", None),
            "groups": groups,
        }
    )
