"""Which KV cache configurations kvshelf can store and load correctly, and why not the others.

kvshelf caches the KV cache groups whose kinds :mod:`kvshelf.roles.groups` knows: full
attention (every block holds its tokens' KV), sliding-window or chunked-local attention (only
the blocks inside the window hold KV; the others are null blocks, never stored or loaded), and
state-space layers (Mamba2, gated delta net, short convolutions) whose states vLLM checkpoints
at block boundaries (its mamba cache mode ``align``), alone or mixed, as vLLM's hybrid KV cache
manager groups them. A model whose groups have different block sizes, a state-space group in
another mamba cache mode, or any group of another kind (encoder-only or cross attention) is
refused: kvshelf would have to store and load blocks it does not know the meaning of. So is a
group whose blocks hold compressed states (several tokens per state, DeepSeek-V4's compressed
MLA and its indexer): a block then stands for other tokens than its hash.

Both connector roles ask, each with the ``KVCacheConfig`` vLLM gave it, and must refuse a model
with the same reason: a worker's config may wrap a group's specs where the scheduler's does not
(:func:`kvshelf.roles.groups.group_specs` reads through it).

No vLLM import: specs are recognised by their class names.
"""

from __future__ import annotations

from typing import Any

from kvshelf.roles.groups import SPEC_KINDS, GroupKind, group_specs


def unsupported_reason(kv_cache_config: Any) -> str | None:
    """Why kvshelf cannot cache this KV cache configuration, or None when it can.

    Args:
        kv_cache_config: vLLM's ``KVCacheConfig``, the scheduler's or a worker's.
    """
    specs = group_specs(kv_cache_config)
    if not specs:
        return "the model has no KV cache group"
    names = [type(spec).__name__ for spec in specs]
    others = sorted({name for name in names if name not in SPEC_KINDS})
    if others:
        return (
            f"its KV cache groups include {', '.join(others)} (of {len(specs)} groups: "
            f"{', '.join(names)}); kvshelf caches full, sliding-window and chunked-local "
            "attention and state-space layers only"
        )
    modes = sorted(
        {
            str(getattr(spec, "mamba_cache_mode", None))
            for spec in specs
            if SPEC_KINDS[type(spec).__name__] is GroupKind.STATE
        }
        - {"align"}
    )
    if modes:
        return (
            f"its state-space KV cache groups (MambaSpec) use mamba cache mode {', '.join(modes)}; "
            "kvshelf caches their states only in mode 'align', where vLLM hands the boundary "
            "states to the connector"
        )
    if any(getattr(spec, "num_speculative_blocks", 0) for spec in specs):
        # A hit's state goes into the block vLLM runs the request's state in, the last one;
        # with speculative blocks after it, kvshelf would have to know which one vLLM reads.
        return (
            "its state-space KV cache groups (MambaSpec) keep speculative decoding blocks; "
            "kvshelf caches state-space hybrids without speculative decoding only"
        )
    block_sizes = sorted({spec.block_size for spec in specs})
    if len(block_sizes) > 1:
        return f"its KV cache groups have different block sizes {block_sizes}; kvshelf needs one"
    compressed = sorted(
        {
            str(spec.tokens_per_state)
            for spec in specs
            if SPEC_KINDS[type(spec).__name__] is not GroupKind.STATE
            and getattr(spec, "tokens_per_state", 1) != 1
        }
    )
    if compressed:
        return (
            f"its KV cache groups hold compressed states ({', '.join(compressed)} tokens per "
            "state); kvshelf caches one state per token"
        )
    return None
