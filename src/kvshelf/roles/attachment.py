"""A worker's attachment to one server boot: the server's arena mapped, with the copy engine
bound to it (built by whichever thread attaches, started by the step loop). No vLLM import.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from kvshelf.transfer import ArenaMapping, TransferEngine, map_arena

logger = logging.getLogger(__name__)


class Attachment:
    """The arena of one server boot, mapped, with the copy engine bound to it.

    The mapping is pre-faulted in the background when the server has allocated the whole arena
    (its default): otherwise every 4 KiB page would cost the first copy touching it a page
    fault. A server started with ``--no-prefault`` allocates memory only as pages are used,
    and populating the mapping would allocate all of it, so that arena faults on demand.

    Args:
        registration: the server's registration reply.
        new_engine: builds the copy engine on the mapped arena.
        cpus: cores for the prefault thread, or None.
    """

    def __init__(
        self,
        registration: Any,
        new_engine: Callable[[torch.Tensor], TransferEngine],
        cpus: frozenset[int] | None,
    ) -> None:
        self.boot_id: str = registration.boot_id
        self.mapping: ArenaMapping = map_arena(registration.shm_name, registration.arena_bytes)
        try:
            # A worker may attach inside vLLM's forward pass, under torch.inference_mode; the
            # arena's tensors and the views over the KV caches made there would be inference
            # tensors, which the store and load threads (not in that mode) may not write.
            with torch.inference_mode(False):
                self.engine = new_engine(self.mapping.buffer)
        except Exception as exc:
            # The traceback's frames still view the arena: drop them, then unmap it.
            error = exc.with_traceback(None)
        else:
            error = None
        if error is not None:
            self.mapping.close()
            raise error
        if self.mapping.allocated_bytes >= registration.arena_bytes:
            self.mapping.start_prefault(cpus)
        else:
            logger.debug(
                "kvshelf arena %s is not pre-allocated (server --no-prefault): pages fault in "
                "on first use",
                registration.shm_name,
            )

    def start_engine(self) -> None:
        """Start the engine (``TransferEngine.start``): the step loop's call, in each step,
        so that an engine built on the store thread makes no CUDA call while vLLM may be
        capturing CUDA graphs.

        Raises:
            UnsupportedKVCache: the engine cannot work here.
        """
        # vLLM's steps run under torch.inference_mode: see __init__.
        with torch.inference_mode(False):
            self.engine.start()

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            self.mapping.close()
