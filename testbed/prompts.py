"""Deterministic prompts as token id lists, so that token counts (and block counts) are exact.

Prompts are lists of ints; wrap one as ``{"prompt_token_ids": ids}`` (see `tokens_prompts`) to
pass it to vLLM, whose ``TokensPrompt`` is that dict. Random ids stay clear of the special and
reserved tokens of the models in `testbed.models`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

FIRST_ORDINARY_ID = 3
"""Ids below this are bos, eos and pad in the models that `testbed.models` builds."""

ORDINARY_VOCAB = 1024
"""Default upper bound (exclusive) of random ids: trained BPE tokens in every preset, clear of
the reserved tokens that pad a vocabulary."""


class Encoder(Protocol):
    """Anything with a Hugging Face style ``encode``, e.g. a ``PreTrainedTokenizerFast``."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]:
        """Encode ``text`` into token ids."""
        ...


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """Prompts made of a shared document followed by a distinct question each.

    Attributes:
        prefixes: The shared documents, one per group.
        prompts: All prompts, group after group: ``prefixes[g] + suffix``.
        group_of: For each prompt, the index of its prefix in ``prefixes``.
    """

    prefixes: list[list[int]]
    prompts: list[list[int]]
    group_of: list[int]


def random_tokens(
    num_tokens: int,
    *,
    seed: int | str = 0,
    vocab_size: int = ORDINARY_VOCAB,
) -> list[int]:
    """Return ``num_tokens`` pseudo-random ordinary token ids, the same for the same seed.

    Args:
        num_tokens: Exact length of the result.
        seed: Any int or string; equal seeds give equal lists in every process.
        vocab_size: Upper bound (exclusive) of the ids; at most the model's vocabulary size.

    Returns:
        Ids in ``[FIRST_ORDINARY_ID, vocab_size)``.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if vocab_size <= FIRST_ORDINARY_ID:
        raise ValueError(f"vocab_size out of range: {vocab_size}")
    rng = random.Random(f"kvshelf-prompt:{seed}")
    return [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(num_tokens)]


def shared_prefix_workload(
    *,
    num_prefixes: int = 1,
    prompts_per_prefix: int = 4,
    prefix_len: int = 512,
    suffix_len: int = 32,
    seed: int | str = 0,
    vocab_size: int = ORDINARY_VOCAB,
) -> SharedPrefixWorkload:
    """Build groups of prompts that share a long prefix (a "system prompt" or document).

    Every prompt is exactly ``prefix_len + suffix_len`` tokens long. Prefixes of different groups
    differ from their first token, so they share no block with each other.

    Args:
        num_prefixes: Number of groups (distinct prefixes).
        prompts_per_prefix: Prompts in each group.
        prefix_len: Tokens of each shared prefix; a multiple of the block size makes every prefix
            block cacheable.
        suffix_len: Tokens of each prompt's own suffix.
        seed: Seed of the whole workload.
        vocab_size: Upper bound (exclusive) of the ids.

    Returns:
        The prefixes, the prompts in group order, and each prompt's group.
    """
    prefixes = [
        _distinct_start(
            random_tokens(prefix_len, seed=f"{seed}:prefix:{g}", vocab_size=vocab_size),
            g,
            vocab_size,
        )
        for g in range(num_prefixes)
    ]
    prompts: list[list[int]] = []
    group_of: list[int] = []
    for g, prefix in enumerate(prefixes):
        for i in range(prompts_per_prefix):
            suffix = random_tokens(suffix_len, seed=f"{seed}:suffix:{g}:{i}", vocab_size=vocab_size)
            prompts.append(prefix + suffix)
            group_of.append(g)
    return SharedPrefixWorkload(prefixes=prefixes, prompts=prompts, group_of=group_of)


def shared_prefix_prompts(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    *,
    seed: int | str = 0,
    vocab_size: int = ORDINARY_VOCAB,
) -> list[list[int]]:
    """Return ``num_prompts`` prompts that share one prefix of ``prefix_len`` tokens.

    Args:
        num_prompts: Number of prompts.
        prefix_len: Tokens of the shared prefix.
        suffix_len: Tokens of each prompt's distinct suffix.
        seed: Seed of the prompts.
        vocab_size: Upper bound (exclusive) of the ids.

    Returns:
        Prompts of exactly ``prefix_len + suffix_len`` tokens each.
    """
    return shared_prefix_workload(
        num_prefixes=1,
        prompts_per_prefix=num_prompts,
        prefix_len=prefix_len,
        suffix_len=suffix_len,
        seed=seed,
        vocab_size=vocab_size,
    ).prompts


def loadable_tokens(prompt: Sequence[int], block_size: int) -> int:
    """Prompt tokens a connector's hit can cover: every full block but the one holding the
    prompt's last token, which vLLM computes (kvshelf's hits stop a block short, as vLLM's own
    prefix cache does)."""
    return (len(prompt) - 1) // block_size * block_size


def tokens_of_length(encoder: Encoder, text: str, num_tokens: int) -> list[int]:
    """Encode ``text`` and repeat or cut it to exactly ``num_tokens`` ids.

    Args:
        encoder: A tokenizer; special tokens are not added.
        text: Non-empty text whose encoding is repeated as often as needed.
        num_tokens: Exact length of the result.

    Returns:
        The first ``num_tokens`` ids of the encoding of ``text`` repeated.
    """
    ids = encoder.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError("text encodes to no tokens")
    repeats = -(-num_tokens // len(ids))
    return (ids * repeats)[:num_tokens]


def tokens_prompts(prompts: Sequence[Sequence[int]]) -> list[dict[str, list[int]]]:
    """Wrap token id lists as vLLM ``TokensPrompt`` dicts.

    Args:
        prompts: Token id lists.

    Returns:
        ``[{"prompt_token_ids": [...]}, ...]``, accepted by ``vllm.LLM.generate``.
    """
    return [{"prompt_token_ids": list(ids)} for ids in prompts]


def _distinct_start(ids: list[int], group: int, vocab_size: int) -> list[int]:
    """Make the first token encode the group, so that prefixes of groups never share a block.

    Args:
        ids: A prefix; changed in place.
        group: Its group index.
        vocab_size: Upper bound (exclusive) of the ids.

    Returns:
        ``ids``.
    """
    if ids:
        span = vocab_size - FIRST_ORDINARY_ID
        if group >= span:
            raise ValueError(f"at most {span} prefixes with vocab_size {vocab_size}")
        ids[0] = FIRST_ORDINARY_ID + group
    return ids
