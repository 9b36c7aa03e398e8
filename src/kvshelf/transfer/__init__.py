"""Worker-side KV block copies between vLLM's KV cache and the server's shared-memory arena.

``base`` is the interface the worker uses, ``cpu`` the CPU engine, ``cuda`` the CUDA engine
(``streams``: its stream/event ordering, with a CPU fake; ``pinned``: the arena registered as
pinned memory), ``factory`` picks an engine by the KV cache tensors' device; ``layout`` packs
blocks into pages, ``views`` shapes both sides of a copy alike, and ``mapping`` maps the
arena. Importing this package registers every engine with the factory. Nothing here imports
vLLM: the engines see only torch tensors.
"""

from kvshelf.transfer.base import (
    COMPLETED,
    CompletedTransfer,
    IndexLike,
    LayerwiseLoad,
    NotReady,
    TransferEngine,
    TransferHandle,
)
from kvshelf.transfer.cpu import CpuLayerwiseLoad, CpuTransferEngine
from kvshelf.transfer.cuda import CudaLayerwiseLoad, CudaTransferEngine
from kvshelf.transfer.factory import (
    EngineFactory,
    UnsupportedKVCache,
    engine_for,
    engine_override,
    register_engine,
)
from kvshelf.transfer.layout import (
    PAGE_ALIGN_BYTES,
    KVCacheLayout,
    LayerLayout,
    detect_block_dim,
    distinct_layers,
)
from kvshelf.transfer.mapping import ArenaMapping, map_arena

__all__ = [
    "COMPLETED",
    "PAGE_ALIGN_BYTES",
    "ArenaMapping",
    "CompletedTransfer",
    "CpuLayerwiseLoad",
    "CpuTransferEngine",
    "CudaLayerwiseLoad",
    "CudaTransferEngine",
    "EngineFactory",
    "IndexLike",
    "KVCacheLayout",
    "LayerLayout",
    "LayerwiseLoad",
    "NotReady",
    "TransferEngine",
    "TransferHandle",
    "UnsupportedKVCache",
    "detect_block_dim",
    "distinct_layers",
    "engine_for",
    "engine_override",
    "map_arena",
    "register_engine",
]
