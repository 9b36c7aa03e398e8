"""Where a hit may end for a model whose state-space layers keep their state at a few block
boundaries only: the server's half of ``Lookup.ends``.

A full-attention block is there for every block of a prefix; a state-space layer's state is
kept (by vLLM, and so by kvshelf) only at the boundaries vLLM checkpointed, e.g. the last
block boundary of each prompt. A hit of ``n`` blocks needs the prefix's keys of blocks
``0..n-1`` (``block_keys`` per block) *and* the state keys at boundary ``n`` (``ends[n-1]``),
so it is not a prefix of one key list: this module picks ``n`` from what the pool's tiers hold,
and the lookup then runs on ``hashes[:n * block_keys] + ends[n - 1]`` as on any other list.

Owns that choice and the checks of a lookup's ``ends``; the index and the tiers know nothing of
it. Must not import torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshelf.protocol import MAX_HASHES_PER_REQUEST, ErrorCode
from kvshelf.server.leases import RequestRejected
from kvshelf.server.pool import Pool
from kvshelf.server.request_cost import held_prefix


def check_ends(hashes: Sequence[bytes], block_keys: int, ends: Sequence[Sequence[bytes]]) -> None:
    """Reject a lookup whose ``ends`` do not describe its ``hashes``.

    Raises:
        RequestRejected: INVALID_ARGUMENT, naming the field.
    """
    if len(hashes) != block_keys * len(ends):
        raise RequestRejected(
            ErrorCode.INVALID_ARGUMENT,
            f"hashes holds {len(hashes)} keys, not block_keys ({block_keys}) per block of "
            f"ends ({len(ends)} blocks)",
        )
    total = sum(len(keys) for keys in ends)
    if total > MAX_HASHES_PER_REQUEST:
        raise RequestRejected(
            ErrorCode.INVALID_ARGUMENT,
            f"ends holds {total} keys, more than {MAX_HASHES_PER_REQUEST}",
        )


def choose_end(
    pool: Pool | None,
    hashes: Sequence[bytes],
    block_keys: int,
    ends: Sequence[Sequence[bytes]],
    fetch: bool = True,
) -> tuple[list[bytes], int]:
    """The keys to look up and the block the hit would end after (:func:`check_ends` first).

    The longest hit whose keys this server's tiers all hold (with ``fetch``, L1 or below: a
    lookup then loads the ones below L1; without it, L1 only, as the lookup answers from L1);
    when there is none, the longest one ``ends`` allows, so that the lookup still asks the
    tiers that only a fetch can ask (a shared tier) and counts the miss.

    Returns:
        ``(keys, n)``: ``hashes[:n * block_keys] + ends[n - 1]``; ``([], 0)`` when no block of
        ``ends`` has a key.
    """
    candidates = [n for n in range(len(ends), 0, -1) if ends[n - 1]]
    if not candidates:
        return [], 0
    if pool is not None:
        held_keys = held_prefix(pool, hashes, below_l1=fetch)
        held_blocks = held_keys // block_keys if block_keys else len(ends)
        for n in candidates:
            state = ends[n - 1]
            if n <= held_blocks and held_prefix(pool, state, below_l1=fetch) == len(state):
                return [*hashes[: n * block_keys], *state], n
    n = candidates[0]
    return [*hashes[: n * block_keys], *ends[n - 1]], n
