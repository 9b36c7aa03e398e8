"""What one request may cost the socket loop: the bound on the objects it names, and the scan
that looks keys up within it.

A lookup looks each of its keys up in every rank's table of its pool, and so does an events
probe: its cost is keys x ranks, *objects*. A request over
:data:`~kvshelf.protocol.MAX_OBJECTS_PER_REQUEST` is refused before any of that work
(:func:`check_objects`); within it, :func:`held_prefix` looks each distinct key up once, so a
key repeated throughout a request costs one look-up. Together they bound the time one request
holds the loop, whatever a client sends (docs/safety.md, "Bounds").

Must not import torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshelf.protocol import MAX_OBJECTS_PER_REQUEST, ErrorCode, max_request_keys
from kvshelf.server.leases import RequestRejected
from kvshelf.server.pool import EntryState, Pool


def check_objects(field: str, num_keys: int, world_size: int) -> None:
    """Refuse a request that names ``num_keys`` keys (in ``field``) of ``world_size`` ranks
    when that is over :data:`~kvshelf.protocol.MAX_OBJECTS_PER_REQUEST`.

    Raises:
        RequestRejected: INVALID_ARGUMENT, naming the field and the bound.
    """
    if num_keys * world_size > MAX_OBJECTS_PER_REQUEST:
        raise RequestRejected(
            ErrorCode.INVALID_ARGUMENT,
            f"{field} holds {num_keys} keys of {world_size} ranks, more than the "
            f"{max_request_keys(world_size)} keys ({MAX_OBJECTS_PER_REQUEST} objects) "
            "one request may name",
        )


def held_prefix(pool: Pool, keys: Sequence[bytes], below_l1: bool = False) -> int:
    """How many leading ``keys`` the pool holds for every rank: COMMITTED in L1, or with
    ``below_l1`` also STORED by a tier below L1 (loadable by a fetch).

    Each distinct key is looked up once (a repeated key is held as it was the first time), and
    the scan stops at the first key some rank lacks.
    """
    tables = pool.tables
    held: set[bytes] = set()
    for i, key in enumerate(keys):
        if key in held:
            continue
        for table in tables:
            entry = table.get(key)
            if entry is None or not (
                entry.state is EntryState.COMMITTED
                or (below_l1 and entry.state is EntryState.STORED)
            ):
                return i
        held.add(key)
    return len(keys)
