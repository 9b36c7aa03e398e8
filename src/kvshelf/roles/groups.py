"""vLLM's KV cache groups as kvshelf caches them: which kinds there are, how a group's block is
keyed, and which of a request's blocks a store or a load covers in each group.

With vLLM's hybrid KV cache manager a model's layers fall into KV cache groups, each with its
own spec and its own block table over one shared block pool (a block id belongs to one group
at a time, and the groups' layers alias the same memory). kvshelf caches three kinds:

- **full** (``FullAttentionSpec``, ``MLAAttentionSpec``): every block of a request holds its
  tokens' KV, as with one group;
- **window** (``SlidingWindowSpec``, ``SlidingWindowMLASpec``, ``ChunkedLocalAttentionSpec``):
  vLLM keeps only the blocks inside the window (or chunk) that ends at the request's length;
  the others are its null block, which holds nothing. kvshelf stores every block such a group
  held when it was computed (any later hit can end at any block, and its window is then a
  different set of blocks), never a null block, and loads only the blocks vLLM allocated for
  a hit, which are exactly those inside the window ending at the hit.
- **state** (``MambaSpec``: Mamba2, gated delta net, short convolutions, with vLLM's mamba
  cache mode ``align``): a block holds the layers' recurrent state at one block boundary, and
  vLLM keeps such a state only at the boundaries it checkpoints (the last one of a prompt,
  the end of a prefill chunk). vLLM hands each checkpoint to the connector (its
  ``boundary_state_offloads``); kvshelf stores exactly those, never a block of the group's
  table (which holds running states, not boundary ones). A hit of ``n`` blocks loads the
  state at boundary ``n`` into the one block vLLM allocates for it (index ``n - 1``).

Every other kind (encoder or cross attention) is refused by :mod:`kvshelf.roles.support`
before this module is used.

Keys: with one group a block's key is vLLM's block hash, as it always was. With several, the
key of block ``i`` in group ``g`` is a digest of (``g``, the block hash), so objects of
different groups never mix. A lookup asks for the attention groups' keys of each block, block
after block (the server's longest prefix then covers whole blocks only when every such group
holds them); with state groups it also gives, per block, the state keys at the boundary after
it, and the server ends the hit where it holds them (``Lookup.ends``).

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
    STATE = "state"


# vLLM spec class name -> the kind kvshelf caches it as.
SPEC_KINDS = {
    "FullAttentionSpec": GroupKind.FULL,
    "MLAAttentionSpec": GroupKind.FULL,
    "SlidingWindowSpec": GroupKind.WINDOW,
    "SlidingWindowMLASpec": GroupKind.WINDOW,
    "ChunkedLocalAttentionSpec": GroupKind.WINDOW,
    "MambaSpec": GroupKind.STATE,
}


def group_specs(kv_cache_config: Any) -> list[Any]:
    """Each KV cache group's spec, as vLLM's scheduler sees it.

    A worker's ``KVCacheConfig`` may hold a ``UniformTypeKVCacheSpecs`` (layers of one kind
    whose sizes differ, e.g. MLA's latent and a sparse indexer's keys in one group) where the
    scheduler's holds the spec of its first layer (vLLM's
    ``generate_scheduler_kv_cache_config``). Reading through it, both roles decide, key and
    fingerprint a model alike.
    """
    specs = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if type(spec).__name__ == "UniformTypeKVCacheSpecs":
            spec = next(iter(spec.kv_cache_specs.values()))
        specs.append(spec)
    return specs


@dataclass(frozen=True)
class LookupKeys:
    """What a lookup of a request's blocks asks for (:class:`~kvshelf.protocol.Lookup`).

    Attributes:
        hashes: the attention groups' keys, ``block_keys`` per block, block after block.
        block_keys: keys per block in ``hashes``.
        ends: with state groups, per block the state keys at the boundary after it; else
            empty (the hit is the longest prefix).
    """

    hashes: list[bytes]
    block_keys: int
    ends: list[list[bytes]]


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
        return cls(tuple(SPEC_KINDS[type(spec).__name__] for spec in group_specs(kv_cache_config)))

    @property
    def num_groups(self) -> int:
        return len(self.kinds)

    @property
    def block_keys(self) -> int:
        """Keys per block in a lookup's prefix: one per attention (full or window) group."""
        return sum(kind is not GroupKind.STATE for kind in self.kinds)

    @property
    def has_state(self) -> bool:
        """Whether some group holds state-space states (a hit ends only at a boundary whose
        states are stored, and never past the prompt's last token)."""
        return GroupKind.STATE in self.kinds

    @property
    def frees_blocks_early(self) -> bool:
        """Whether vLLM frees some of a running request's blocks (those a window left, the
        checkpoints a state group moved past): a store of such a block must be copied before
        vLLM can reuse it."""
        return GroupKind.WINDOW in self.kinds or GroupKind.STATE in self.kinds

    def key(self, group: int, block_hash: bytes) -> bytes:
        """The server key of the block with ``block_hash`` in ``group``."""
        if self.num_groups == 1:
            return block_hash
        return hashlib.blake2b(
            block_hash, digest_size=_KEY_BYTES, salt=group.to_bytes(16, "little")
        ).digest()

    def lookup_keys(self, block_hashes: Sequence[bytes]) -> LookupKeys:
        """The keys a lookup of these blocks asks for.

        Object ``i * block_keys + a`` of the lookup is block ``i`` of the ``a``-th attention
        group, so that the server's longest prefix, divided by ``block_keys``, is the blocks
        every attention group holds. With state groups, a hit of ``n`` blocks is followed by
        the state groups' keys at boundary ``n``, in group order.
        """
        hashes = [bytes(h) for h in block_hashes]
        if self.num_groups == 1 and not self.has_state:
            return LookupKeys(hashes, 1, [])
        attention = [g for g, kind in enumerate(self.kinds) if kind is not GroupKind.STATE]
        states = [g for g, kind in enumerate(self.kinds) if kind is GroupKind.STATE]
        keys = [self.key(g, h) for h in hashes for g in attention]
        ends = [[self.key(g, h) for g in states] for h in hashes] if states else []
        return LookupKeys(keys, len(attention), ends)

    def store_slots(
        self,
        block_ids: Sequence[Sequence[int]],
        block_hashes: Sequence[bytes],
        start: int,
        end: int,
    ) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
        """The blocks ``[start, end)`` of a request to store: their ids and keys, block by
        block, each attention group's; a group's null block (a window skipped it) is left out,
        and so are state groups (their boundary states come from :meth:`state_slots`).

        Args:
            block_ids: the request's block ids per group (vLLM's order).
            block_hashes: the request's block hashes.
            start, end: the range of blocks.
        """
        ids: list[int] = []
        keys: list[bytes] = []
        for i in range(start, end):
            block_hash = bytes(block_hashes[i])
            for g, kind in enumerate(self.kinds):
                block_id = block_ids[g][i]
                if block_id != NULL_BLOCK_ID and kind is not GroupKind.STATE:
                    ids.append(block_id)
                    keys.append(self.key(g, block_hash))
        return tuple(ids), tuple(keys)

    def state_slots(
        self,
        checkpoints: Sequence[tuple[int, int, int]],
        block_hashes: Sequence[bytes],
        block_size: int,
    ) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
        """The boundary states vLLM handed over for a request, to store: ids and keys.

        Args:
            checkpoints: ``(group, block id, boundary in tokens)`` (vLLM's
                ``boundary_state_offloads`` of the request).
            block_hashes: the request's block hashes; the state at boundary ``b`` is keyed by
                the hash of the block ending there.
            block_size: tokens per block.

        A checkpoint off a block boundary, past the request's hashed blocks, or of a group
        that is not a state group is left out.
        """
        ids: list[int] = []
        keys: list[bytes] = []
        for group, block_id, boundary in checkpoints:
            index = boundary // block_size - 1
            if (
                boundary % block_size
                or not 0 <= index < len(block_hashes)
                or not 0 <= group < self.num_groups
                or self.kinds[group] is not GroupKind.STATE
                or block_id == NULL_BLOCK_ID
            ):
                continue
            ids.append(block_id)
            keys.append(self.key(group, bytes(block_hashes[index])))
        return tuple(ids), tuple(keys)

    def window_block_ids(
        self, block_ids: Sequence[Sequence[int]], start: int, end: int
    ) -> tuple[int, ...]:
        """The non-null blocks ``[start, end)`` of the window groups: those vLLM may free
        while the request runs (lazy offload captures them as they are computed)."""
        return tuple(
            block_id
            for i in range(start, end)
            for g, kind in enumerate(self.kinds)
            if kind is GroupKind.WINDOW and (block_id := block_ids[g][i]) != NULL_BLOCK_ID
        )

    def load_slots(
        self, block_ids: Sequence[Sequence[int]], start: int, end: int
    ) -> list[tuple[int, int]]:
        """The blocks vLLM allocated for a hit of ``end`` blocks, from ``start`` on, as
        ``(object index in the lookup, block id)``: each attention group's non-null blocks of
        ``[start, end)`` (a window group's null blocks are outside the window that ends at the
        hit, and are not loaded), then each state group's state at boundary ``end``, into the
        block vLLM allocated at index ``end - 1`` and into the request's last block.

        The last block is where vLLM's forward pass reads a request's state from, and vLLM
        fills it (copying the state at ``end - 1``) before the connector's loads start: the
        state goes into both, so that the forward pass starts from it and vLLM's prefix cache
        keeps it at its boundary."""
        block_keys = self.block_keys
        slots: list[tuple[int, int]] = []
        for i in range(start, end):
            a = 0
            for g, kind in enumerate(self.kinds):
                if kind is GroupKind.STATE:
                    continue
                block_id = block_ids[g][i]
                if block_id != NULL_BLOCK_ID:
                    slots.append((i * block_keys + a, block_id))
                a += 1
        s = 0
        for g, kind in enumerate(self.kinds):
            if kind is GroupKind.STATE:
                boundary_block, running_block = block_ids[g][end - 1], block_ids[g][-1]
                assert boundary_block != NULL_BLOCK_ID, "vLLM allocates the hit's state block"
                slots.append((end * block_keys + s, boundary_block))
                if running_block not in (boundary_block, NULL_BLOCK_ID):
                    slots.append((end * block_keys + s, running_block))
                s += 1
        return slots


ONE_FULL_GROUP = KVGroups((GroupKind.FULL,))
"""A model with one full-attention group (and the groups a test harness assumes)."""
