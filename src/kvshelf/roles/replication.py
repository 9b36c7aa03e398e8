"""Replicated KV caches: which of vLLM's KV ranks hold the same bytes, and which of them writes
each block.

vLLM gives tensor parallel ranks the same KV in two cases:

- **MLA** (``MLAAttentionSpec``, ``SlidingWindowMLASpec``): a layer caches one latent vector
  per token, projected by weights every rank holds whole, so every rank of a tensor parallel
  group caches the same latent;
- **fewer KV heads than ranks**: vLLM gives each rank one KV head, so ``tp / num_kv_heads``
  consecutive ranks hold the same head.

kvshelf stores such a cache once per group of replicas (``PageLayout.replicas``): a pool of
``world_size / replicas`` stored ranks, whose objects every replica reads. Within a group the
writes are spread over its ranks by block key, each writing about ``1 / replicas`` of them:
every rank then copies that share out of its own KV cache (its own device link, its own
memory bandwidth), where one writer per group would copy everything alone while the others
idle. Every rank still reports each store job (an empty share is done at once), so the
scheduler's accounting does not change.

Anything else (sharded KV heads, state-space layers, whose states vLLM shards by head,
context parallel, which splits a block's tokens over ranks) stays stored per rank.

No vLLM import: specs are recognised by their class names, configs read by attribute.
"""

from __future__ import annotations

from typing import Any

from kvshelf.plan import StoreJob
from kvshelf.roles.groups import SPEC_KINDS, GroupKind, group_specs

# vLLM's specs of MLA layers: one latent per token, the same on every tensor parallel rank.
MLA_SPECS = frozenset({"MLAAttentionSpec", "SlidingWindowMLASpec"})


def kv_replicas(vllm_config: Any, kv_cache_config: Any) -> int:
    """How many consecutive KV ranks hold the same KV bytes (1: every rank its own).

    vLLM (0.32 on) says it for the layers that declare it, MLA's
    (``KVCacheConfig.kv_tp_replicas``, the same for every layer); kvshelf adds the case vLLM
    does not declare: attention with fewer KV heads than tensor parallel ranks.

    Args:
        vllm_config: vLLM's ``VllmConfig`` (parallel sizes, the model's KV heads).
        kv_cache_config: vLLM's ``KVCacheConfig`` of a model kvshelf caches
            (:func:`kvshelf.roles.support.unsupported_reason` is None).
    """
    parallel = vllm_config.parallel_config
    tp = parallel.tensor_parallel_size
    specs = group_specs(kv_cache_config)
    names = [type(spec).__name__ for spec in specs]
    declared = getattr(kv_cache_config, "kv_tp_replicas", None)
    if declared is None and names and all(name in MLA_SPECS for name in names):
        declared = tp  # a vLLM that predates kv_tp_replicas: MLA's latent is on every rank
    if declared is not None and declared > 1:
        return declared
    if (
        tp == 1
        or getattr(parallel, "decode_context_parallel_size", 1) > 1
        or getattr(parallel, "prefill_context_parallel_size", 1) > 1
    ):
        # Context parallel gives each rank other tokens of a block: different bytes.
        return 1
    attention = (GroupKind.FULL, GroupKind.WINDOW)
    if any(name in MLA_SPECS or SPEC_KINDS.get(name) not in attention for name in names):
        # MLA that vLLM does not call replicated, or state-space groups (vLLM shards their
        # states by head): stored per rank.
        return 1
    total_heads = vllm_config.model_config.get_total_num_kv_heads()
    if total_heads >= tp or any(getattr(spec, "num_kv_heads", 0) != 1 for spec in specs):
        return 1
    # vLLM refuses a tensor parallel size that the KV heads do not divide.
    assert tp % total_heads == 0, f"{total_heads} KV heads on {tp} ranks"
    return tp // total_heads


def writes(rank: int, replicas: int, key: bytes) -> bool:
    """Whether ``rank`` writes the object of ``key`` for its group of replicas: the group's
    ranks take turns by the key's leading bytes (a digest, so the turns are even)."""
    return replicas == 1 or int.from_bytes(key[:8], "little") % replicas == rank % replicas


def own_share(job: StoreJob, rank: int, replicas: int) -> StoreJob:
    """The blocks of ``job`` that ``rank`` writes (all of them without replicas)."""
    if replicas == 1:
        return job
    kept = [
        (block_id, key)
        for block_id, key in zip(job.block_ids, job.block_hashes, strict=True)
        if writes(rank, replicas, key)
    ]
    return StoreJob(
        request_id=job.request_id,
        block_ids=tuple(block_id for block_id, _ in kept),
        block_hashes=tuple(key for _, key in kept),
        first_block=job.first_block,
        tenant=job.tenant,
    )
