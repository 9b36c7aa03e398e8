"""Worker-side KV block copies between vLLM's KV cache and the server's shared-memory arena.

Nothing here imports vLLM: the engines see only torch tensors.
"""

from kvshelf.transfer.engine import (
    COMPLETED,
    CompletedTransfer,
    CpuTransferEngine,
    TransferEngine,
    TransferHandle,
)
from kvshelf.transfer.layout import (
    PAGE_ALIGN_BYTES,
    KVCacheLayout,
    LayerLayout,
    detect_block_dim,
)
from kvshelf.transfer.mapping import ArenaMapping, map_arena

__all__ = [
    "COMPLETED",
    "PAGE_ALIGN_BYTES",
    "ArenaMapping",
    "CompletedTransfer",
    "CpuTransferEngine",
    "KVCacheLayout",
    "LayerLayout",
    "TransferEngine",
    "TransferHandle",
    "detect_block_dim",
    "map_arena",
]
