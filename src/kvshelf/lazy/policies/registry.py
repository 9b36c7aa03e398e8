"""The policy registry: which class each ``lmcache.mp.lazy_offload_policy`` name builds.

The accepted names are declared (and validated) in ``kvshelf.connector_config``; this module
maps each to its class and is the one place that imports every policy. A new policy gets a module in
this package, a name in ``kvshelf.connector_config.LAZY_OFFLOAD_POLICIES`` and an entry here.
"""

from __future__ import annotations

from typing import Any

from kvshelf.connector_config import EVICTION_AWARE_POLICY, FIFO_POLICY
from kvshelf.lazy.block_pool_view import BlockPoolView
from kvshelf.lazy.policies.base import OffloadPolicy
from kvshelf.lazy.policies.eviction_aware import EvictionAwarePolicy
from kvshelf.lazy.policies.fifo import FIFOOffloadPolicy

# Policy name, as written in lmcache.mp.lazy_offload_policy (matched exactly), -> class.
POLICIES: dict[str, type[OffloadPolicy]] = {
    FIFO_POLICY: FIFOOffloadPolicy,
    EVICTION_AWARE_POLICY: EvictionAwarePolicy,
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
