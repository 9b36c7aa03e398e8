"""The request handler: decodes one request frame, drives the index and encodes its reply.

Each request is answered by exactly one reply frame. Any frame that is not a valid request of
this protocol version, and any request the index rejects, is answered with an
:class:`~kvshelf.protocol.Error` reply, changes no state and counts in ``bad_requests_total``.
A lookup that tiers below L1 must complete first is answered later: :meth:`RequestHandler.handle`
returns None for it, and its reply joins :meth:`RequestHandler.take_deferred` once the index
has it. Must not import torch or vLLM.
"""

from __future__ import annotations

import gc
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from kvshelf.metric_types import Histograms
from kvshelf.metrics import SERVER_TIMINGS
from kvshelf.protocol import (
    Abort,
    Ack,
    Clear,
    ClearReply,
    Commit,
    Error,
    ErrorCode,
    Events,
    EventsReply,
    Lookup,
    LookupReply,
    MissReason,
    Ping,
    Pong,
    ProtocolError,
    Register,
    Registered,
    Release,
    Reply,
    Request,
    Reserve,
    ReserveReply,
    Stats,
    StatsReply,
    deadline_passed,
    decode_request,
    encode,
)
from kvshelf.server.hit_ends import check_ends
from kvshelf.server.index import CacheIndex, RequestRejected
from kvshelf.server.lower_tiers import DeferredLookup, IndexHit
from kvshelf.server.tenants import TenantLedger
from kvshelf.server.tiers.shared_memory import SharedMemoryArena

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _LookupContext:
    """A lookup being answered: the request, the keys looked up for it (its ``hashes``, or
    those :func:`~kvshelf.server.hit_ends.choose_end` picked for its ``ends``) and the block
    its hit would end after (0 without ``ends``)."""

    request: Lookup
    keys: Sequence[bytes]
    end_block: int


# The histogram (kvshelf.metrics.SERVER_TIMINGS) each timed request type is observed in.
_TIMINGS: dict[type, str] = {
    Lookup: "lookup_duration_seconds",
    Reserve: "reserve_duration_seconds",
    Commit: "commit_duration_seconds",
    Abort: "commit_duration_seconds",
    Release: "release_duration_seconds",
}


