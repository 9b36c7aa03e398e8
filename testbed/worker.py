"""Driving the worker role (``kvshelf.roles.worker``) against a real server, as tests and the GPU
check do: store blocks through it, then look them up locked, as the scheduler would.

Imports no vLLM and no torch (the worker is passed in).
"""

from __future__ import annotations

from typing import Any

from kvshelf.client import LookupResult
from kvshelf.plan import StoreJob
from testbed.server import ServerProcess


def store_and_lock(
    worker: Any,
    server: ServerProcess,
    blocks: tuple[int, ...],
    hashes: tuple[bytes, ...] | None = None,
    request_id: str = "stored",
) -> LookupResult:
    """Store ``blocks`` through ``worker`` (a ``WorkerConnector``) and wait for the store;
    return their pages, locked, as a lookup gives them to the scheduler.

    Args:
        hashes: the blocks' hashes (default: ``b"h<block>"``).

    Raises:
        AssertionError: the server does not hold every block afterwards.
    """
    hashes = hashes if hashes is not None else tuple(b"h%d" % b for b in blocks)
    worker.submit_stores([StoreJob(request_id, blocks, hashes, 0)])
    worker.flush_stores()
    with server.client(timeout_s=30.0) as client:
        hit = client.lookup(worker.pool, list(hashes), world_size=1, lock=True)
    assert hit.num_hit_blocks == len(blocks), (hit.num_hit_blocks, len(blocks))
    return hit
