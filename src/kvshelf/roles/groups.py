"""vLLM's KV cache groups as kvshelf caches them: which kinds there are, how a group's block is
keyed, and which of a request's blocks a store or a load covers in each group.

With vLLM's hybrid KV cache manager a model's layers fall into KV cache groups, each with its
own spec and its own block table over one shared block pool (a block id belongs to one group
at a time, and the groups' layers alias the same memory). kvshelf caches two kinds:

- **full** (``FullAttentionSpec``, ``MLAAttentionSpec``): every block of a request holds its
  tokens' KV, as with one group;
- **window** (``SlidingWindowSpec``, ``SlidingWindowMLASpec``, ``ChunkedLocalAttentionSpec``):
  vLLM keeps only the blocks inside the window (or chunk) that ends at the request's length;
  the others are its null block, which holds nothing. kvshelf stores every block such a group
  held when it was computed (any later hit can end at any block, and its window is then a
  different set of blocks), never a null block, and loads only the blocks vLLM allocated for
  a hit, which are exactly those inside the window ending at the hit.

Every other kind (state-space groups, encoder or cross attention) is refused by
:mod:`kvshelf.roles.support` before this module is used.

Keys: with one group a block's key is vLLM's block hash, as it always was. With several, the
key of block ``i`` in group ``g`` is a digest of (``g``, the block hash), so objects of
different groups never mix. A lookup asks for every group's key of each block, block after
block; the server's longest prefix then covers whole blocks only when every group holds them.

No vLLM import: specs are recognised by their class names.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# vLLM's BlockPool takes block 0 as its null block, which stands for every block a window
# group skips; it is never stored or loaded.
NULL_BLOCK_ID = 0

# The length of a derived key (blake2b digest): as long as vLLM's sha256 block hashes.
_KEY_BYTES = 32


class GroupKind(enum.Enum):
    """What a KV cache group's blocks hold."""

    FULL = "full"
    WINDOW = "window"


# vLLM spec class name -> the kind kvshelf caches it as.
SPEC_KINDS = {
    "FullAttentionSpec": GroupKind.FULL,
    "MLAAttentionSpec": GroupKind.FULL,
    "SlidingWindowSpec": GroupKind.WINDOW,
    "SlidingWindowMLASpec": GroupKind.WINDOW,
    "ChunkedLocalAttentionSpec": GroupKind.WINDOW,
}


@dataclass(frozen=True)
class KVGroups:
    """The KV cache groups of one model, in vLLM's group order.

    Attributes:
        kinds: each group's kind.
    """

    kinds: tuple[GroupKind, ...]

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any) -> KVGroups:
        """The groups of vLLM's ``KVCacheConfig``; every spec must be in ``SPEC_KINDS``
        (:func:`kvshelf.roles.support.unsupported_reason` says so first)."""
        return cls(
            tuple(
                SPEC_KINDS[type(group.kv_cache_spec).__name__]
                for group in kv_cache_config.kv_cache_groups
            )
        )

    @property
    def num_groups(self) -> int:
        return len(self.kinds)

    @property
    def frees_blocks_early(self) -> bool:
        """Whether vLLM frees some of a running request's blocks (those a window left):
        a store of such a block must be copied before vLLM can reuse it."""
        return GroupKind.WINDOW in self.kinds

    def key(self, group: int, block_hash: bytes) -> bytes:
        """The server key of the block with ``block_hash`` in ``group``."""
        if self.num_groups == 1:
            return block_hash
        return hashlib.blake2b(
            block_hash, digest_size=_KEY_BYTES, salt=group.to_bytes(16, "little")
        ).digest()

    def lookup_keys(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """The keys a lookup of these blocks asks for: block by block, each group's key.

        Object ``i * num_groups + g`` of the lookup is block ``i`` of group ``g``, so that the
        server's longest prefix, divided by ``num_groups``, is the blocks every group holds.
        """
        if self.num_groups == 1:
            return [bytes(h) for h in block_hashes]
        return [self.key(g, bytes(h)) for h in block_hashes for g in range(self.num_groups)]

    def store_slots(
        self,
        block_ids: Sequence[Sequence[int]],
        block_hashes: Sequence[bytes],
        start: int,
        end: int,
    ) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
        """The blocks ``[start, end)`` of a request to store: their ids and keys, block by
        block, each group's; a group's null block (a window skipped it) is left out.

        Args:
            block_ids: the request's block ids per group (vLLM's order).
            block_hashes: the request's block hashes.
            start, end: the range of blocks.
        """
        ids: list[int] = []
        keys: list[bytes] = []
        for i in range(start, end):
            block_hash = bytes(block_hashes[i])
            for g in range(self.num_groups):
                block_id = block_ids[g][i]
                if block_id != NULL_BLOCK_ID:
                    ids.append(block_id)
                    keys.append(self.key(g, block_hash))
        return tuple(ids), tuple(keys)

    def load_slots(
        self, block_ids: Sequence[Sequence[int]], start: int, end: int
    ) -> list[tuple[int, int]]:
        """The blocks of ``[start, end)`` vLLM allocated for a hit, as ``(object index in the
        lookup, block id)``: each group's non-null blocks (a window group's null blocks are
        outside the window that ends at the hit, and are not loaded)."""
        slots: list[tuple[int, int]] = []
        for i in range(start, end):
            for g in range(self.num_groups):
                block_id = block_ids[g][i]
                if block_id != NULL_BLOCK_ID:
                    slots.append((i * self.num_groups + g, block_id))
        return slots


ONE_FULL_GROUP = KVGroups((GroupKind.FULL,))
"""A model with one full-attention group (and the groups a test harness assumes)."""
