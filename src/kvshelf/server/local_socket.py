"""The server's node-local control socket: the ZMQ socket's requests and replies, over a Unix
stream socket in the abstract namespace, for clients on the server's node.

Why a second socket: a ZMQ request and its reply each cross the client's and the server's ZMQ
I/O threads, four thread wake-ups per round trip besides the two a socket needs. On a small
VM an idle core's wake-up is tens of microseconds, so a ZMQ ping took 165-373 µs where the
same ping over a Unix socket took 18-51 µs (``docs/transfer-path.md``). Workers map the
arena, so they always share the server's node. The socket's name follows from the port and the
boot id (:func:`kvshelf.protocol.local_socket_name`), which every reply carries, so a client
moves its calls here after its first reply (:mod:`kvshelf.client.connection`), and keeps ZMQ
where it cannot connect (another network namespace, ``--no-local-socket``).

Framing: every frame is a 4-byte little-endian length, then that many bytes of one message
(:mod:`kvshelf.protocol`): the same bytes a ZMQ frame carries, answered by the same handler.
A length over ``MAX_FRAME_BYTES`` gets a ``FRAME_TOO_LARGE`` error and the connection is
closed, since the stream cannot be resynchronised without reading the frame.

Who is served: an abstract name is reachable from every process in the server's network
namespace, so each connection's peer credentials (``SO_PEERCRED``) are checked, and only the
server's own user and root are served: the users that can map the arena (mode 0600). Any other
is closed at once and counted in ``rejected_handshakes_total``.

The listener is one epoll descriptor the socket loop polls beside ZMQ; it never blocks: replies
a client does not read wait in a bounded outbox, and a client over the bound is disconnected.
Must not import torch or vLLM.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import struct
from collections.abc import Callable

from kvshelf.protocol import MAX_FRAME_BYTES, ErrorCode

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<I")
# Each wake-up reads at most this much of a connection (more when a frame needs it), which
# bounds the requests one client can put ahead of the loop's lease sweep.
READ_BYTES = 64 * 1024
# Replies waiting for a client that does not read; beyond this the client is dropped.
MAX_OUTBOX_BYTES = 4 * MAX_FRAME_BYTES
MAX_CONNECTIONS = 1024
# Routing ids of local clients start with a zero byte and are longer than ZMQ's own 5-byte
# ids; ZMQ refuses peer-chosen ids that start with zero, so the two never collide.
_IDENTITY_PREFIX = b"\x00local"

Answer = Callable[[bytes, bytes], "bytes | None"]
ErrorFrame = Callable[[ErrorCode, str], bytes]


class _Connection:
    __slots__ = ("identity", "inbox", "outbox", "sock", "waiting_to_write")

    def __init__(self, sock: socket.socket, identity: bytes) -> None:
        self.sock = sock
        self.identity = identity
        self.inbox = bytearray()
        self.outbox = bytearray()
        # Whether epoll also watches for the socket taking more of the outbox.
        self.waiting_to_write = False


class LocalListener:
    """Accepts local clients and answers their frames with ``answer``.

    Args:
        name: the abstract socket name (:func:`kvshelf.protocol.local_socket_name`).
        answer: ``(identity, frame) -> reply`` (None: answered later through :meth:`send`).
        error_frame: builds an error reply frame.
        on_refused: called for each connection refused for its peer's user.

    Raises:
        OSError: the name cannot be bound.
    """

    def __init__(
        self,
        name: str,
        answer: Answer,
        error_frame: ErrorFrame,
        on_refused: Callable[[], None],
    ) -> None:
        self.name = name
        self._answer = answer
        self._error_frame = error_frame
        self._on_refused = on_refused
        self._uid = os.geteuid()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._listener.bind("\0" + name)
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self._epoll = select.epoll()
        self._epoll.register(self._listener.fileno(), select.EPOLLIN)
        self._by_fd: dict[int, _Connection] = {}
        self._by_identity: dict[bytes, _Connection] = {}
        self._next_id = 0
        self._full_logged = False

    def fileno(self) -> int:
        """The descriptor the loop polls: readable when a client connects, sends or can take a
        waiting reply."""
        return self._epoll.fileno()

    @property
    def connections(self) -> int:
        """Clients connected now (read by /metrics from its own thread: one ``len``)."""
        return len(self._by_fd)

    def owns(self, identity: bytes) -> bool:
        """Whether ``identity`` names a connected local client."""
        return identity in self._by_identity

    def serve(self) -> None:
        """Accept, read and answer what is ready now; never blocks."""
        for fd, events in self._epoll.poll(0):
            if fd == self._listener.fileno():
                self._accept()
                continue
            conn = self._by_fd.get(fd)
            if conn is None:
                continue
            if events & (select.EPOLLERR | select.EPOLLHUP) and not events & select.EPOLLIN:
                self._drop(conn)
                continue
            if events & select.EPOLLOUT and not self._flush(conn):
                continue
            if events & select.EPOLLIN:
                self._read(conn)

    def send(self, identity: bytes, frame: bytes) -> None:
        """Send a reply to the local client ``identity`` (dropped if it is gone)."""
        conn = self._by_identity.get(identity)
        if conn is not None:
            self._queue(conn, frame)

    def close(self) -> None:
        for conn in list(self._by_fd.values()):
            self._drop(conn)
        self._epoll.close()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of descriptors: try again on the next wake-up
                logger.warning("local socket: cannot accept a client: %s", exc)
                return
            pid, uid, _gid = struct.unpack(
                "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            )
            if uid not in (self._uid, 0):
                logger.warning(
                    "local socket: refused pid %d of uid %d (only uid %d and root may connect)",
                    pid,
                    uid,
                    self._uid,
                )
                self._on_refused()
                sock.close()
                continue
            if len(self._by_fd) >= MAX_CONNECTIONS:
                if not self._full_logged:
                    logger.warning(
                        "local socket: %d clients connected; later ones use ZMQ", MAX_CONNECTIONS
                    )
                    self._full_logged = True
                sock.close()
                continue
            sock.setblocking(False)
            self._next_id += 1
            conn = _Connection(sock, _IDENTITY_PREFIX + self._next_id.to_bytes(8, "little"))
            self._by_fd[sock.fileno()] = conn
            self._by_identity[conn.identity] = conn
            self._epoll.register(sock.fileno(), select.EPOLLIN)

    def _read(self, conn: _Connection) -> None:
        inbox = conn.inbox
        want = READ_BYTES
        if len(inbox) >= HEADER.size:
            (length,) = HEADER.unpack_from(inbox)
            want = max(want, HEADER.size + length - len(inbox))
        try:
            data = conn.sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data:
            self._drop(conn)
            return
        inbox += data
        start = 0
        while len(inbox) - start >= HEADER.size:
            (length,) = HEADER.unpack_from(inbox, start)
            if length > MAX_FRAME_BYTES:
                self._queue(
                    conn,
                    self._error_frame(
                        ErrorCode.FRAME_TOO_LARGE,
                        f"frame of {length} bytes exceeds the limit of {MAX_FRAME_BYTES}",
                    ),
                )
                self._drop(conn, flush=True)
                return
            end = start + HEADER.size + length
            if end > len(inbox):
                break
            reply = self._answer(conn.identity, bytes(inbox[start + HEADER.size : end]))
            start = end
            if reply is not None:
                self._queue(conn, reply)
                if conn.identity not in self._by_identity:
                    return  # dropped: its outbox overflowed
        del inbox[:start]

    def _queue(self, conn: _Connection, frame: bytes) -> None:
        conn.outbox += HEADER.pack(len(frame))
        conn.outbox += frame
        if len(conn.outbox) > MAX_OUTBOX_BYTES:
            logger.warning(
                "local socket: dropped a client that left %d reply bytes unread", len(conn.outbox)
            )
            self._drop(conn)
        elif not conn.waiting_to_write:
            self._flush(conn)

    def _flush(self, conn: _Connection) -> bool:
        """Send what the socket takes now, and watch it for more while some is left; False if
        the connection was dropped."""
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                logger.debug("local socket: send failed: %s", exc)
            self._drop(conn)
            return False
        del conn.outbox[:sent]
        if bool(conn.outbox) != conn.waiting_to_write:
            conn.waiting_to_write = bool(conn.outbox)
            mask = select.EPOLLIN | (select.EPOLLOUT if conn.waiting_to_write else 0)
            self._epoll.modify(conn.sock.fileno(), mask)
        return True

    def _drop(self, conn: _Connection, *, flush: bool = False) -> None:
        if flush and conn.outbox:
            # A last error reply, best effort: the socket is not waited for.
            with contextlib.suppress(OSError):
                conn.sock.send(conn.outbox)
        fd = conn.sock.fileno()
        if self._by_fd.pop(fd, None) is None:
            return
        del self._by_identity[conn.identity]
        self._epoll.unregister(fd)
        conn.sock.close()
