"""Which KV cache configurations kvshelf can store and load correctly, and why not the others.

kvshelf caches the KV cache groups whose kinds :mod:`kvshelf.roles.groups` knows: full
attention (every block holds its tokens' KV), sliding-window or chunked-local attention (only
the blocks inside the window hold KV; the others are null blocks, never stored or loaded), and
state-space layers (Mamba2, gated delta net, short convolutions) whose states vLLM checkpoints
at block boundaries (its mamba cache mode ``align``), alone or mixed, as vLLM's hybrid KV cache
manager groups them. A model whose groups have different block sizes, a state-space group in
another mamba cache mode, or any group of another kind (encoder-only or cross attention) is
refused: kvshelf would have to store and load blocks it does not know the meaning of.

No vLLM import: specs are recognised by their class names.
"""

from __future__ import annotations

from typing import Any

from kvshelf.roles.groups import SPEC_KINDS, GroupKind


def unsupported_reason(kv_cache_config: Any) -> str | None:
    """Why kvshelf cannot cache this KV cache configuration, or None when it can.

    Args:
        kv_cache_config: vLLM's ``KVCacheConfig``.
    """
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        return "the model has no KV cache group"
    names = [type(group.kv_cache_spec).__name__ for group in groups]
    others = sorted({name for name in names if name not in SPEC_KINDS})
    if others:
        return (
            f"its KV cache groups include {', '.join(others)} (of {len(groups)} groups: "
            f"{', '.join(names)}); kvshelf caches full, sliding-window and chunked-local "
            "attention and state-space layers only"
        )
    modes = sorted(
        {
            str(getattr(group.kv_cache_spec, "mamba_cache_mode", None))
            for group in groups
            if SPEC_KINDS[type(group.kv_cache_spec).__name__] is GroupKind.STATE
        }
        - {"align"}
    )
    if modes:
        return (
            f"its state-space KV cache groups (MambaSpec) use mamba cache mode {', '.join(modes)}; "
            "kvshelf caches their states only in mode 'align', where vLLM hands the boundary "
            "states to the connector"
        )
    if any(getattr(group.kv_cache_spec, "num_speculative_blocks", 0) for group in groups):
        # A hit's state goes into the block vLLM runs the request's state in, the last one;
        # with speculative blocks after it, kvshelf would have to know which one vLLM reads.
        return (
            "its state-space KV cache groups (MambaSpec) keep speculative decoding blocks; "
            "kvshelf caches state-space hybrids without speculative decoding only"
        )
    block_sizes = sorted({group.kv_cache_spec.block_size for group in groups})
    if len(block_sizes) > 1:
        return f"its KV cache groups have different block sizes {block_sizes}; kvshelf needs one"
    return None
