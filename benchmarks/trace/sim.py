"""The replay in process: a trace's demands through one pool's policy, block by block.

The server's own policies (:mod:`kvshelf.server.policy`) run here unchanged, on stand-in pages,
driven as the arena tier drives them: a lookup's hits touched (deepest first), its first
missing block reported (:meth:`~kvshelf.server.policy.EvictionPolicy.missed`), then the
request's missing blocks stored, evicting to stay within ``capacity`` pages. This is where the
``reuse`` policy was designed; :mod:`.server_replay` checks the same through a real server.

Must not import torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.trace.reference import Arc, Belady, ReferencePolicy, S3Fifo
from benchmarks.trace.traces import BLOCK_TOKENS, Demand
from kvshelf.server.policy import POLICIES, EvictionPolicy

REFERENCE = ("s3fifo", "arc", "belady")


class _Page:
    """A stand-in for a server page: what a policy reads and writes."""

    __slots__ = ("block_hash", "location", "stamp")

    def __init__(self, location: int, block_hash: bytes) -> None:
        self.location = location
        self.block_hash = block_hash
        self.stamp = 0


class ServerPolicyCache(ReferencePolicy):
    """A pool of ``capacity`` pages evicted by one of the server's policies."""

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        self.policy = policy
        self.capacity = capacity
        self.pages: dict[int, _Page] = {}

    def contains(self, block: int) -> bool:
        return block in self.pages

    def lookup_missed(self, block: int) -> None:
        self.policy.missed(block.to_bytes(8, "little"))

    def access(self, blocks: Sequence[int], hits: int) -> None:
        policy, pages = self.policy, self.pages
        for block in reversed(blocks[:hits]):
            policy.touch(pages[block])
        # The store: pages present are touched (hits first), the rest are taken, then added.
        new = []
        for block in blocks[hits:]:
            page = pages.get(block)
            if page is not None:
                policy.touch(page)
            else:
                new.append(block)
        for block in new:
            if len(pages) >= self.capacity:
                victim = policy.pop_victim()
                del pages[victim.location]
            page = _Page(block, block.to_bytes(8, "little"))
            pages[block] = page
        for block in reversed(new):
            policy.add(pages[block])


def make_cache(name: str, capacity: int, stream: Sequence[Demand]) -> ReferencePolicy:
    """A cache of ``capacity`` blocks: a server policy by name, or a reference one."""
    if name in POLICIES:
        return ServerPolicyCache(POLICIES[name](), capacity)
    if name == "s3fifo":
        return S3Fifo(capacity)
    if name == "arc":
        return Arc(capacity)
    if name == "belady":
        return Belady(capacity, stream)
    raise ValueError(f"policy {name!r}: not one of {sorted(POLICIES) + list(REFERENCE)}")


def replay(stream: Sequence[Demand], cache: ReferencePolicy) -> dict[str, int]:
    """Hit tokens and requested tokens of ``stream`` through ``cache``."""
    hit_tokens = demand_tokens = all_tokens = 0
    missed = getattr(cache, "lookup_missed", None)
    for demand in stream:
        blocks = demand.blocks
        hits = 0
        while hits < len(blocks) and cache.contains(blocks[hits]):
            hits += 1
        if hits < len(blocks) and missed is not None:
            missed(blocks[hits])
        cache.access(blocks, hits)
        hit_tokens += hits * BLOCK_TOKENS
        demand_tokens += len(blocks) * BLOCK_TOKENS
        all_tokens += demand.tokens
    return {"hit_tokens": hit_tokens, "demand_tokens": demand_tokens, "tokens": all_tokens}
