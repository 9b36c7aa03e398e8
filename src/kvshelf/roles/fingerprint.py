"""Stable fingerprints of the model and of its KV cache layout.

Both connector roles compute them from vLLM's config alone, so that the scheduler can look up
pages that workers in other processes (or other engines) stored. They must never depend on
the process, the run or the number of blocks. The weights' digest is in
:mod:`kvshelf.roles.weights`. No vLLM import: they read vLLM's config objects by attribute.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from typing import Any

from kvshelf.connector_config import MODEL_ID, KVShelfConfig
from kvshelf.roles.groups import group_specs
from kvshelf.roles.weights import weights_digest

logger = logging.getLogger(__name__)


def _digest(fields: Any) -> str:
    encoded = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(encoded).hexdigest()[:32]


# Fields of vLLM's ModelConfig that change the KV values beyond the HF config itself.
_MODEL_FIELDS = ("dtype", "quantization", "override_attention_dtype", "hf_overrides")
# Fields of vLLM's CacheConfig that change how the KV values are stored or rounded.
_CACHE_FIELDS = ("cache_dtype", "block_size", "calculate_kv_scales", "kv_cache_dtype_skip_layers")
# HF config keys that name where the model was read from, not what it computes.
_PATH_KEYS = ("_name_or_path", "name_or_path", "_commit_hash")


def model_fingerprint(vllm_config: Any, config: KVShelfConfig) -> str:
    """Identify everything that determines the KV values a model computes.

    The model's config as vLLM resolved it (the HF config after ``hf_overrides``: rope
    scaling, sliding windows, ...), dtype, quantization, KV cache dtype and block size, and
    the weights: ``kvshelf.model_id`` when set, else a digest of the weight files
    (``kvshelf.weights_digest``, :mod:`kvshelf.roles.weights`). The model's path is not part
    of it: the same weights copied elsewhere share their KV, other weights at the same path
    do not. LoRA adapters need nothing here: vLLM puts the adapter's name and path in the
    block hashes.

    Args:
        vllm_config: vLLM's ``VllmConfig``.
        config: the connector's config (model id, digest mode).

    Returns:
        A hex digest.

    Raises:
        ValueError: the weights can neither be read nor are named by ``kvshelf.model_id``.
    """
    model_config = vllm_config.model_config
    hf_config = model_config.hf_config
    resolved = hf_config.to_dict() if hasattr(hf_config, "to_dict") else vars(hf_config)
    return _digest(
        {
            "hf_config": {k: v for k, v in resolved.items() if k not in _PATH_KEYS},
            "model": {name: _stable(getattr(model_config, name, None)) for name in _MODEL_FIELDS},
            "cache": {
                name: getattr(vllm_config.cache_config, name, None) for name in _CACHE_FIELDS
            },
            "weights": _weights_identity(model_config, vllm_config.load_config, config),
        }
    )


def _stable(value: Any) -> Any:
    """A callable (``hf_overrides`` may be one) by its name, never by its address."""
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value)}"
    return value


def new_epoch() -> str:
    """A fresh identity epoch: random, so that no two engines' epochs collide."""
    return secrets.token_hex(16)


def with_epoch(model_fp: str, epoch: str) -> str:
    """The model identity of an epoch: ``model_fp`` itself for the first epoch ("").

    vLLM calls the connector's ``reset_cache()`` after it changed the weights in place (it
    has no other hook for that): from then on the engine's pages belong to a pool of their
    own, which no other engine and no earlier epoch shares.
    """
    return _digest([model_fp, epoch]) if epoch else model_fp


def _weights_identity(model_config: Any, load_config: Any, config: KVShelfConfig) -> list[str]:
    if config.model_id is not None:
        return ["model_id", config.model_id]
    path = _local_model_path(model_config, load_config)
    if path is None:
        raise ValueError(
            f"kvshelf cannot read the weights of {model_config.model!r} to identify them; "
            f"set {MODEL_ID} to a name for these weights (e.g. the checkpoint revision)"
        )
    started = time.perf_counter()
    digest = weights_digest(path, config.weights_digest)
    logger.info(
        "kvshelf weights digest (%s) of %s in %.2f s",
        config.weights_digest,
        path,
        time.perf_counter() - started,
    )
    return [config.weights_digest, digest]


def _local_model_path(model_config: Any, load_config: Any) -> str | None:
    """The local folder (or file) vLLM loads the weights from, if there is one."""
    model = str(model_config.model)
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model,
            revision=getattr(model_config, "revision", None),
            cache_dir=getattr(load_config, "download_dir", None),
            local_files_only=True,
        )
    except Exception as exc:
        logger.debug("no local snapshot of %s: %s", model, exc)
        return None


def layout_fingerprint(vllm_config: Any, kv_cache_config: Any) -> str:
    """Identify the byte layout of one KV block of one rank.

    Args:
        vllm_config: vLLM's ``VllmConfig`` (device type).
        kv_cache_config: vLLM's ``KVCacheConfig`` (groups, specs, layer names).

    Returns:
        A hex digest over everything that decides a page's bytes, except the block count.
    """
    groups = []
    for group, spec in zip(
        kv_cache_config.kv_cache_groups, group_specs(kv_cache_config), strict=True
    ):
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
