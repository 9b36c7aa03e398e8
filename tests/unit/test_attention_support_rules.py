"""Which KV cache configurations the connector accepts (kvshelf.roles.support), on vLLM's own
spec classes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvshelf.roles.groups import GroupKind, KVGroups
from kvshelf.roles.support import unsupported_reason

kv_cache_interface = pytest.importorskip("vllm.v1.kv_cache_interface")


def full(block_size: int = 32) -> object:
    return kv_cache_interface.FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float32
    )


def sliding(block_size: int = 32) -> object:
    return kv_cache_interface.SlidingWindowSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=64
    )


def mamba(mode: str = "align", speculative_blocks: int = 0) -> object:
    return kv_cache_interface.MambaSpec(
        block_size=96,
        shapes=((4, 8),),
        dtypes=(torch.float32,),
        mamba_cache_mode=mode,
        num_speculative_blocks=speculative_blocks,
    )


def config(*specs: object) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])


def test_full_sliding_and_their_mixes_are_supported() -> None:
    assert unsupported_reason(config(full())) is None
    assert unsupported_reason(config(sliding())) is None
    assert unsupported_reason(config(sliding(), sliding(), full())) is None
    groups = KVGroups.from_kv_cache_config(config(sliding(), full()))
    assert groups.kinds == (GroupKind.WINDOW, GroupKind.FULL)
    assert groups.frees_blocks_early


def test_state_space_groups_in_align_mode_are_supported() -> None:
    assert unsupported_reason(config(mamba(), mamba(), full(96))) is None
    groups = KVGroups.from_kv_cache_config(config(mamba(), mamba(), full(96)))
    assert groups.kinds == (GroupKind.STATE, GroupKind.STATE, GroupKind.FULL)
    assert groups.has_state and groups.frees_blocks_early and groups.block_keys == 1


@pytest.mark.parametrize(
    ("specs", "named"),
    [
        ((mamba("all"), full(96)), "mamba cache mode all"),
        ((mamba("none"), full(96)), "mamba cache mode none"),
        ((mamba(speculative_blocks=2), full(96)), "speculative decoding"),
        ((full(32), sliding(64)), "[32, 64]"),
    ],
)
def test_what_cannot_be_cached_right_is_refused_with_a_reason(
    specs: tuple[object, ...], named: str
) -> None:
    reason = unsupported_reason(config(*specs))
    assert reason is not None and named in reason
