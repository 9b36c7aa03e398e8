"""A starting server's arena: adopt the newest dead arena of its port, or make a new one.

At start the server scans ``/dev/shm`` for arenas named for its port
(:func:`kvshelf.platform.ownership.scan`). One whose owner is provably dead (kvshelf's header,
its ownership lock free) and whose page table this server can read (same format version, same
capacity, checksums right) is adopted: renamed to the new arena name (workers map it by that
name once they re-register), and its pools, extents and pages rebuilt from the table
(:func:`rebuild`). Only COMMITTED pages become objects, loadable at once but quarantined from
eviction and reuse for a lease timeout; RESERVED and FILLING pages stay out of use as long
(:mod:`kvshelf.server.tiers.quarantine`). Every other dead arena of the port is removed, each
with one log line saying why; arenas whose owner cannot be proven gone are left alone and
reported in one line.

Must not import torch or vLLM.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvshelf.platform.ownership import ArenaFile, Owner, scan
from kvshelf.protocol import PageLayout
from kvshelf.server.page_table import (
    Geometry,
    PageRecord,
    SlotState,
    TableError,
    carries_header,
    decode_header,
    read_tail,
)
from kvshelf.server.pool import Pool
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.extents import MAX_PAGES_PER_EXTENT
from kvshelf.server.tiers.shared_memory import SharedMemoryArena

logger = logging.getLogger("kvshelf.server")


@dataclass
class AdoptedTable:
    """What an adopted arena's table holds, checked and grouped into extents.

    Attributes:
        source: the dead arena's name.
        pools: the recorded pools, their ``table_slot`` set.
        extents: ``(pool, records)`` of each extent, in address order.
        slots: every page slot in use.
        started: when the adoption started (``time.perf_counter``).
    """

    source: str
    pools: list[Pool]
    extents: list[tuple[Pool, list[PageRecord]]]
    slots: set[int]
    started: float


def open_arena(
    port: int, name: str, capacity: int, pool_slots: int, *, adopt: bool
) -> tuple[SharedMemoryArena, AdoptedTable | None]:
    """This server's arena: the newest adoptable dead arena of ``port``, or a new one.

    Args:
        port: the server's port.
        name: the new arena's name.
        capacity: the arena's size (``--l1-size-gb``).
        pool_slots: pool slots of a new arena's table.
        adopt: False (``--no-adopt``) removes every dead arena of the port instead.

    Raises:
        OSError: a new arena cannot be made.
    """
    found = list(scan(carries_header, port=port))
    unprovable = [f.name for f in found if f.owner is Owner.UNPROVABLE]
    if unprovable:
        logger.warning(
            "left alone %d arenas of port %d whose owner cannot be proven gone (no kvshelf "
            "ownership header: made by an older kvshelf?): %s; remove them by hand once no "
            "process uses them",
            len(unprovable),
            port,
            ", ".join(unprovable),
        )
    dead = sorted((f for f in found if f.owner is Owner.DEAD), key=lambda f: -f.mtime)
    adopted: tuple[SharedMemoryArena, AdoptedTable] | None = None
    for arena in dead:
        if adopted is None and adopt:
            adopted = _try_adopt(arena, name, capacity)
        else:
            why = "--no-adopt" if not adopt else "a newer one was adopted"
            logger.info("removed the dead server's arena %s (%s)", arena.path, why)
            arena.remove()
    if adopted is not None:
        return adopted
    return SharedMemoryArena(name, capacity, pool_slots=pool_slots), None


def _try_adopt(
    found: ArenaFile, name: str, capacity: int
) -> tuple[SharedMemoryArena, AdoptedTable] | None:
    """Adopt ``found`` (its lock held), or remove it with a log line saying why."""
    started = time.perf_counter()
    try:
        geometry = decode_header(read_tail(found.fd, found.size_bytes), found.size_bytes)
        if geometry.capacity != capacity:
            raise TableError(
                f"its size is {geometry.capacity} bytes and --l1-size-gb asks for {capacity}"
            )
        if geometry != Geometry.for_capacity(capacity, geometry.pool_slots):
            raise TableError("its page table has another number of page slots")
    except (TableError, OSError) as exc:
        logger.warning("removed the dead server's arena %s: cannot adopt it: %s", found.path, exc)
        found.remove()
        return None
    old_path = found.path
    try:
        memory = SharedMemoryArena.adopt(found, name, geometry)
    except OSError as exc:
        logger.warning("removed the dead server's arena %s: cannot rename it: %s", old_path, exc)
        found.remove()
        return None
    try:
        table = memory.table()
        adopted = _check(found.name, table.pools(), table.records(), capacity, started)
    except TableError as exc:
        logger.warning("removed the dead server's arena %s: cannot adopt it: %s", old_path, exc)
        memory.close()
        return None
    return memory, adopted


def _check(
    source: str,
    layouts: dict[int, PageLayout],
    records: list[PageRecord],
    capacity: int,
    started: float,
) -> AdoptedTable:
    """Check the records against their pools and the arena, and group them into extents.

    Raises:
        TableError: a record of no recorded pool, of another page size, misaligned, past the
            arena, overlapping another, or keyed with a rank out of its pool's range.
    """
    pools: dict[int, Pool] = {}
    for slot, layout in layouts.items():
        pool = Pool.of_layout(layout)
        pool.table_slot = slot
        pools[slot] = pool
    extents: list[tuple[Pool, list[PageRecord]]] = []
    end = 0
    for record in sorted(records, key=lambda r: r.offset):
        pool = pools.get(record.pool_slot)
        if pool is None:
            raise TableError(f"page record {record.slot} names no recorded pool")
        if (
            record.length != pool.page_bytes
            or record.offset % pool.page_bytes
            or record.offset < end
            or record.offset + record.length > capacity
            or record.rank >= pool.world_size
            or (record.state is SlotState.COMMITTED and record.rank < 0)
        ):
            raise TableError(f"page record {record.slot} does not fit its pool or the arena")
        last = extents[-1] if extents else None
        if (
            last is None
            or last[0] is not pool
            or last[1][-1].offset + pool.page_bytes != record.offset
            or len(last[1]) >= MAX_PAGES_PER_EXTENT
        ):
            extents.append((pool, [record]))
        else:
            last[1].append(record)
        end = record.offset + record.length
    return AdoptedTable(source, list(pools.values()), extents, {r.slot for r in records}, started)


def rebuild(arena: ArenaTier, adopted: AdoptedTable, quarantine_until: float) -> None:
    """Rebuild the adopted pools' extents and pages in ``arena`` (fresh, nothing allocated),
    and log one line: what was adopted, from where, how long it took."""
    objects = sum(arena.adopt_extent(pool, records) for pool, records in adopted.extents)
    arena.records.slots.mark(adopted.slots)
    arena.quarantine.until = quarantine_until
    arena.counters.add("adopted_objects_total", objects)
    logger.info(
        "adopted %d objects of %d pools from %s in %.2f s, %d pages quarantined",
        objects,
        len(adopted.pools),
        adopted.source,
        time.perf_counter() - adopted.started,
        len(arena.quarantine),
    )
