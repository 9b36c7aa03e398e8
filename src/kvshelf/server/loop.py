"""The server's socket loop: a ZMQ ROUTER (and the node-local socket, when there is one) that
feeds request frames to the handler and sends its replies, runs the completions tiers post from
their threads, and sweeps expired leases.

Nothing a client sends can stop the loop. It never waits on anything but its poll, so a tier
below L1 only ever reaches it through :class:`~kvshelf.server.completions.Completions`. Must
not import torch or vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvshelf.curve import ServerCurve
from kvshelf.protocol import ErrorCode
from kvshelf.server.completions import Completions
from kvshelf.server.handler import RequestHandler
from kvshelf.server.index import CacheIndex
from kvshelf.server.limits import RECEIVE_HWM_FRAMES, TRANSPORT_MAX_MESSAGE_BYTES
from kvshelf.server.local_socket import LocalListener
from kvshelf.server.lower_tiers import FETCH_POLL_INTERVAL_S

logger = logging.getLogger(__name__)

# How long the loop sleeps when idle before it sweeps expired leases and checks for a stop.
POLL_INTERVAL_MS = 100
# Handshakes refused: no CURVE key (mechanism mismatch), or a key not in the allow-list (ZAP).
REFUSED_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
# Requests handled per wake-up before the next lease sweep, so a flood cannot starve expiry.
MAX_BURST = 256


class ServerLoop:
    """Binds the ROUTER socket and serves until asked to stop.

    Args:
        handler: answers frames.
        index: swept for expired leases between bursts.
        endpoint: ZMQ endpoint to bind, e.g. ``tcp://127.0.0.1:5555``.
        context: the ZMQ context; the loop closes only its own socket.
        completions: the jobs tiers below L1 finished, run on the loop.
        on_wake: called with the monotonic time after every wake-up (the periodic stats line).
        curve: the server's CURVE keys; the context's ZAP authenticator (started by the
            caller) then decides which clients are answered, and every refused handshake
            counts in ``rejected_handshakes_total``.
        local: the node-local socket (:mod:`kvshelf.server.local_socket`), served by this
            loop beside ZMQ and closed with it; None: ZMQ only.
    """

    def __init__(
        self,
        handler: RequestHandler,
        index: CacheIndex,
        endpoint: str,
        context: zmq.Context,
        completions: Completions,
        on_wake: Callable[[float], None] | None = None,
        curve: ServerCurve | None = None,
        local: LocalListener | None = None,
    ) -> None:
        self._handler = handler
        self._local = local
        self._on_wake = on_wake
        self._index = index
        self._completions = completions
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IPV6, 1)  # dual stack: IPv6 hosts and "localhost" work
        # Together these bound what ZeroMQ buffers per client (kvshelf.server.limits,
        # CLIENT_BUFFER_BYTES): a larger message disconnects its peer before it is read, and
        # a client past the mark waits in TCP flow control.
        self._socket.setsockopt(zmq.MAXMSGSIZE, TRANSPORT_MAX_MESSAGE_BYTES)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM_FRAMES)
        self._monitor: zmq.Socket | None = None
        if curve is not None:
            curve.apply(self._socket)
            # Refused handshakes never reach the handler: count them from the socket's events.
            self._monitor = self._socket.get_monitor_socket(REFUSED_HANDSHAKE_EVENTS)
        self._socket.bind(endpoint)
        self.endpoint = endpoint
        # time.monotonic() at the end of the latest loop iteration (at least every 100 ms).
        self.heartbeat = time.monotonic()

    def run(self, should_stop: Callable[[], bool]) -> None:
        """Serve requests until ``should_stop()`` is true (checked at least every 100 ms)."""
        socket = self._socket
        completions = self._completions
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        completions_fd = completions.fileno()
        poller.register(completions_fd, zmq.POLLIN)
        monitor = self._monitor
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        local = self._local
        local_fd = local.fileno() if local is not None else None
        if local_fd is not None:
            poller.register(local_fd, zmq.POLLIN)
        fetch_poll_ms = max(1, int(FETCH_POLL_INTERVAL_S * 1000))
        while not should_stop():
            # While lookups wait for tiers below L1, wake often enough to meet their deadlines;
            # with lapsed reservations left (expire ends a request's bound of them per call),
            # look for requests and go on at once.
            if self._index.lapsed(self.heartbeat):
                timeout_ms = 0
            elif self._index.fetching:
                timeout_ms = fetch_poll_ms
            else:
                timeout_ms = POLL_INTERVAL_MS
            events = poller.poll(timeout_ms)
            if events:
                if monitor is not None:
                    self._count_refused(monitor)
                # Finished jobs first, so that the requests after them see their effects.
                if any(source == completions_fd for source, _ in events):
                    completions.run()
                    for identity, reply in self._handler.take_deferred():
                        self._send(identity, reply)
                if local is not None and any(source == local_fd for source, _ in events):
                    local.serve()
                # Ask the socket whether more is queued rather than catching zmq.Again: a
                # failing receive costs more than the question, on every request.
                for _ in range(MAX_BURST):
                    if not socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
                    self._answer(socket.recv_multipart(zmq.NOBLOCK))
            now = time.monotonic()
            # Read by /healthz from another thread: the loop is alive while this moves.
            self.heartbeat = now
            self._index.expire(now)
            # Lookups expire() answered "pending" go now, not when their loads end.
            for identity, reply in self._handler.take_deferred():
                self._send(identity, reply)
            if self._on_wake is not None:
                self._on_wake(now)

    def _answer(self, frames: list[bytes]) -> None:
        # ROUTER prepends the peer's routing id; a DEALER client sends exactly one payload.
        identity = frames[0]
        if len(frames) == 2:
            reply = self._handler.handle(identity, frames[1])
            if reply is None:  # answered later, once tiers below L1 have loaded its blocks
                return
        else:
            reply = self._handler.error_frame(
                ErrorCode.MALFORMED, f"expected 1 payload frame, got {len(frames) - 1}"
            )
        self._send(identity, reply)

    def _send(self, identity: bytes, reply: bytes) -> None:
        if self._local is not None and self._local.owns(identity):
            self._local.send(identity, reply)
            return
        try:
            # NOBLOCK: a peer that stopped reading loses its reply instead of stalling the loop.
            self._socket.send_multipart([identity, reply], zmq.NOBLOCK)
        except zmq.Again:
            logger.debug("dropped a reply to a peer that is not reading")

    def _count_refused(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if parse_monitor_message(frames)["event"] & REFUSED_HANDSHAKE_EVENTS:
                self._index.counters.add("rejected_handshakes_total")

    def close(self) -> None:
        """Close the socket (and its monitor, and the local socket)."""
        if self._local is not None:
            self._local.close()
        if self._monitor is not None:
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
        self._socket.close(linger=0)
