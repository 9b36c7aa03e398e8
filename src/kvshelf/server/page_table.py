"""The page table inside the arena: the on-memory format a restarted server adopts pages from.

The shared-memory object is ``capacity`` bytes of pages followed by a trailer that workers never
map (they map ``capacity`` bytes only)::

    [ pages: capacity bytes ][ pool table ][ page records ][ header: HEADER_BYTES ]

- The **header**, at the very end of the object (found from the file size alone), marks the
  object as an arena made by this kvshelf: magic, format version, capacity, record size, number
  of page slots, number of pool slots, pool record size, and an xxh3 checksum of those fields.
- The **pool table**: one fixed-size record per pool slot: its layout (``PageLayout``, msgspec
  MessagePack), its length and a checksum.
- The **page records**: one fixed-size record per page *slot*. A slot is a dense number handed
  to a page when its extent is made and taken back when the extent is returned, so the table
  memory touched grows with the pages that exist, not with the arena. A record holds the page's
  state byte; its place (pool slot, byte offset, length) with a checksum, written once when
  the extent is made; and its key (generation, rank, block hash) with a checksum, written
  when the page gets a key.

Write order (the arena tier writes, on the socket loop): fields and their checksum first, the
state byte last. A page's key is written while its state still says FREE (or FILLING), then
the state becomes RESERVED, before the reservation's reply hands the page to a writer; the
commit (which the writer sends after its copy) changes the state byte alone to COMMITTED;
eviction and abort set it back to FREE. A one-byte store cannot tear, so a torn key reads as
the state before it; a COMMITTED record whose key, or any record whose place, fails its
checksum means the table was overwritten, and nothing in it is trusted. There is no checksum
of the page *data*: it would cost a pass over every stored byte on the store path, and a
COMMITTED state already says the writer finished its copy.

Must not import torch or vLLM.
"""

from __future__ import annotations

import enum
import os
import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import msgspec
import xxhash

from kvshelf.protocol import MAX_HASH_BYTES, PageLayout

