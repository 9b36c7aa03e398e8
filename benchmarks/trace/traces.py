"""The Mooncake FAST'25 traces as a kvshelf server would see them behind vLLM.

A trace line is a request: ``input_length`` tokens and ``hash_ids``, one id per 512-token block,
equal ids meaning an equal prefix block. vLLM hashes (and so caches, and asks kvshelf about)
full blocks only, so a request's partial last block is never looked up nor stored; it still
counts in the tokens of the request.

vLLM's own prefix cache sits in front: an LRU of ``vllm_blocks`` blocks over every request.
A request's longest prefix in it never reaches kvshelf; kvshelf is asked for the rest of the
full blocks (the *demand*), hits the longest prefix of the demand it holds, and is sent the
blocks after that to store.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512
TRACES_DIR = Path(os.environ.get("KVSHELF_TRACES", "/work/shared/data/traces"))
TRACE_NAMES = ("conversation", "synthetic")
# vLLM's prefix cache in blocks of 512 tokens: 128 is 64 Ki tokens, about the KV cache of an
# 8B model on a 24 GiB GPU.
DEFAULT_VLLM_BLOCKS = 128


@dataclass(frozen=True)
class Demand:
    """What one request asks of kvshelf: ``blocks`` (chain order), out of ``tokens``."""

    blocks: tuple[int, ...]
    tokens: int


def trace_path(name: str) -> Path:
    return TRACES_DIR / f"{name}_trace.jsonl"


def load_requests(name: str, limit: int | None = None) -> list[tuple[tuple[int, ...], int]]:
    """The requests of trace ``name``: (full blocks' ids, input tokens), in trace order."""
    path = trace_path(name)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such trace (set KVSHELF_TRACES to its folder)")
    requests = []
    with path.open() as lines:
        for line in lines:
            record = json.loads(line)
            tokens = int(record["input_length"])
            requests.append((tuple(record["hash_ids"][: tokens // BLOCK_TOKENS]), tokens))
            if limit is not None and len(requests) == limit:
                break
    return requests


def demands(requests: list[tuple[tuple[int, ...], int]], vllm_blocks: int) -> list[Demand]:
    """Each request's demand on kvshelf behind vLLM's prefix cache of ``vllm_blocks``."""
    front: OrderedDict[int, None] = OrderedDict()
    out = []
    for blocks, tokens in requests:
        local = 0
        if vllm_blocks:
            while local < len(blocks) and blocks[local] in front:
                local += 1
            # The request computes or loads every block; vLLM frees a chain tail first.
            for block in reversed(blocks):
                front[block] = None
                front.move_to_end(block)
            while len(front) > vllm_blocks:
                front.popitem(last=False)
        out.append(Demand(blocks[local:], tokens))
    return out
