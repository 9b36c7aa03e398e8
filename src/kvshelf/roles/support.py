"""Which KV cache configurations kvshelf can store and load correctly, and why not the others.

kvshelf keys, stores and loads the blocks of one KV cache group in which every block of a
request holds its tokens' KV: full attention. That includes vLLM's merge of a mixed
sliding-window/full model into one full-attention group, which vLLM makes because kvshelf's
connector does not declare ``SupportsHMA``: every layer then keeps the KV of every token (only
the compute is windowed), so every stored block is valid. Anything else is refused: several
groups (hybrid models with vLLM's hybrid manager, Mamba), and a group of sliding-window or
chunked-local layers (e.g. an all-sliding-window, Mistral-like model), whose blocks outside the
window are null blocks vLLM never fills, so a stored block could hold no KV at all.

No vLLM import: specs are recognised by their class names.
"""

from __future__ import annotations

from typing import Any

# vLLM's KV cache spec classes whose blocks always hold the KV of all their tokens.
SUPPORTED_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})


def unsupported_reason(kv_cache_config: Any) -> str | None:
    """Why kvshelf cannot cache this KV cache configuration, or None when it can.

    Args:
        kv_cache_config: vLLM's ``KVCacheConfig``.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = ", ".join(type(group.kv_cache_spec).__name__ for group in groups)
        return f"the model has {len(groups)} KV cache groups ({kinds}); kvshelf handles one"
    spec = groups[0].kv_cache_spec
    name = type(spec).__name__
    if name not in SUPPORTED_SPECS:
        return (
            f"its KV cache is {name} (e.g. every layer a sliding window): blocks outside the "
            "window hold no KV, so kvshelf could store or load invalid blocks"
        )
    return None
