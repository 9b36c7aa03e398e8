"""The server's socket loop: a ZMQ ROUTER that decodes requests, drives the index and replies.

Each request is answered by exactly one reply frame. Any frame that is not a valid request of
this protocol version, and any request the index rejects, is answered with an
:class:`~kvshelf.protocol.Error` reply, changes no state and counts in ``bad_requests_total``.
Nothing a client sends can stop the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from kvshelf.protocol import (
    MAX_FRAME_BYTES,
    Abort,
    Ack,
    Commit,
    Error,
    ErrorCode,
    Lookup,
    LookupReply,
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
    decode_request,
    encode,
)
from kvshelf.server.arena import SharedMemoryArena
from kvshelf.server.index import CacheIndex, RequestRejected

logger = logging.getLogger(__name__)

# ZMQ drops (and disconnects) a peer whose message exceeds this, so a huge frame never reaches
# memory; frames between MAX_FRAME_BYTES and this still get a FRAME_TOO_LARGE reply.
TRANSPORT_MAX_MESSAGE_BYTES = 16 * MAX_FRAME_BYTES
# How long the loop sleeps when idle before it sweeps expired leases and checks for a stop.
POLL_INTERVAL_MS = 100
# Requests handled per wake-up before the next lease sweep, so a flood cannot starve expiry.
MAX_BURST = 256


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
    ) -> None:
        self._index = index
        self._arena = arena
        self._boot_id = boot_id
        self._clock = clock
        self.requests_total = 0
        self.bad_requests_total = 0
        self._handlers: dict[type, Callable[[Request], Reply]] = {
            Ping: self._ping,
            Register: self._register,
            Lookup: self._lookup,
            Reserve: self._reserve,
            Commit: self._commit,
            Abort: self._abort,
            Release: self._release,
            Stats: self._stats,
        }

    def handle(self, frame: bytes) -> bytes:
        """Answer one frame.

        Args:
            frame: a client's payload frame, possibly garbage.

        Returns:
            The encoded reply; an Error reply for anything invalid or rejected.
        """
        self.requests_total += 1
        try:
            request = decode_request(frame)
        except ProtocolError as exc:
            return self._error(exc.request_id, exc.code, exc.message)
        try:
            reply = self._handlers[type(request)](request)
        except RequestRejected as exc:
            return self._error(request.request_id, exc.code, exc.message)
        except Exception:
            # A bug, not bad input; keep serving and make it visible.
            logger.exception("internal error handling %s", type(request).__name__)
            return self._error(request.request_id, ErrorCode.INTERNAL, "internal server error")
        return encode(reply)

    def error_frame(self, code: ErrorCode, message: str) -> bytes:
        """An Error reply for a message whose frames could not even be taken apart."""
        self.requests_total += 1
        return self._error(0, code, message)

    def _error(self, request_id: int, code: ErrorCode, message: str) -> bytes:
        self.bad_requests_total += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("bad request %d: %s: %s", request_id, code.name, message)
        return encode(
            Error(request_id=request_id, boot_id=self._boot_id, code=code, message=message)
        )

    def _ping(self, request: Ping) -> Pong:
        return Pong(request_id=request.request_id, boot_id=self._boot_id)

    def _register(self, request: Register) -> Registered:
        pool = self._index.register(request.layout)
        return Registered(
            request_id=request.request_id,
            boot_id=self._boot_id,
            pool=pool.name,
            shm_name=self._arena.name,
            arena_bytes=self._arena.size_bytes,
            page_bytes=pool.page_bytes,
        )

    def _lookup(self, request: Lookup) -> LookupReply:
        num_hits, lock_id, pages = self._index.lookup(
            request.pool, request.hashes, request.world_size, request.lock, self._clock()
        )
        return LookupReply(
            request_id=request.request_id,
            boot_id=self._boot_id,
            num_hit_blocks=num_hits,
            lock_id=lock_id,
            pages=pages,
        )

    def _reserve(self, request: Reserve) -> ReserveReply:
        reservation_id, pages = self._index.reserve(
            request.pool, request.rank, request.hashes, self._clock()
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
        self._index.release(request.lock_id, request.rank)
        return Ack(request_id=request.request_id, boot_id=self._boot_id)

    def _stats(self, request: Stats) -> StatsReply:
        stats = self._index.stats()
        stats["requests_total"] = self.requests_total
        stats["bad_requests_total"] = self.bad_requests_total
        # 1 while --prefault is still zeroing the arena in the background (it takes a core).
        stats["arena_zeroing"] = int(self._arena.zeroing)
        return StatsReply(request_id=request.request_id, boot_id=self._boot_id, stats=stats)


class ServerLoop:
    """Binds the ROUTER socket and serves until asked to stop.

    Args:
        handler: answers frames.
        index: swept for expired leases between bursts.
        endpoint: ZMQ endpoint to bind, e.g. ``tcp://127.0.0.1:5555``.
        context: the ZMQ context; the loop closes only its own socket.
    """

    def __init__(
        self, handler: RequestHandler, index: CacheIndex, endpoint: str, context: zmq.Context
    ) -> None:
        self._handler = handler
        self._index = index
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IPV6, 1)  # dual stack: IPv6 hosts and "localhost" work
        self._socket.setsockopt(zmq.MAXMSGSIZE, TRANSPORT_MAX_MESSAGE_BYTES)
        self._socket.bind(endpoint)
        self.endpoint = endpoint

    def run(self, should_stop: Callable[[], bool]) -> None:
        """Serve requests until ``should_stop()`` is true (checked at least every 100 ms)."""
        socket = self._socket
        while not should_stop():
            if socket.poll(POLL_INTERVAL_MS, zmq.POLLIN):
                for _ in range(MAX_BURST):
                    try:
                        frames = socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._answer(frames)
            self._index.expire(time.monotonic())

    def _answer(self, frames: list[bytes]) -> None:
        # ROUTER prepends the peer's routing id; a DEALER client sends exactly one payload.
        identity = frames[0]
        if len(frames) == 2:
            reply = self._handler.handle(frames[1])
        else:
            reply = self._handler.error_frame(
                ErrorCode.MALFORMED, f"expected 1 payload frame, got {len(frames) - 1}"
            )
        try:
            # NOBLOCK: a peer that stopped reading loses its reply instead of stalling the loop.
            self._socket.send_multipart([identity, reply], zmq.NOBLOCK)
        except zmq.Again:
            logger.debug("dropped a reply to a peer that is not reading")

    def close(self) -> None:
        """Close the socket."""
        self._socket.close(linger=0)
