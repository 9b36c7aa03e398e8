"""Which KV cache configurations the connector accepts (kvshelf.roles.support)."""

from __future__ import annotations

from types import SimpleNamespace

from kvshelf.roles.support import unsupported_reason


class FullAttentionSpec:
    pass


class MLAAttentionSpec(FullAttentionSpec):
    pass


class SlidingWindowSpec:
    pass


class MambaSpec:
    pass


def config(*specs: object) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])


def test_one_full_attention_group_is_supported() -> None:
    assert unsupported_reason(config(FullAttentionSpec())) is None
    assert unsupported_reason(config(MLAAttentionSpec())) is None


def test_sliding_window_and_several_groups_are_refused_with_a_reason() -> None:
    sliding = unsupported_reason(config(SlidingWindowSpec()))
    assert sliding is not None and "SlidingWindowSpec" in sliding
    several = unsupported_reason(config(FullAttentionSpec(), SlidingWindowSpec()))
    assert several is not None and "2 KV cache groups" in several
    assert unsupported_reason(config(MambaSpec())) is not None
