"""kvshelf's KV events in vLLM's own types: block descriptions from vLLM requests, and
``kvshelf.roles.events``' records as ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``.

The descriptions use vLLM's own helpers, so that a kvshelf event describes a block exactly as
vLLM's GPU event for the same block does: the same hash (``maybe_convert_block_hash``), the
same parent, tokens, LoRA name and extra keys. Only the medium differs (``CPU``, ``STORAGE``).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from kvshelf.client import KVShelfClient
from kvshelf.roles.events import (
    CPU,
    STORAGE,
    BlockInfo,
    Cleared,
    Event,
    EventReader,
    EventTracker,
    Removed,
    Stored,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.v1.request import Request

# vLLM's medium names for kvshelf's.
_MEDIUM = {CPU: MEDIUM_CPU, STORAGE: MEDIUM_STORAGE}


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config`` with events on)."""
    config = vllm_config.kv_events_config
    return config is not None and bool(config.enable_kv_cache_events)


def make_tracker(
    make_client: Callable[[], KVShelfClient], pool: str, block_size: int, world_size: int
) -> EventTracker:
    """The scheduler role's event tracker, reading ``pool``'s log with a client of its own."""
    reader = EventReader(make_client(), pool, world_size=world_size)
    return EventTracker(reader, partial(describe_blocks, block_size))


def describe_blocks(block_size: int, request: Request, start: int, end: int) -> list[BlockInfo]:
    """Describe blocks ``[start, end)`` of ``request`` as vLLM's BlockStored events do."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    lora = request.lora_request
    lora_name, lora_id = (lora.name, lora.adapter_id) if lora else (None, None)
    blocks = []
    mm_index = 0
    for i in range(start, end):
        first = i * block_size
        keys, mm_index = generate_block_hash_extra_keys(
            request, first, first + block_size, mm_index
        )
        event_keys = to_event_extra_keys([keys])
        blocks.append(
            BlockInfo(
                parent=bytes(hashes[i - 1]) if i > 0 else None,
                token_ids=tuple(tokens[first : first + block_size]),
                lora_name=lora_name,
                extra_keys=None if event_keys is None else event_keys[0],
                lora_id=lora_id,
            )
        )
    return blocks


def to_vllm(events: list[Event], block_size: int) -> list[KVCacheEvent]:
    """vLLM's events for kvshelf's records."""
    out: list[KVCacheEvent] = []
    for event in events:
        if isinstance(event, Stored):
            out.append(
                BlockStored(
                    block_hashes=[maybe_convert_block_hash(h) for h in event.hashes],
                    parent_block_hash=(
                        None if event.parent is None else maybe_convert_block_hash(event.parent)
                    ),
                    token_ids=event.token_ids,
                    block_size=block_size,
                    lora_id=event.lora_id,
                    medium=_MEDIUM[event.medium],
                    lora_name=event.lora_name,
                    extra_keys=event.extra_keys,
                    group_idx=0,
                )
            )
        elif isinstance(event, Removed):
            out.append(
                BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(h) for h in event.hashes],
                    medium=_MEDIUM[event.medium],
                    group_idx=0,
                )
            )
        else:
            assert isinstance(event, Cleared)
            out.append(AllBlocksCleared())
    return out
