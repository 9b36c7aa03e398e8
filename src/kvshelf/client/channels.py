"""The two ways a connection carries frames to its server: a ZMQ DEALER socket, which reaches
any host, and the server's node-local Unix socket (:mod:`kvshelf.server.local_socket`), which
reaches only its node but costs a fraction of ZMQ's round trip.

A channel sends a frame without waiting for the reply, says whether a reply can be received,
and receives one; every fault of the transport is a :class:`ChannelError`. Which channel is in
use, and what a fault does, is :class:`~kvshelf.client.connection.Connection`'s business.

Imports only the protocol's limits: no vLLM or torch.
"""

from __future__ import annotations

import math
import os
import select
import socket
import struct
from typing import Protocol

import zmq

from kvshelf.curve import ClientCurve
from kvshelf.protocol import MAX_FRAME_BYTES

# The local socket's frame header: the length of the message that follows (little-endian).
_HEADER = struct.Struct("<I")
# The largest reply accepted: the server never sends more than a frame's limit per rank share.
MAX_REPLY_BYTES = 16 * MAX_FRAME_BYTES


class ChannelError(Exception):
    """The channel cannot be used any more (refused, reset, closed, a stalled reply)."""


class Channel(Protocol):
    kind: str

    def send(self, frame: bytes) -> None: ...

    def wait_readable(self, timeout_s: float) -> bool: ...

    def readable(self) -> bool: ...

    def recv(self) -> bytes: ...

    def close(self) -> None: ...


class ZmqChannel:
    """A DEALER socket connected to ``endpoint``; connecting never fails (ZMQ retries), so a
    server that is down looks like one that does not answer."""

    kind = "zmq"

    def __init__(self, context: zmq.Context, endpoint: str, curve: ClientCurve | None) -> None:
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IPV6, 1)  # dual stack, so an IPv6 server address works
        if curve is not None:
            curve.apply(self._socket)
        self._socket.connect(endpoint)
        # Socket.poll would build a new poller on every call (every reply).
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)

    def send(self, frame: bytes) -> None:
        try:
            # A DEALER queues for a peer that is still connecting; NOBLOCK only fails once its
            # queue is full, which means the server is not reading.
            self._socket.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise ChannelError(str(exc)) from None

    def wait_readable(self, timeout_s: float) -> bool:
        try:
            return bool(self._poller.poll(max(1, math.ceil(timeout_s * 1000))))
        except zmq.ZMQError as exc:
            raise ChannelError(str(exc)) from None

    def readable(self) -> bool:
        try:
            return bool(self._socket.poll(0, zmq.POLLIN))
        except zmq.ZMQError as exc:
            raise ChannelError(str(exc)) from None

    def recv(self) -> bytes:
        try:
            return self._socket.recv(zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise ChannelError(str(exc)) from None

    def close(self) -> None:
        self._socket.close(linger=0)


class LocalChannel:
    """A stream connection to the server's abstract Unix socket ``name``.

    Frames are length-prefixed. A send, or a reply under way, that makes no progress for
    ``timeout_s`` is a :class:`ChannelError`: the stream may then be mid-frame, so it cannot be
    used again.

    Raises:
        OSError: nobody listens on ``name`` (another network namespace, a server gone), or a
            process of another user than this one or root does: anyone can bind an abstract
            name, so the listener's credentials are checked before it is trusted.
    """

    kind = "local"

    def __init__(self, name: str, timeout_s: float) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.settimeout(timeout_s)
            self._sock.connect("\0" + name)
            pid, uid, _ = struct.unpack(
                "3i", self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            )
            if uid not in (os.geteuid(), 0):
                raise PermissionError(f"@{name} is served by pid {pid} of uid {uid}")
        except OSError:
            self._sock.close()
            raise
        self._poll = select.poll()
        self._poll.register(self._sock.fileno(), select.POLLIN)

    def send(self, frame: bytes) -> None:
        try:
            self._sock.sendall(_HEADER.pack(len(frame)) + frame)
        except OSError as exc:
            raise ChannelError(f"local socket: {exc}") from None

    def wait_readable(self, timeout_s: float) -> bool:
        return bool(self._poll.poll(max(1, math.ceil(timeout_s * 1000))))

    def readable(self) -> bool:
        return bool(self._poll.poll(0))

    def recv(self) -> bytes:
        (length,) = _HEADER.unpack(self._read(_HEADER.size))
        if length > MAX_REPLY_BYTES:
            raise ChannelError(f"local socket: a reply of {length} bytes")
        return self._read(length)

    def close(self) -> None:
        self._sock.close()

    def _read(self, nbytes: int) -> bytes:
        """Exactly ``nbytes``; each wait for more is bounded by the timeout."""
        buffer = bytearray(nbytes)
        view = memoryview(buffer)
        got = 0
        try:
            while got < nbytes:
                received = self._sock.recv_into(view[got:])
                if received == 0:
                    raise ChannelError("local socket: the server closed the connection")
                got += received
        except OSError as exc:  # socket.timeout is an OSError
            raise ChannelError(f"local socket: {exc}") from None
        return bytes(buffer)
