"""The server's socket loop: a ZMQ ROUTER that feeds request frames to the handler and sends
its replies, runs the completions tiers post from their threads, and sweeps expired leases.

Nothing a client sends can stop the loop. It never waits on anything but its poll, so a tier
below L1 only ever reaches it through :class:`~kvshelf.server.completions.Completions`. Must
not import torch or vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from kvshelf.protocol import MAX_FRAME_BYTES, ErrorCode
from kvshelf.server.completions import Completions
from kvshelf.server.handler import RequestHandler
from kvshelf.server.index import CacheIndex
from kvshelf.server.lower_tiers import FETCH_POLL_INTERVAL_S

logger = logging.getLogger(__name__)

# ZMQ drops (and disconnects) a peer whose message exceeds this, so a huge frame never reaches
# memory; frames between MAX_FRAME_BYTES and this still get a FRAME_TOO_LARGE reply.
TRANSPORT_MAX_MESSAGE_BYTES = 16 * MAX_FRAME_BYTES
# How long the loop sleeps when idle before it sweeps expired leases and checks for a stop.
POLL_INTERVAL_MS = 100
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
    """

    def __init__(
        self,
        handler: RequestHandler,
        index: CacheIndex,
        endpoint: str,
        context: zmq.Context,
        completions: Completions,
    ) -> None:
        self._handler = handler
        self._index = index
        self._completions = completions
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IPV6, 1)  # dual stack: IPv6 hosts and "localhost" work
        self._socket.setsockopt(zmq.MAXMSGSIZE, TRANSPORT_MAX_MESSAGE_BYTES)
        self._socket.bind(endpoint)
        self.endpoint = endpoint

    def run(self, should_stop: Callable[[], bool]) -> None:
        """Serve requests until ``should_stop()`` is true (checked at least every 100 ms)."""
        socket = self._socket
        completions = self._completions
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(completions.fileno(), zmq.POLLIN)
        fetch_poll_ms = max(1, int(FETCH_POLL_INTERVAL_S * 1000))
        while not should_stop():
            # While lookups wait for tiers below L1, wake often enough to meet their deadlines.
            events = poller.poll(fetch_poll_ms if self._index.fetching else POLL_INTERVAL_MS)
            if events:
                # Finished jobs first, so that the requests after them see their effects.
                if len(events) > 1 or events[0][0] is not socket:
                    completions.run()
                    for identity, reply in self._handler.take_deferred():
                        self._send(identity, reply)
                for _ in range(MAX_BURST):
                    try:
                        frames = socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._answer(frames)
            self._index.expire(time.monotonic())
            # Lookups expire() answered "pending" go now, not when their loads end.
            for identity, reply in self._handler.take_deferred():
                self._send(identity, reply)

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
        try:
            # NOBLOCK: a peer that stopped reading loses its reply instead of stalling the loop.
            self._socket.send_multipart([identity, reply], zmq.NOBLOCK)
        except zmq.Again:
            logger.debug("dropped a reply to a peer that is not reading")

    def close(self) -> None:
        """Close the socket."""
        self._socket.close(linger=0)
