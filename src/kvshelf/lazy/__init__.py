"""Lazy offload: buffer store work and submit it in batches after requests finish.

No vLLM import anywhere in this package: the connector hands it vLLM's block pool through
``VllmBlockPoolView`` and it is unit-testable alone. The offloader (``kvshelf.lazy.offloader``)
is the one entry point the connector calls.
"""

from __future__ import annotations

from typing import Any

from kvshelf.lazy.base import OffloadPolicy, PendingStoreItem
from kvshelf.lazy.eviction_aware import EvictionAwarePolicy
from kvshelf.lazy.fifo import FIFOOffloadPolicy
from kvshelf.lazy.pool import BlockPoolView, VllmBlockPoolView

# Policy name, as written in lmcache.mp.lazy_offload_policy (matched exactly), -> class.
POLICIES: dict[str, type[OffloadPolicy]] = {
    "FIFO": FIFOOffloadPolicy,
    "EVICTION_AWARE": EvictionAwarePolicy,
}


def create_policy(
    name: str, threshold: int, *, block_pool: BlockPoolView | None = None, **options: Any
) -> OffloadPolicy:
    """Build the offload policy registered under ``name``.

    Args:
        name: the policy name, e.g. "FIFO".
        threshold: the ready count that triggers an offload.
        block_pool: the GPU block pool, for policies that inspect it.
        options: policy-specific settings (e.g. ``eviction_window``).

    Returns:
        The new policy.

    Raises:
        ValueError: for an unknown name or a threshold that is not a positive integer.
    """
    policy_cls = POLICIES.get(name)
    if policy_cls is None:
        raise ValueError(f"Unknown offload policy: {name}")
    return policy_cls.create(threshold, block_pool, **options)


__all__ = [
    "POLICIES",
    "BlockPoolView",
    "EvictionAwarePolicy",
    "FIFOOffloadPolicy",
    "OffloadPolicy",
    "PendingStoreItem",
    "VllmBlockPoolView",
    "create_policy",
]