class RequestHandler:
    """Turns one request frame into one reply frame; owns the request counters.

    Args:
        index: the cache state.
        arena: the shared-memory object whose name and size registrations report.
        boot_id: this server run's id, carried by every reply.
        clock: monotonic time source for leases.
    """

    def __init__(
        self,
        index: CacheIndex,
        arena: SharedMemoryArena,
        boot_id: str,
        clock: Callable[[], float] = time.monotonic,
        tenants: TenantLedger | None = None,
    ) -> None:
        self._index = index
        # Per-tenant metrics: the arena's pools count bytes in it, lookups count hits.
        self._tenants = TenantLedger() if tenants is None else tenants
        self._arena = arena
        self._boot_id = boot_id
        self._clock = clock
        # The node-local socket's name, told to every registration (empty: none), and its
        # client count (serve_locally).
        self._local_socket = ""
        self._local_clients: Callable[[], int] = lambda: 0
        self._started = clock()
        self._counters = index.counters
        # Request handling times (kvshelf.metrics.SERVER_TIMINGS), read by /metrics.
        self.timings = Histograms(SERVER_TIMINGS)
        # (peer identity, reply frame) of deferred lookups answered since the last take.
        self._deferred: list[tuple[bytes, bytes]] = []
        self._handlers: dict[type, Callable[[Request], Reply | DeferredLookup]] = {
            Ping: self._ping,
            Register: self._register,
            Lookup: self._lookup,
            Reserve: self._reserve,
            Commit: self._commit,
            Abort: self._abort,
            Release: self._release,
            Stats: self._stats,
            Clear: self._clear,
            Events: self._events,
        }

    def handle(self, identity: bytes, frame: bytes) -> bytes | None:
        """Answer one frame.

        Args:
            identity: the peer's routing id, for a reply sent later.
            frame: a client's payload frame, possibly garbage.

        Returns:
            The encoded reply (an Error reply for anything invalid or rejected), or None for a
            lookup answered later through :meth:`take_deferred`.
        """
        # No cyclic collection while a request is answered (it runs at the next allocation
        # after, with the request gone): a collection meanwhile would promote what the frame
        # decoded to (up to a frame's worth of lists) into the old generation, and enough such
        # survivors start a full collection, which walks every pool's structures while the
        # loop waits (60-200 ms at 300,000 keys, docs/safety.md).
        gc.disable()
        try:
            return self._handle(identity, frame)
        finally:
            gc.enable()

    def _handle(self, identity: bytes, frame: bytes) -> bytes | None:
        self._counters.add("requests_total")
        try:
            request = decode_request(frame)
        except ProtocolError as exc:
            return self._error(exc.request_id, exc.code, exc.message)
        timing = _TIMINGS.get(type(request))
        started = time.perf_counter()
        try:
            reply = self._handlers[type(request)](request)
        except RequestRejected as exc:
            return self._error(request.request_id, exc.code, exc.message)
        except Exception:
            # A bug, not bad input; keep serving and make it visible.
            logger.exception("internal error handling %s", type(request).__name__)
            return self._error(request.request_id, ErrorCode.INTERNAL, "internal server error")
        finally:
            if timing is not None:
                self.timings.observe(timing, time.perf_counter() - started)
        if type(reply) is DeferredLookup:
            assert type(reply.context) is _LookupContext
            reply.answer = partial(self._answer_later, identity, reply.context)
            return None
        return encode(reply)

    def error_frame(self, code: ErrorCode, message: str) -> bytes:
        """An Error reply for a message whose frames could not even be taken apart."""
        self._counters.add("requests_total")
        return self._error(0, code, message)

    def take_deferred(self) -> list[tuple[bytes, bytes]]:
        """The ``(identity, reply frame)`` pairs of lookups answered since the last call."""
        deferred, self._deferred = self._deferred, []
        return deferred

    def _error(self, request_id: int, code: ErrorCode, message: str) -> bytes:
        self._counters.add("bad_requests_total")
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("bad request %d: %s: %s", request_id, code.name, message)
        return encode(
            Error(request_id=request_id, boot_id=self._boot_id, code=code, message=message)
        )

    def _ping(self, request: Ping) -> Pong:
        return Pong(
            request_id=request.request_id, boot_id=self._boot_id, local_socket=self._local_socket
        )

    def _register(self, request: Register) -> Registered:
        # A registrant without a token yet gets a random one: no client can name (and so let
        # go of) a pool another holds.
        holder = request.holder or secrets.randbits(63) or 1
        pool = self._index.register(request.layout, request.retires, holder)
        return Registered(
            request_id=request.request_id,
            boot_id=self._boot_id,
            pool=pool.name,
            shm_name=self._arena.name,
            arena_bytes=self._arena.size_bytes,
            page_bytes=pool.page_bytes,
            local_socket=self._local_socket,
            holder=holder,
        )

    def _lookup(self, request: Lookup) -> LookupReply | DeferredLookup:
        if deadline_passed(request.deadline_ms):
            # The client gave up (e.g. the server was stalled): a lock now would be held for
            # nobody until its lease ran out.
            self._counters.add("expired_lookups_total")
            raise RequestRejected(ErrorCode.EXPIRED, "the lookup's deadline passed; not locked")
        context = _LookupContext(request, request.hashes, 0)
        if request.ends:
            check_ends(request.hashes, request.block_keys, request.ends)
            keys, end_block = self._index.choose_end(
                request.pool,
                request.world_size,
                request.hashes,
                request.block_keys,
                request.ends,
                request.fetch,
            )
            context = _LookupContext(request, keys, end_block)
        result = self._index.lookup(
            request.pool,
            context.keys,
            request.world_size,
            request.lock,
            self._clock(),
            fetch=request.fetch,
        )
        if type(result) is DeferredLookup:
            result.context = context
            return result
        return self._lookup_reply(context, result)

    def _lookup_reply(self, context: _LookupContext, result: IndexHit | None) -> LookupReply:
        request = context.request
        if result is None:  # tiers below L1 are still loading: the client asks again
            return LookupReply(
                request_id=request.request_id,
                boot_id=self._boot_id,
                num_hit_blocks=0,
                lock_id=0,
                pages=[],
                pending=True,
            )
        num_hits, lock_id, pages = result
        if num_hits:
            self._tenants.add_hits(request.tenant, num_hits)
        reason = MissReason.NONE
        if request.count_miss:
            reason = self._index.count_miss(request.pool, context.keys, num_hits)
        return LookupReply(
            request_id=request.request_id,
            boot_id=self._boot_id,
            num_hit_blocks=num_hits,
            lock_id=lock_id,
            pages=pages,
            miss_reason=reason,
            end_block=context.end_block,
        )

    def _answer_later(
        self, identity: bytes, context: _LookupContext, result: IndexHit | None
    ) -> None:
        request = context.request
        if result is not None and deadline_passed(request.deadline_ms):
            # Fetched too late for the client: unlock at once rather than after the lease.
            if result[1]:
                self._index.unlock(result[1])
            self._counters.add("expired_lookups_total")
            frame = self._error(request.request_id, ErrorCode.EXPIRED, "fetched after the deadline")
        else:
            frame = encode(self._lookup_reply(context, result))
        self._deferred.append((identity, frame))

    def tenant_metrics(self) -> tuple[dict[str, int], dict[str, int]]:
        """L1 bytes and lookup hits per tenant label; safe to call from another thread."""
        return self._tenants.snapshot()

    def _reserve(self, request: Reserve) -> ReserveReply:
        reservation_id, pages = self._index.reserve(
            request.pool, request.rank, request.hashes, self._clock(), request.tenant
        )
        return ReserveReply(
            request_id=request.request_id,
            boot_id=self._boot_id,
            reservation_id=reservation_id,
            pages=pages,
        )

    def _commit(self, request: Commit) -> Ack:
        self._index.commit(request.reservation_id)
        return Ack(request_id=request.request_id, boot_id=self._boot_id)

    def _abort(self, request: Abort) -> Ack:
        self._index.abort(request.reservation_id)
        return Ack(request_id=request.request_id, boot_id=self._boot_id)

    def _release(self, request: Release) -> Ack:
        self._index.release(request.lock_id, request.rank, request.copied)
        return Ack(request_id=request.request_id, boot_id=self._boot_id)

    def serve_locally(self, name: str, clients: Callable[[], int]) -> None:
        """Tell registrations the node-local socket ``name``, and report ``clients()`` (its
        connected clients) in the stats; called once, before the loop serves."""
        self._local_socket = name
        self._local_clients = clients

    def stats(self) -> dict[str, int]:
        """The ``kvshelf stats`` fields; reads ints and sizes only, so /metrics may call it
        from its own thread."""
        stats = self._index.stats()
        # 1 while --prefault is still zeroing the arena in the background (it takes a core).
        stats["arena_zeroing"] = int(self._arena.zeroing)
        stats["uptime_seconds"] = int(self._clock() - self._started)
        stats["local_socket_clients"] = self._local_clients()
        stats["gc_full_collections_total"] = gc.get_stats()[2]["collections"]
        return stats

    def _stats(self, request: Stats) -> StatsReply:
        return StatsReply(
            request_id=request.request_id,
            boot_id=self._boot_id,
            stats=self.stats(),
            pool_objects=self._index.pool_objects(),
        )

    def _events(self, request: Events) -> EventsReply:
        # Each distinct probed hash is looked up once, within the request's budget
        # (kvshelf.server.event_log.probed).
        entries, next_seq, overflowed, present = self._index.read_events(
            request.pool, request.after_seq, request.probe
        )
        return EventsReply(
            request_id=request.request_id,
            boot_id=self._boot_id,
            kinds=[kind for kind, _ in entries],
            hashes=[block_hash for _, block_hash in entries],
            next_seq=next_seq,
            overflowed=overflowed,
            present=present,
        )

    def _clear(self, request: Clear) -> ClearReply:
        cleared, left, locked, on_disk, clearing_shared = self._index.clear(request.shared)
        if left:
            logger.info("kvshelf clear: dropped %d L1 objects, %d left", cleared, left)
        else:
            logger.info(
                "kvshelf clear: dropped %d L1 objects (%d locked ones stay) and %d disk objects%s",
                cleared,
                locked,
                on_disk,
                "; clearing kvshelf's keys in Redis" if clearing_shared else "",
            )
        return ClearReply(
            request_id=request.request_id,
            boot_id=self._boot_id,
            cleared_objects=cleared,
            locked_objects=locked,
            cleared_disk_objects=on_disk,
            clearing_shared=clearing_shared,
            remaining_objects=left,
        )
