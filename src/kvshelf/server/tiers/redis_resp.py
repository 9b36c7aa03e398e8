"""RESP framing on a Redis connection's socket, for the Redis tier's bulk data only.

A value of MiBs parsed by a client library becomes a fresh ``bytes`` that is then copied into
its L1 page. :class:`ReplyReader` instead reads each reply's header line into a small buffer
and receives a value's bytes straight into the caller's buffer (``recv_into``, which releases
the GIL); :func:`send_all` sends a command given in pieces (a page among them) with one
scatter-gather ``sendmsg`` instead of joining them. Connection set-up (AUTH, TLS, the cluster
slot map) and every other command stay with the ``redis`` client, whose connections these
sockets are.

The reader is strict: any bytes that are not the reply expected, and any error reply but a
cluster redirect, raise :class:`FramingError`, after which the connection's position in the
stream is unknown and the caller must close it. A peer that closes mid-reply raises
``ConnectionError`` (an ``OSError``, as are the socket's timeouts).

Deadlines: a socket timeout bounds each receive, not a reply, so a peer sending a byte now and
then would hold a reader for ever. Given a ``deadline`` (a :func:`time.monotonic` time), the
reader and :func:`send_all` give every receive and send only the time left before it
(:func:`arm`), and raise :class:`TimeoutError` once it has passed. Must not import torch, vLLM
or the ``redis`` package.
"""

from __future__ import annotations

import os
import socket
import ssl
import time
from collections.abc import Callable, Sequence

CRLF = b"\r\n"
# Bytes asked of the socket when a reply's header, a value's header or its tag is needed: a
# few KiB of the payload that follows come with them and are copied from here, the rest is
# received straight into the caller's buffer.
READ_AHEAD = 16 * 1024
# A reply line longer than this is not a bulk length nor a redirect: the stream is not RESP.
MAX_LINE = 4096
# Redis refuses bulk strings over 512 MiB (proto-max-bulk-len's default).
MAX_BULK = 512 * 1024 * 1024
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
# A TLS socket sends a piece in one call, whose timeout restarts with each record it writes:
# pieces are sent in slices of this size, each given the time left.
TLS_SLICE = 1 << 20


class FramingError(Exception):
    """A reply that is not the one expected, or an error reply: the connection is out of step."""


class Redirect:
    """A cluster redirect reply (``MOVED``/``ASK``): the key lives on another master."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def time_left(deadline: float) -> float:
    """The seconds left before ``deadline``.

    Raises:
        TimeoutError: it has passed.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the Redis operation's deadline passed")
    return left


def arm(sock: socket.socket, deadline: float) -> None:
    """Give ``sock``'s next call the time left before ``deadline``.

    Raises:
        TimeoutError: the deadline has passed.
    """
    sock.settimeout(time_left(deadline))


