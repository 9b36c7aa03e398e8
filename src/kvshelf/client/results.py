"""What the client's calls return: a registration, a lookup's result, a reservation.

Plain frozen values built from the server's replies; imports only the protocol and the
client's errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshelf.client.errors import checked
from kvshelf.protocol import LookupReply, Reply


@dataclass(frozen=True)
class Registration:
    """Where this client's pool lives, as of one server boot."""

    pool: str
    shm_name: str
    arena_bytes: int
    page_bytes: int
    boot_id: str


@dataclass(frozen=True)
class LookupResult:
    """A lookup's answer.

    ``pages[rank][i]`` is the page index of block ``i`` for ``rank``, only when locked;
    ``boot_id`` names the server run (and so the arena) those pages belong to;
    ``miss_reason`` is a :class:`~kvshelf.protocol.MissReason` value (0 unless counted).
    ``pending``: no answer yet, the server is still loading blocks from tiers below L1 (ask
    again). ``end_block``: for a lookup with ``ends``, the block its hit would end after
    (:class:`~kvshelf.protocol.LookupReply`).
    """

    num_hit_blocks: int
    lock_id: int
    pages: list[list[int]]
    boot_id: str
    miss_reason: int = 0
    pending: bool = False
    end_block: int = 0


@dataclass(frozen=True)
class Reservation:
    """A reserve's answer: ``pages[i]`` is the page to write block ``i`` into, or None to skip."""

    reservation_id: int
    pages: list[int | None]
    boot_id: str


@dataclass(frozen=True)
class ServerStats:
    """A stats call's answer: the counters, and committed objects per pool name."""

    counters: dict[str, int]
    pool_objects: dict[str, int]


@dataclass(frozen=True)
class Cleared:
    """A clear's answer (:class:`~kvshelf.protocol.ClearReply`)."""

    cleared_objects: int
    locked_objects: int
    cleared_disk_objects: int = 0
    clearing_shared: bool = False
    # L1 objects left when the client stopped asking (stores committed during a long clear).
    remaining_objects: int = 0


def lookup_result(reply: Reply) -> LookupResult:
    """The result a lookup's ``reply`` carries.

    Raises:
        ServerError: an error reply, or a reply of another type.
    """
    reply = checked(reply, LookupReply)
    assert isinstance(reply, LookupReply)
    return LookupResult(
        reply.num_hit_blocks,
        reply.lock_id,
        reply.pages,
        reply.boot_id,
        reply.miss_reason,
        reply.pending,
        reply.end_block,
    )