MAGIC = b"KVSHELF\x00"
FORMAT_VERSION = 1
# magic, version, header bytes, capacity, record bytes, page slots, pool slots, pool record
# bytes; then the checksum of those.
_HEADER = struct.Struct("<8sIIQIQII")
_CHECKSUM = struct.Struct("<Q")
HEADER_BYTES = 64
# A page record, two parts with a checksum each:
# - where the page is (written once, when its extent is made): pool slot u16 + 6 spare,
#   offset u64, length u64; its checksum at byte 8;
# - what it holds (written when it gets a key): generation u32, hash length u16 + 2 spare,
#   rank u32 + 4 spare, the hash bytes; its checksum at byte 40.
# Byte 0 is the state.
_PLACE = struct.Struct("<H6xQQ")
_PLACE_AT = 16
_KEY = struct.Struct("<IH2xI4x")
_KEY_SUM_AT = _PLACE_AT + _PLACE.size
_KEY_AT = _KEY_SUM_AT + 8
_HASH_AT = _KEY_AT + _KEY.size
RECORD_BYTES = -(-(_HASH_AT + MAX_HASH_BYTES) // 8) * 8
# Pool record: state u8 + 3 spare, length u32, checksum u64, then the layout's MessagePack.
_POOL_HEAD = struct.Struct("<B3xIQ")
# Two names of up to 1024 characters (4 bytes each in UTF-8 at worst) and a few integers.
POOL_RECORD_BYTES = 12 * 1024
# Every page is at least this big in practice (kvshelf.server.limits.MIN_PAGE_BYTES): one slot
# per this many bytes of arena. Pools with smaller pages may run out of slots; pages without a
# slot are simply not recorded (not adoptable).
SLOT_PAGE_BYTES = 4096

_ENCODER = msgspec.msgpack.Encoder()
_LAYOUT_DECODER = msgspec.msgpack.Decoder(PageLayout)


class HasSlot(Protocol):
    """A page, as far as the table cares: its slot, or -1."""

    slot: int


class SlotState(enum.IntEnum):
    """A page record's state byte."""

    UNUSED = 0  # no page has this slot
    FREE = 1  # a page without a key
    RESERVED = 2  # a writer may be copying into it
    FILLING = 3  # a tier below L1 may be copying into it
    COMMITTED = 4  # a complete object: adoptable


class TableError(Exception):
    """The trailer cannot be read as a page table of this format (the reason says why)."""


@dataclass(frozen=True)
class Geometry:
    """The sizes of one arena's trailer."""

    capacity: int
    page_slots: int
    pool_slots: int
    record_bytes: int = RECORD_BYTES
    pool_record_bytes: int = POOL_RECORD_BYTES

    @classmethod
    def for_capacity(cls, capacity: int, pool_slots: int) -> Geometry:
        return cls(capacity, max(1, capacity // SLOT_PAGE_BYTES), pool_slots)

    @property
    def trailer_bytes(self) -> int:
        """Bytes after ``capacity``: pool table, page records and header."""
        return (
            self.pool_slots * self.pool_record_bytes
            + self.page_slots * self.record_bytes
            + HEADER_BYTES
        )

    @property
    def file_bytes(self) -> int:
        return self.capacity + self.trailer_bytes


def encode_header(geometry: Geometry) -> bytes:
    """The header bytes (``HEADER_BYTES``) for ``geometry``."""
    fields = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        geometry.capacity,
        geometry.record_bytes,
        geometry.page_slots,
        geometry.pool_slots,
        geometry.pool_record_bytes,
    )
    head = fields + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(fields))
    return head + bytes(HEADER_BYTES - len(head))


def has_magic(tail: bytes) -> bool:
    """Whether the last ``HEADER_BYTES`` of an object start with this kvshelf's magic."""
    return len(tail) == HEADER_BYTES and tail.startswith(MAGIC)


def decode_header(tail: bytes, file_bytes: int) -> Geometry:
    """Read the header (the object's last ``HEADER_BYTES``).

    Raises:
        TableError: no magic, a bad checksum, another format version, or sizes that do not
            add up to ``file_bytes``.
    """
    if not has_magic(tail):
        raise TableError("no kvshelf arena header")
    fields = tail[: _HEADER.size]
    (checksum,) = _CHECKSUM.unpack_from(tail, _HEADER.size)
    if xxhash.xxh3_64_intdigest(fields) != checksum:
        raise TableError("the header's checksum does not match")
    _, version, header_bytes, capacity, record_bytes, page_slots, pool_slots, pool_record = (
        _HEADER.unpack(fields)
    )
    if version != FORMAT_VERSION or header_bytes != HEADER_BYTES:
        raise TableError(f"format version {version}, this server reads {FORMAT_VERSION}")
    geometry = Geometry(capacity, page_slots, pool_slots, record_bytes, pool_record)
    if record_bytes != RECORD_BYTES or pool_record != POOL_RECORD_BYTES:
        raise TableError(f"record sizes {record_bytes}/{pool_record} of another build")
    if geometry.file_bytes != file_bytes:
        raise TableError(f"the header's sizes add up to {geometry.file_bytes}, not {file_bytes}")
    return geometry


@dataclass(frozen=True)
class PageRecord:
    """One page record as read back."""

    slot: int
    state: SlotState
    generation: int
    pool_slot: int
    rank: int
    offset: int
    length: int
    block_hash: bytes


class PageTable:
    """Reads and writes the pool table and page records of one trailer.

    Args:
        trailer: a writable view of the trailer (``geometry.trailer_bytes`` long).
        geometry: its sizes.
    """

    def __init__(
        self, trailer: memoryview, geometry: Geometry, fd: int = -1, file_offset: int = 0
    ) -> None:
        assert len(trailer) == geometry.trailer_bytes
        self.geometry = geometry
        self._buf = trailer
        self._records_at = geometry.pool_slots * geometry.pool_record_bytes
        self._generation = 0
        # The file behind the trailer (at file_offset), to find which parts were ever written.
        self._fd = fd
        self._file_offset = file_offset

    def release(self) -> None:
        """Let go of the trailer's view (before its mapping closes); the table is unusable."""
        self._buf.release()

    # Pools.

    def write_pool(self, pool_slot: int, layout: PageLayout) -> None:
        """Record the layout of the pool in ``pool_slot`` (state byte last)."""
        payload = _ENCODER.encode(layout)
        base = pool_slot * POOL_RECORD_BYTES
        assert len(payload) + _POOL_HEAD.size <= POOL_RECORD_BYTES
        buf = self._buf
        buf[base] = 0
        start = base + _POOL_HEAD.size
        buf[start : start + len(payload)] = payload
        _POOL_HEAD.pack_into(buf, base, 0, len(payload), xxhash.xxh3_64_intdigest(payload))
        buf[base] = 1

    def clear_pool(self, pool_slot: int) -> None:
        """Mark the record in ``pool_slot`` unused (a retired pool's; reused later)."""
        self._buf[pool_slot * POOL_RECORD_BYTES] = 0

    def pools(self) -> dict[int, PageLayout]:
        """Every recorded pool by slot.

        Raises:
            TableError: a pool record fails its checksum or does not decode.
        """
        found: dict[int, PageLayout] = {}
        buf = self._buf
        written = self._written(0, self._records_at)
        for slot in range(self.geometry.pool_slots):
            base = slot * POOL_RECORD_BYTES
            if not any(lo <= base < hi for lo, hi in written):
                continue  # never written (and not to be allocated by reading it)
            state, length, checksum = _POOL_HEAD.unpack_from(buf, base)
            if state == 0:
                continue
            start = base + _POOL_HEAD.size
            payload = bytes(buf[start : start + length])
            if (
                state != 1
                or length > POOL_RECORD_BYTES - _POOL_HEAD.size
                or xxhash.xxh3_64_intdigest(payload) != checksum
            ):
                raise TableError(f"pool record {slot} fails its checksum")
            try:
                found[slot] = _LAYOUT_DECODER.decode(payload)
            except (msgspec.DecodeError, ValueError) as exc:
                raise TableError(f"pool record {slot} does not decode: {exc}") from None
        return found

    # Pages.

    def place(self, slot: int, pool_slot: int, offset: int, length: int) -> None:
        """A new page has ``slot``: record where it is, then make it FREE."""
        buf = self._buf
        base = self._records_at + slot * RECORD_BYTES
        buf[base] = SlotState.UNUSED
        _PLACE.pack_into(buf, base + _PLACE_AT, pool_slot, offset, length)
        place = buf[base + _PLACE_AT : base + _KEY_SUM_AT]
        _CHECKSUM.pack_into(buf, base + 8, xxhash.xxh3_64_intdigest(place))
        buf[base] = SlotState.FREE

    def key(self, slot: int, state: SlotState, rank: int, block_hash: bytes) -> None:
        """Record the key a page gets, then set its state (RESERVED or COMMITTED).

        The page's state byte must not be COMMITTED meanwhile: a torn key then reads as the
        state before (FREE or FILLING), never as a committed object.
        """
        base = self._records_at + slot * RECORD_BYTES
        self._generation = generation = (self._generation + 1) & 0xFFFFFFFF
        # Built in one piece and written with one copy: this runs for every key stored.
        key = _KEY.pack(generation, len(block_hash), rank) + block_hash
        self._buf[base + _KEY_SUM_AT : base + _KEY_AT + len(key)] = (
            _CHECKSUM.pack(xxhash.xxh3_64_intdigest(key)) + key
        )
        self._buf[base] = state

    def set(self, slot: int, state: int) -> None:
        """Set one record's state byte alone (a ``SlotState`` value)."""
        self._buf[self._records_at + slot * RECORD_BYTES] = state

    def mark(self, pages: Iterable[HasSlot], state: SlotState) -> None:
        """Set the state byte alone of each page's record (pages with ``slot`` -1 have none)."""
        buf = self._buf
        at = self._records_at
        value = int(state)
        for page in pages:
            slot = page.slot
            if slot >= 0:
                buf[at + slot * RECORD_BYTES] = value

    def records(self) -> list[PageRecord]:
        """Every record in use (state not UNUSED), in slot order.

        A record whose key fails its checksum while its state is not COMMITTED was torn while a
        key was written: it comes back without a key (``rank`` -1, empty hash).

        Raises:
            TableError: an unknown state, a place that fails its checksum, or a COMMITTED
                record whose key fails it: the table was overwritten.
        """
        found: list[PageRecord] = []
        buf = self._buf
        for slot in self._used_slots():
            base = self._records_at + slot * RECORD_BYTES
            state = buf[base]
            if state > SlotState.COMMITTED:
                raise TableError(f"page record {slot} has the unknown state {state}")
            (place_sum,) = _CHECKSUM.unpack_from(buf, base + 8)
            if place_sum != xxhash.xxh3_64_intdigest(buf[base + _PLACE_AT : base + _KEY_SUM_AT]):
                raise TableError(f"page record {slot}: its place fails its checksum")
            pool_slot, offset, length = _PLACE.unpack_from(buf, base + _PLACE_AT)
            generation, n, rank = _KEY.unpack_from(buf, base + _KEY_AT)
            (key_sum,) = _CHECKSUM.unpack_from(buf, base + _KEY_SUM_AT)
            keyed = n <= MAX_HASH_BYTES and key_sum == xxhash.xxh3_64_intdigest(
                buf[base + _KEY_AT : base + _HASH_AT + n]
            )
            if not keyed and state == SlotState.COMMITTED:
                raise TableError(f"committed page record {slot}: its key fails its checksum")
            block_hash = bytes(buf[base + _HASH_AT : base + _HASH_AT + n]) if keyed else b""
            found.append(
                PageRecord(
                    slot,
                    SlotState(state),
                    generation,
                    pool_slot,
                    rank if keyed else -1,
                    offset,
                    length,
                    block_hash,
                )
            )
        return found

    def _used_slots(self) -> Iterator[int]:
        """The slots whose state byte is not UNUSED, in order.

        Only the parts of the file ever written are read: reading a never-written page of a
        shared-memory object through a mapping allocates it, and the records of a big arena
        are mostly never written. The state bytes of those parts are gathered with one strided
        copy and searched in C.
        """
        start = self._records_at
        for lo, hi in self._written(start, start + self.geometry.page_slots * RECORD_BYTES):
            first = -(-(lo - start) // RECORD_BYTES)
            last = (hi - 1 - start) // RECORD_BYTES
            if last < first:
                continue
            at = start + first * RECORD_BYTES
            states = self._buf[at : start + last * RECORD_BYTES + 1 : RECORD_BYTES].tobytes()
            for used in re.finditer(rb"[^\x00]", states):
                yield first + used.start()

    def _written(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The ranges of ``[lo, hi)`` (trailer offsets) that hold data in the file."""
        if self._fd < 0:
            return [(lo, hi)]
        base = self._file_offset
        found: list[tuple[int, int]] = []
        while lo < hi:
            try:
                data = os.lseek(self._fd, base + lo, os.SEEK_DATA) - base
            except OSError:  # ENXIO: no data after lo
                break
            if data >= hi:
                break
            lo = min(os.lseek(self._fd, base + data, os.SEEK_HOLE) - base, hi)
            found.append((data, lo))
        return found


class SlotAllocator:
    """Dense slot numbers ``0 .. count-1``: the lowest free one first.

    Args:
        count: how many slots there are.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self._next = 0  # every slot from here up is free
        self._free: list[int] = []  # freed slots below _next
        # The same slots as a set: a retired pool gives thousands back at once, and a list
        # membership test per slot would make that quadratic.
        self._freed: set[int] = set()
        self.taken = 0

    def take(self) -> int:
        """A free slot, or -1 when every slot is taken."""
        if self._free:
            slot = self._free.pop()
            self._freed.discard(slot)
        elif self._next < self.count:
            slot = self._next
            self._next += 1
        else:
            return -1
        self.taken += 1
        return slot

    def give(self, slot: int) -> None:
        """Return a slot from :meth:`take` (or :meth:`mark`)."""
        assert 0 <= slot < self._next and slot not in self._freed
        self._free.append(slot)
        self._freed.add(slot)
        self.taken -= 1

    def mark(self, slots: set[int]) -> None:
        """Start from a table whose ``slots`` are in use (adoption); the rest are free."""
        assert self.taken == 0 and all(0 <= s < self.count for s in slots)
        self._next = max(slots, default=-1) + 1
        self._free = sorted((s for s in range(self._next) if s not in slots), reverse=True)
        self._freed = set(self._free)
        self.taken = len(slots)


def read_tail(fd: int, file_bytes: int) -> bytes:
    """An object's last ``HEADER_BYTES`` (empty when it is smaller)."""
    if file_bytes < HEADER_BYTES:
        return b""
    return os.pread(fd, HEADER_BYTES, file_bytes - HEADER_BYTES)


def carries_header(fd: int, file_bytes: int) -> bool:
    """Whether the object behind ``fd`` ends with this kvshelf's arena header (its magic)."""
    return has_magic(read_tail(fd, file_bytes))