class ReplyReader:
    """Replies read off ``sock``, in order.

    Args:
        sock: a connected socket.
        deadline: when every reply must be in (:func:`time.monotonic`): each receive gets the
            time left. None: the socket's own timeout applies to each receive.
    """

    def __init__(self, sock: socket.socket, deadline: float | None = None) -> None:
        self._sock = sock
        self._deadline = deadline
        self._buf = bytearray(READ_AHEAD)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._drain: memoryview | None = None

    @property
    def pending(self) -> int:
        """Bytes received but not consumed yet (none once every reply sent was read)."""
        return self._end - self._start

    def bulk(self) -> int | Redirect | None:
        """The next reply's header: a bulk string's length, None for a nil (``$-1``, or ``_``
        in RESP3: no such key), or a :class:`Redirect`. The caller then consumes the string
        and its CRLF.

        Raises:
            FramingError: another reply (an error reply's message is in the exception).
        """
        line = self._line()
        if line[:1] != b"$" and line != b"_":
            return self._refuse(line)
        if line in (b"$-1", b"_"):
            return None
        digits = line[1:]
        if not digits.isdigit() or len(digits) > 10 or int(digits) > MAX_BULK:
            raise FramingError(f"bad bulk length {_shown(line)}")
        return int(digits)

    def status(self) -> Redirect | None:
        """The next reply, a status (``+OK``): None, or a :class:`Redirect`.

        Raises:
            FramingError: another reply.
        """
        line = self._line()
        if line == b"+OK":
            return None
        return self._refuse(line)

    def integer(self) -> int | Redirect:
        """The next reply, an integer (``:1``, as ``EXISTS`` answers), or a :class:`Redirect`.

        Raises:
            FramingError: another reply.
        """
        line = self._line()
        if line[:1] != b":":
            return self._refuse(line)
        digits = line[1:]
        if not digits.isdigit() or len(digits) > 19:
            raise FramingError(f"bad integer reply {_shown(line)}")
        return int(digits)

    def array(self) -> int:
        """The next reply's header, an array's length (``*2``, as ``SCAN`` answers); the caller
        then reads its elements.

        Raises:
            FramingError: another reply, or a nil array.
        """
        line = self._line()
        digits = line[1:]
        if line[:1] != b"*" or not digits.isdigit() or len(digits) > 10:
            self._refuse(line)
            raise FramingError(f"unexpected reply {_shown(line)}")
        return int(digits)

    def read_into(
        self, dest: memoryview, landed: Callable[[memoryview], object] | None = None
    ) -> None:
        """Fill ``dest`` with the next ``dest.nbytes`` bytes; ``landed`` sees each piece as it
        arrives (to hash it while it is in the cache)."""
        size = dest.nbytes
        done = min(size, self.pending)
        if done:
            dest[:done] = self._view[self._start : self._start + done]
            self._start += done
            if landed is not None:
                landed(dest[:done])
        while done < size:
            got = self._recv_into(dest[done:])
            if got == 0:
                raise ConnectionError("Redis closed the connection mid-reply")
            if landed is not None:
                landed(dest[done : done + got])
            done += got

    def exact(self, size: int) -> bytes:
        """The next ``size`` bytes (a header or a tag: small)."""
        out = bytearray(size)
        self.read_into(memoryview(out))
        return bytes(out)

    def skip(self, size: int) -> None:
        """Consume the next ``size`` bytes (a value that is not loaded)."""
        if self._drain is None:
            self._drain = memoryview(bytearray(1 << 20))
        while size:
            step = min(size, self._drain.nbytes)
            self.read_into(self._drain[:step])
            size -= step

    def end(self) -> None:
        """Consume the CRLF that ends a bulk string."""
        if self.exact(2) != CRLF:
            raise FramingError("a bulk string not ended by CRLF")

    def _line(self) -> bytes:
        while True:
            at = self._buf.find(CRLF, self._start, self._end)
            if at >= 0:
                line = bytes(self._view[self._start : at])
                self._start = at + 2
                return line
            if self.pending >= MAX_LINE:
                raise FramingError(f"no reply line in {MAX_LINE} bytes")
            self._fill()

    def _fill(self) -> None:
        """Receive more bytes after the ones pending, moving those to the front first."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            kept = self.pending
            self._buf[:kept] = self._view[self._start : self._end]
            self._start, self._end = 0, kept
        got = self._recv_into(self._view[self._end :])
        if got == 0:
            raise ConnectionError("Redis closed the connection mid-reply")
        self._end += got

    def _recv_into(self, dest: memoryview) -> int:
        if self._deadline is None:
            return self._sock.recv_into(dest)
        arm(self._sock, self._deadline)
        try:
            return self._sock.recv_into(dest)
        except TimeoutError as exc:
            raise TimeoutError("the Redis operation's deadline passed mid-reply") from exc

    def _refuse(self, line: bytes) -> Redirect:
        """A redirect, or raise for an error reply or anything else."""
        if line[:1] == b"-":
            message = line[1:].decode("utf-8", "replace")
            if message.startswith(("MOVED ", "ASK ")):
                return Redirect(message)
            raise FramingError(f"error reply: {message[:200]}")
        raise FramingError(f"unexpected reply {_shown(line)}")


def set_command(
    key: bytes, value: Sequence[bytes | memoryview], px_ms: int | None
) -> list[bytes | memoryview]:
    """``SET key value [PX ms]`` in RESP as pieces to send in order, ``value`` given in pieces
    of its own (never joined)."""
    size = sum(memoryview(piece).nbytes for piece in value)
    count = 3 if px_ms is None else 5
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (count, len(key), key, size)
    if px_ms is None:
        return [head, *value, CRLF]
    ms = b"%d" % px_ms
    return [head, *value, b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)]


def send_all(
    sock: socket.socket, pieces: Sequence[bytes | memoryview], deadline: float | None = None
) -> None:
    """Send ``pieces`` in order, a scatter-gather ``sendmsg`` per ``IOV_MAX`` pieces (TLS
    sockets have no ``sendmsg``: one ``sendall`` per slice of a piece there); each call gets
    the time left before ``deadline`` when one is given.

    Raises:
        TimeoutError: the deadline passed (the command may be half sent).
    """
    if isinstance(sock, ssl.SSLSocket):
        for piece in pieces:
            view = memoryview(piece).cast("B")
            for start in range(0, view.nbytes, TLS_SLICE):
                if deadline is not None:
                    arm(sock, deadline)
                sock.sendall(view[start : start + TLS_SLICE])
        return
    views = [memoryview(piece).cast("B") for piece in pieces if memoryview(piece).nbytes]
    first = 0
    while first < len(views):
        if deadline is not None:
            arm(sock, deadline)
        sent = sock.sendmsg(views[first : first + _IOV_MAX])
        while sent and sent >= views[first].nbytes:
            sent -= views[first].nbytes
            first += 1
        if sent:
            views[first] = views[first][sent:]


def _shown(line: bytes) -> str:
    return repr(line[:40]) + ("..." if len(line) > 40 else "")
