"""The prompts of the TTFT rows: measured prompts, hit sizes, floor prompts, the control's.

Token-id lists only (`testbed.prompts`); nothing here starts a process.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.e2e.peers import LMCACHE_CHUNK_SIZE
from testbed.prompts import random_tokens


def hit_candidates(prompt_len: int, block_size: int) -> list[int]:
    """Return the sizes a cache hit of a whole stored prompt can have, largest first.

    A hit covers whole blocks (kvshelf) or whole 256-token chunks (LMCache) and never the last
    token: it stops before the granule of the last token (kvshelf always, as vLLM's own prefix
    cache), or, for a prompt of whole granules, may load them all and leave only the last
    token to compute. The hit run measures a floor for each
    candidate and keeps the one that computes as many tokens as the hit did.

    Args:
        prompt_len: Prompt tokens.
        block_size: vLLM's block size.

    Returns:
        Distinct candidate ``num_cached_tokens`` values.
    """
    sizes = set()
    for granule in (block_size, LMCACHE_CHUNK_SIZE):
        sizes.add((prompt_len - 1) // granule * granule)
        sizes.add(min(prompt_len - 1, prompt_len // granule * granule))
    return sorted(sizes, reverse=True)


def ttft_prompts(lengths: Sequence[int], count: int) -> list[list[int]]:
    """Return ``count`` distinct random prompts per length, lengths interleaved.

    Args:
        lengths: Prompt lengths.
        count: Prompts per length.

    Returns:
        Prompts in the order ``[l0 #0, l1 #0, ..., l0 #1, ...]``.
    """
    return [
        random_tokens(length, seed=f"e2e:{length}:{i}") for i in range(count) for length in lengths
    ]


def floor_prompt(prompt: list[int], cached: int, block_size: int, seed: str) -> list[int]:
    """Return the floor's prompt for a hit of ``cached`` tokens of ``prompt``.

    Run in an engine that has just run ``prompt``, the floor prompt finds at least ``cached``
    tokens in the local prefix cache (whole blocks: ``cached`` rounded up to a block) and
    computes as many tokens as the hit did, so its TTFT is the hit's without the load. It is
    ``prompt``'s first blocks followed by new tokens; it is one token longer than ``prompt``
    when the hit computed only the last token of a block-aligned prompt.

    Args:
        prompt: A prompt.
        cached: Tokens the hit loads.
        block_size: vLLM's block size.
        seed: Seed of the new tokens.

    Returns:
        The floor prompt.
    """
    local = -(-cached // block_size) * block_size
    computed = len(prompt) - cached
    return prompt[:local] + random_tokens(computed, seed=f"e2e-floor:{seed}")


def control_prompts(prompts: list[list[int]], lengths: Sequence[int]) -> list[list[int]]:
    """Return the prompts the control measures: those of ``lengths``, else all of them.

    The control only reads the pairing's own noise; measuring it at one length (the targets')
    keeps the run under its time budget.

    Args:
        prompts: The measured prompts.
        lengths: `E2EConfig.control_lengths`.

    Returns:
        A sub-list of ``prompts``, in their order.
    """
    return [p for p in prompts if len(p) in lengths] or prompts
