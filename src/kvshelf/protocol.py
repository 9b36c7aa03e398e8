"""The kvshelf control protocol: message structs, the wire codec and the protocol version.

Every message is a frozen msgspec ``Struct`` encoded as a MessagePack map. Requests and replies
form two tagged unions whose tag (the ``type`` field) is an integer from :class:`MsgType`. Every
message carries ``version`` and ``request_id``; every reply also carries the server's
``boot_id``, which changes when the server restarts.

This module is the ONE place that turns messages into bytes and back: :func:`encode`,
:func:`decode_request` and :func:`decode_reply`. Decoding never raises anything but
:class:`ProtocolError`, which already names the :class:`ErrorCode` the server replies with.
There is no pickle anywhere on the wire.
"""

from __future__ import annotations

import enum
import hashlib
import time
from typing import Annotated, Any, Union, get_args

import msgspec

# 2: Lookup.deadline_ms, .count_miss and .fetch; Release.copied; LookupReply.miss_reason and
# .pending; StatsReply.pool_objects; Clear/ClearReply; errors LIMIT_EXCEEDED and EXPIRED. A
# version-1 peer could not read those replies, so the two refuse each other (BAD_VERSION).
PROTOCOL_VERSION = 2

# A frame larger than this is rejected before it is decoded. A lookup of 64k block hashes of 36
# bytes is about 2.5 MiB, and a locking lookup's reply for 8 ranks of that is of the same order.
MAX_FRAME_BYTES = 4 * 1024 * 1024

# vLLM's block hashes are 32-byte digests (36 with a KV-cache group id); leave headroom.
MAX_HASH_BYTES = 256
MAX_HASHES_PER_REQUEST = 65536
MAX_WORLD_SIZE = 4096
MAX_NAME_CHARS = 1024
# The most objects (keys x ranks) one request may ask the server about: a lookup looks each key
# up in every rank's table, an events probe too, so this bounds the loop's work per request
# (docs/safety.md, "Bounds") and a locking lookup's reply (a page index per object: about
# 2.5 MiB, under MAX_FRAME_BYTES). 64k keys of 8 ranks.
MAX_OBJECTS_PER_REQUEST = 8 * MAX_HASHES_PER_REQUEST


def max_request_keys(world_size: int) -> int:
    """The most keys one lookup (``hashes`` and ``ends`` together) or events probe of a pool
    of ``world_size`` ranks may carry (:data:`MAX_OBJECTS_PER_REQUEST`)."""
    return min(MAX_HASHES_PER_REQUEST, MAX_OBJECTS_PER_REQUEST // world_size)


class MsgType(enum.IntEnum):
    """The ``type`` tag of every message. Append-only: never renumber or reuse a value."""

    ERROR = 0
    PING = 1
    PONG = 2
    REGISTER = 3
    REGISTERED = 4
    LOOKUP = 5
    LOOKUP_REPLY = 6
    RESERVE = 7
    RESERVE_REPLY = 8
    COMMIT = 9
    ABORT = 10
    RELEASE = 11
    ACK = 12
    STATS = 13
    STATS_REPLY = 14
    CLEAR = 15
    CLEAR_REPLY = 16
    EVENTS = 17
    EVENTS_REPLY = 18


class ErrorCode(enum.IntEnum):
    """Why the server rejected a request. Append-only, like :class:`MsgType`."""

    MALFORMED = 1
    FRAME_TOO_LARGE = 2
    UNKNOWN_TYPE = 3
    BAD_VERSION = 4
    UNKNOWN_POOL = 5
    LAYOUT_MISMATCH = 6
    UNKNOWN_RESERVATION = 7
    UNKNOWN_LOCK = 8
    INVALID_ARGUMENT = 9
    INTERNAL = 10
    # A bound of kvshelf.server.limits (pools, leases per pool): retry later, or not at all.
    LIMIT_EXCEEDED = 11
    # A lookup that reached the server after the deadline it carried: nothing was locked.
    EXPIRED = 12


class MissReason(enum.IntEnum):
    """Why a lookup stopped short of its blocks: the state of its first missing block.

    Append-only, like :class:`MsgType`; a reply carries it as a plain int, so that a reason
    added later does not fail an older client's decoding.
    """

    NONE = 0  # every block hit, or the miss was not to be counted (``Lookup.count_miss``)
    NEVER_STORED = 1  # no tier holds it, and it is not among the recently evicted keys
    EVICTED = 2  # among the recently evicted keys
    RANK_INCOMPLETE = 3  # stored for some ranks, missing for others
    TIER_ERROR = 4  # a tier below L1 holds it but could not load it


class ProtocolError(Exception):
    """A frame that is not a valid message of this protocol version.

    Args:
        code: the error code the server answers with.
        message: a short human-readable reason.
        request_id: the frame's request id when it could be recovered, else 0.
    """

    def __init__(self, code: ErrorCode, message: str, request_id: int = 0) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
PositiveInt = Annotated[int, msgspec.Meta(gt=0, le=2**63 - 1)]
WorldSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_WORLD_SIZE)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_WORLD_SIZE)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
OptionalName = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
BlockHash = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_HASH_BYTES)]
BlockHashes = Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_HASHES_PER_REQUEST)]
# A reply's ints, one per key: a rank's pages, an event log's kinds, where probed keys are.
IntsPerKey = Annotated[list[NonNegInt], msgspec.Meta(max_length=MAX_HASHES_PER_REQUEST)]
# Lookup.ends: a list of keys per block of the lookup, so no more blocks than keys.
BlockEnds = Annotated[list[BlockHashes], msgspec.Meta(max_length=MAX_HASHES_PER_REQUEST)]


