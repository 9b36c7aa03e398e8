"""Eviction policies of the L1 tier, by name (``kvshelf server --eviction-policy``).

Must not import torch or vLLM.
"""

from __future__ import annotations

from kvshelf.server.policy.base import EvictionPolicy, PolicyPage
from kvshelf.server.policy.lru import LruPolicy
from kvshelf.server.policy.reuse import ReusePolicy

POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LruPolicy, ReusePolicy)}
# The default: the one that wins the trace replay (docs/cache-policy.md).
DEFAULT_POLICY = ReusePolicy.name

__all__ = ["DEFAULT_POLICY", "POLICIES", "EvictionPolicy", "LruPolicy", "PolicyPage", "ReusePolicy"]
