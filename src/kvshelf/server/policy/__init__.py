"""Eviction policies of the L1 and disk tiers, by name (``kvshelf server --eviction-policy``,
``--l2-disk-eviction-policy``).

Must not import torch or vLLM.
"""

from __future__ import annotations

from kvshelf.server.policy.base import EvictionPolicy, PolicyPage
from kvshelf.server.policy.lru import LruPolicy
from kvshelf.server.policy.reuse import ReusePolicy

POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LruPolicy, ReusePolicy)}
# The default: the one that wins the trace replay (docs/cache-policy.md).
DEFAULT_POLICY = ReusePolicy.name
"""L1's policy without a disk tier, and the disk tier's."""

DEFAULT_POLICY_ABOVE_DISK = LruPolicy.name
"""L1's policy with a disk tier behind it. The disk holds a superset of L1 and keeps what is
reused over minutes (``reuse``); L1 then serves recency, which LRU keeps best: on the
Mooncake traces replayed through L1 and a disk of 4 x L1 (docs/cache-policy.md), ``reuse`` in
both tiers fell to 0.996 x LRU-in-both at 16,000 blocks; LRU above a ``reuse`` disk was 1.001 x
to 2.26 x in every row."""

__all__ = [
    "DEFAULT_POLICY",
    "DEFAULT_POLICY_ABOVE_DISK",
    "POLICIES",
    "EvictionPolicy",
    "LruPolicy",
    "PolicyPage",
    "ReusePolicy",
]