class PageLayout(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """What one worker rank stores: which model and KV layout, and how big one page is.

    Args:
        model_fingerprint: stable identity of the model (weights, dtype, ...).
        layout_fingerprint: stable identity of the KV cache layout (block size, layers, ...).
        page_bytes: bytes of one page = one block of one rank, all layers.
        world_size: number of KV-cache ranks sharing a key space.
        rank: this worker's rank, ``0 <= rank < world_size``.
        replicas: how many consecutive ranks hold the same bytes (vLLM replicates MLA's latent
            on every tensor parallel rank, and a KV head on ``tp / num_kv_heads`` ranks when
            there are fewer KV heads than ranks). The pool stores ``world_size / replicas``
            ranks: rank ``r`` stores and reads the objects of stored rank ``r // replicas``.
            1 (sharded KV: every rank its own bytes) is left out of the encoding, so that
            such a layout's bytes are those of a peer that predates the field.
    """

    model_fingerprint: Name
    layout_fingerprint: Name
    page_bytes: PositiveInt
    world_size: WorldSize
    rank: Rank
    replicas: WorldSize = 1

    def __post_init__(self) -> None:
        # Raised as a ValidationError while decoding, a ValueError when built locally.
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        if self.world_size % self.replicas:
            raise ValueError(
                f"replicas {self.replicas} does not divide world_size {self.world_size}"
            )

    @property
    def pool(self) -> str:
        """The name of the pool this layout stores into (:func:`pool_name`)."""
        return pool_name(
            self.model_fingerprint, self.layout_fingerprint, self.world_size, self.replicas
        )


# The client's deadline is sent this much early (at most), so that a reply sent just before it
# still reaches a client that waits.
DEADLINE_MARGIN_S = 0.05


def lookup_deadline_ms(timeout_s: float) -> int:
    """The ``Lookup.deadline_ms`` of a lookup sent now by a client that waits ``timeout_s``.

    Wall-clock milliseconds (Unix time): client and server share a host (the arena is shared
    memory) or at least a synchronised clock; a clock step only makes lookups miss.
    """
    margin = min(DEADLINE_MARGIN_S, timeout_s / 10)
    return int((time.time() + timeout_s - margin) * 1000)


def deadline_passed(deadline_ms: int) -> bool:
    """Whether a lookup's deadline (0: none) is past."""
    return deadline_ms != 0 and time.time() * 1000 >= deadline_ms


def local_socket_name(port: int, boot_id: str) -> str:
    """The node-local socket of the server on ``port`` in the boot ``boot_id``: an abstract Unix
    socket name, without its leading NUL. Clients derive it from any reply's boot id; a new
    boot never answers on an old boot's name."""
    return f"kvshelf-{port}-{boot_id}"


def pool_name(
    model_fingerprint: str, layout_fingerprint: str, world_size: int, replicas: int = 1
) -> str:
    """Name the pool shared by every rank of one model, layout and world size.

    The name is a digest, so it is stable across processes and restarts (never Python's salted
    ``hash()``) and short enough to send with every lookup.

    Args:
        model_fingerprint: see :class:`PageLayout`.
        layout_fingerprint: see :class:`PageLayout`.
        world_size: see :class:`PageLayout`.
        replicas: see :class:`PageLayout`; 1 names the pool it always named.

    Returns:
        ``"pool-"`` followed by 32 hex digits.
    """
    fields: list[str | int] = [model_fingerprint, layout_fingerprint, world_size]
    if replicas != 1:
        fields.append(replicas)
    canonical = msgspec.msgpack.encode(fields)
    return "pool-" + hashlib.sha256(canonical).hexdigest()[:32]


class _Message(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="type"):
    """Fields every message carries."""

    request_id: NonNegInt
    version: int = PROTOCOL_VERSION


class _Reply(_Message, frozen=True, kw_only=True, gc=False):
    """Fields every reply carries."""

    boot_id: str


# Requests (client -> server).


class Ping(_Message, frozen=True, kw_only=True, gc=False, tag=int(MsgType.PING)):
    """Liveness check; answered with :class:`Pong`."""


class Register(_Message, frozen=True, kw_only=True, gc=False, tag=int(MsgType.REGISTER)):
    """Create (or join) the pool for ``layout``; answered with :class:`Registered`.

    ``holder`` is the registrant's holder token (:class:`Registered` gave it; 0: none yet, the
    server picks one): the registration holds the pool as that holder, counted once however
    often it registers. ``retires`` names the pool this rank registered last on this server boot
    and no longer uses (a new identity epoch replaced it): the holder lets go of it, and the
    server retires it once no holder is left (docs/architecture.md, "Pool life cycle"). A
    ``retires`` of a pool the holder does not hold changes nothing. Empty: none. A server that
    predates the fields ignores them.
    """

    layout: PageLayout
    retires: OptionalName = ""
    holder: NonNegInt = 0


class Lookup(_Message, frozen=True, kw_only=True, gc=False, tag=int(MsgType.LOOKUP)):
    """Find the longest prefix of ``hashes`` committed for every rank; :class:`LookupReply`.

    With ``lock`` the hit pages are locked (leased) until each rank releases its share.
    ``deadline_ms`` (see :func:`lookup_deadline_ms`) is when the client stops waiting for the
    reply; a server that reaches the lookup later answers ``EXPIRED`` and locks nothing.
    0: no deadline. With ``count_miss`` (a request's first lookup) a lookup that stops short of
    its blocks is counted under its :class:`MissReason`; a request's repeated lookups leave it
    false.
    With ``fetch`` (the default), blocks that tiers below L1 (disk, Redis) hold after the L1
    prefix are loaded into L1 first; the reply may then be ``pending`` (see
    :class:`LookupReply`). Without it, the server answers from L1 at once.

    With ``ends`` (a model with state-space layers, whose state is kept at a few block
    boundaries only), ``hashes`` holds ``block_keys`` keys per block and ``ends[i]`` the keys a
    hit ending after block ``i`` also needs (empty: no hit may end there). The server picks the
    longest such hit its tiers hold, ``n`` blocks, and looks up ``hashes[:n * block_keys] +
    ends[n - 1]`` as above; the reply's ``end_block`` is ``n`` (0: none).

    ``hashes`` and ``ends`` together hold at most :func:`max_request_keys` keys (else
    ``INVALID_ARGUMENT``). ``tenant``: whose hits these are (see :class:`Reserve`).
    """

    pool: Name
    hashes: BlockHashes
    world_size: WorldSize
    lock: bool
    deadline_ms: NonNegInt = 0
    count_miss: bool = True
    fetch: bool = True
    block_keys: NonNegInt = 1
    ends: BlockEnds = msgspec.field(default_factory=list)
    tenant: OptionalName = ""


class Reserve(_Message, frozen=True, kw_only=True, gc=False, tag=int(MsgType.RESERVE)):
    """Reserve pages to write ``hashes`` of one rank; answered with :class:`ReserveReply`.

    ``tenant`` names who stores (as ``Lookup.tenant`` who looks up): the server accounts its
    pages, evicts a tenant over its share first and enforces ``--tenant-quota``
    (``kvshelf.server.tenants``). "": none named. A server that predates it ignores it.
    """

    pool: Name
    rank: Rank
    hashes: BlockHashes
    tenant: OptionalName = ""


class Commit(_Message, frozen=True, kw_only=True, gc=False, tag=int(MsgType.COMMIT)):
    """Make a reservation's written pages visible to lookups; answered with :class:`Ack`."""

    reservation_id: PositiveInt


class Abort(_Message, frozen=True, kw_only=True, gc=False, tag=int(MsgType.ABORT)):
    """Drop a reservation and free its pages; answered with :class:`Ack`."""

    reservation_id: PositiveInt


class Release(_Message, frozen=True, kw_only=True, gc=False, tag=int(MsgType.RELEASE)):
    """Release one rank's share of a lookup lock; answered with :class:`Ack`.

    ``copied`` is how many of the share's pages the worker copied into vLLM (0 for a lock
    released unused); the server counts them in ``loaded_objects_total``.
    """

    lock_id: PositiveInt
    rank: Rank
    copied: NonNegInt = 0


class Stats(_Message, frozen=True, kw_only=True, gc=False, tag=int(MsgType.STATS)):
    """Ask for the server's counters; answered with :class:`StatsReply`."""


class Clear(_Message, frozen=True, kw_only=True, gc=False, tag=int(MsgType.CLEAR)):
    """Drop every committed object no lock pins from the node's own tiers (``kvshelf clear``);
    answered with :class:`ClearReply`. Pools stay registered, so workers keep their mappings.
    With ``shared``, also start dropping kvshelf's keys from the shared (Redis) tier."""

    shared: bool = False


class Events(_Message, frozen=True, kw_only=True, gc=False, tag=int(MsgType.EVENTS)):
    """Read a pool's event log (:mod:`kvshelf.server.event_log`) from sequence number
    ``after_seq`` on, and ask where each ``probe`` hash is; answered with :class:`EventsReply`.
    ``probe`` holds at most :func:`max_request_keys` hashes for the pool's world size (else
    ``INVALID_ARGUMENT``)."""

    pool: Name
    after_seq: NonNegInt = 0
    probe: BlockHashes = msgspec.field(default_factory=list)


# Replies (server -> client).


class Error(_Reply, frozen=True, kw_only=True, gc=False, tag=int(MsgType.ERROR)):
    """The request was rejected and changed nothing."""

    code: ErrorCode
    message: str


class Pong(_Reply, frozen=True, kw_only=True, gc=False, tag=int(MsgType.PONG)):
    """Answer to :class:`Ping`; ``local_socket`` as in :class:`Registered`."""

    local_socket: str = ""


class Registered(_Reply, frozen=True, kw_only=True, gc=False, tag=int(MsgType.REGISTERED)):
    """Answer to :class:`Register`: where the pool's pages live.

    ``local_socket`` names the server's node-local socket (:func:`local_socket_name`,
    :mod:`kvshelf.server.local_socket`); empty when it has none. ``holder`` is the token the
    registrant holds the pool by (its ``Register.holder``, or a new random one): sent with its
    next registrations and their ``retires``. 0 from a server that predates it.
    """

    pool: str
    shm_name: str
    arena_bytes: NonNegInt
    page_bytes: PositiveInt
    local_socket: str = ""
    holder: NonNegInt = 0


class LookupReply(_Reply, frozen=True, kw_only=True, gc=False, tag=int(MsgType.LOOKUP_REPLY)):
    """Answer to :class:`Lookup`.

    ``lock_id`` is 0 when nothing was locked; ``pages[rank][i]`` is the page index of block ``i``
    for ``rank`` and is only filled when a lock was taken. ``miss_reason`` is a
    :class:`MissReason` value: why the hit stops short of the lookup's blocks, when the lookup
    asked to count its miss (else 0).
    ``pending``: tiers below L1 are still loading blocks of the prefix; nothing is locked or
    counted as a hit, and the client asks again (or asks without ``fetch`` once it stops
    waiting).
    ``end_block``: for a lookup with ``ends``, the blocks its hit would end after; then
    ``num_hit_blocks`` counts the keys of ``hashes[:end_block * block_keys] +
    ends[end_block - 1]`` the hit covers (all of them, or the hit is short of its end).
    """

    num_hit_blocks: NonNegInt
    lock_id: NonNegInt
    pages: Annotated[list[IntsPerKey], msgspec.Meta(max_length=MAX_WORLD_SIZE)]
    miss_reason: NonNegInt = 0
    pending: bool = False
    end_block: NonNegInt = 0


class ReserveReply(_Reply, frozen=True, kw_only=True, gc=False, tag=int(MsgType.RESERVE_REPLY)):
    """Answer to :class:`Reserve`: ``pages[i]`` is the page to write, or None to skip."""

    reservation_id: PositiveInt
    pages: Annotated[list[NonNegInt | None], msgspec.Meta(max_length=MAX_HASHES_PER_REQUEST)]


class Ack(_Reply, frozen=True, kw_only=True, gc=False, tag=int(MsgType.ACK)):
    """Answer to :class:`Commit`, :class:`Abort` and :class:`Release`."""


class StatsReply(_Reply, frozen=True, kw_only=True, gc=False, tag=int(MsgType.STATS_REPLY)):
    """Answer to :class:`Stats`."""

    stats: dict[str, int]
    # Pool name -> its committed objects in L1; empty from a server that predates it.
    pool_objects: dict[str, int] = msgspec.field(default_factory=dict)


class ClearReply(_Reply, frozen=True, kw_only=True, gc=False, tag=int(MsgType.CLEAR_REPLY)):
    """Answer to :class:`Clear`: L1 objects dropped, L1 objects kept because a lock pins them,
    objects dropped from the disk tier, and whether the shared tier started clearing (its
    progress: the ``l3_clearing`` and ``l3_cleared_objects_total`` stats). One Clear drops a
    bounded number of L1 objects: ``remaining_objects`` > 0 says how many are left, and that
    the tiers below were not cleared yet: send Clear again."""

    cleared_objects: NonNegInt
    locked_objects: NonNegInt
    cleared_disk_objects: NonNegInt = 0
    clearing_shared: bool = False
    remaining_objects: NonNegInt = 0


class EventsReply(_Reply, frozen=True, kw_only=True, gc=False, tag=int(MsgType.EVENTS_REPLY)):
    """Answer to :class:`Events`: the log entries from ``after_seq`` on (``kinds[i]`` is an
    ``EventKind`` of ``hashes[i]``), the sequence number to ask for next, whether the entries
    the reader needed were dropped (``overflowed``: start over from the pool's contents), and
    where each probed hash is (``present``: 0 absent, 1 in L1, 2 below L1 only)."""

    kinds: IntsPerKey
    hashes: BlockHashes
    next_seq: NonNegInt
    overflowed: bool = False
    present: IntsPerKey = msgspec.field(default_factory=list)


Request = Union[  # noqa: UP007
    Ping, Register, Lookup, Reserve, Commit, Abort, Release, Stats, Clear, Events
]
Reply = Union[  # noqa: UP007
    Error, Pong, Registered, LookupReply, ReserveReply, Ack, StatsReply, ClearReply, EventsReply
]

REQUEST_TYPES: frozenset[int] = frozenset(t.__struct_config__.tag for t in get_args(Request))
REPLY_TYPES: frozenset[int] = frozenset(t.__struct_config__.tag for t in get_args(Reply))


class _Header(msgspec.Struct, gc=False):
    """The fields needed to explain why a frame did not decode; everything else is ignored."""

    type: Any = None
    version: Any = None
    request_id: Any = None


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_header_decoder = msgspec.msgpack.Decoder(_Header)


def encode(msg: Request | Reply) -> bytes:
    """Encode one message for the wire.

    Args:
        msg: any request or reply struct.

    Returns:
        The MessagePack frame.
    """
    return _encoder.encode(msg)


def decode_request(frame: bytes) -> Request:
    """Decode a frame the server received.

    Args:
        frame: one ZMQ payload frame.

    Returns:
        The request, guaranteed to be of :data:`PROTOCOL_VERSION` and to pass field validation.

    Raises:
        ProtocolError: for any frame that is not such a request.
    """
    return _decode(frame, _request_decoder, REQUEST_TYPES)


def decode_reply(frame: bytes) -> Reply:
    """Decode a frame the client received.

    Args:
        frame: one ZMQ payload frame.

    Returns:
        The reply, guaranteed to be of :data:`PROTOCOL_VERSION`.

    Raises:
        ProtocolError: for any frame that is not such a reply.
    """
    return _decode(frame, _reply_decoder, REPLY_TYPES)


def _decode(frame: bytes, decoder: msgspec.msgpack.Decoder, allowed_types: frozenset[int]):
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE, f"frame of {len(frame)} bytes > {MAX_FRAME_BYTES}"
        )
    try:
        msg = decoder.decode(frame)
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise _diagnose(frame, allowed_types, exc) from None
    if msg.version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"protocol version {msg.version}, this side speaks {PROTOCOL_VERSION}",
            msg.request_id,
        )
    return msg


def _diagnose(frame: bytes, allowed_types: frozenset[int], exc: Exception) -> ProtocolError:
    """Explain a frame that failed to decode, recovering its request id where possible.

    Only runs on the error path, so valid frames are decoded exactly once.
    """
    try:
        header = _header_decoder.decode(frame)
    except (msgspec.DecodeError, ValueError, TypeError):
        return ProtocolError(ErrorCode.MALFORMED, "not a MessagePack map")
    rid = header.request_id
    request_id = rid if type(rid) is int and 0 <= rid < 2**63 else 0
    if header.version != PROTOCOL_VERSION:
        return ProtocolError(
            ErrorCode.BAD_VERSION,
            f"protocol version {header.version!r}, this side speaks {PROTOCOL_VERSION}",
            request_id,
        )
    if type(header.type) is not int or header.type not in allowed_types:
        return ProtocolError(
            ErrorCode.UNKNOWN_TYPE, f"unknown message type {header.type!r}", request_id
        )
    return ProtocolError(ErrorCode.MALFORMED, str(exc)[:200], request_id)
