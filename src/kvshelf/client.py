"""The ZMQ client both connector roles use to talk to the kvshelf server.

Every call is bounded by ``timeout_s``. After a failure (timeout, or a send the socket refuses)
the client fails fast with :class:`ServerUnavailable` until a background probe, which pings the
server every ``retry_interval_s``, hears from it again. So a dead server costs a caller one
timeout, not one per interval: vLLM's step loop does not stall while the cache is away.
Lookups can also be sent without waiting (:meth:`KVShelfClient.submit_lookup`) and collected
later (:meth:`KVShelfClient.poll_lookup`), so the scheduler never waits for a round trip. A
reply carrying a new boot id means the server restarted and lost all state: the client
re-registers its layout (if it has one) and bumps :attr:`KVShelfClient.generation`, so
callers know that page indices and the arena changed.

No vLLM or torch import: this module is used by the scheduler process as well.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq

from kvshelf.protocol import (
    Abort,
    Commit,
    Error,
    ErrorCode,
    Lookup,
    LookupReply,
    PageLayout,
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
    decode_reply,
    encode,
)


class KVShelfError(Exception):
    """Base class of the client's errors."""


class ServerUnavailable(KVShelfError):
    """No reply within the timeout, or a recent failure within ``retry_interval_s``."""


class ServerError(KVShelfError):
    """The server rejected the request; it changed nothing.

    Args:
        code: the server's error code.
        message: the server's reason.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


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
    ``boot_id`` names the server run (and so the arena) those pages belong to.
    """

    num_hit_blocks: int
    lock_id: int
    pages: list[list[int]]
    boot_id: str


@dataclass(frozen=True)
class Reservation:
    """A reserve's answer: ``pages[i]`` is the page to write block ``i`` into, or None to skip."""

    reservation_id: int
    pages: list[int | None]
    boot_id: str


@dataclass
class _AsyncLookup:
    """A lookup sent by :meth:`KVShelfClient.submit_lookup` whose result was not taken yet."""

    deadline: float
    reply: Reply | None = None
    # Set when the socket carrying it was replaced: its reply can never arrive.
    lost: bool = False
    # Set when the caller gave up on it: a lock in its reply is released on arrival.
    abandoned: bool = False


class KVShelfClient:
    """A thread-safe client of one kvshelf server.

    Args:
        host: the server's host.
        port: the server's port.
        timeout_s: the longest any call blocks waiting for a reply.
        retry_interval_s: after a failure, calls raise :class:`ServerUnavailable` at once
            while a background probe pings the server at this interval; the first answer ends
            the outage.
    """

    def __init__(
        self, host: str, port: int, *, timeout_s: float = 1.0, retry_interval_s: float = 1.0
    ) -> None:
        if timeout_s <= 0 or retry_interval_s < 0:
            raise ValueError("timeout_s must be > 0 and retry_interval_s >= 0")
        self.endpoint = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self._timeout_s = timeout_s
        self._retry_interval_s = retry_interval_s
        # One lock serialises every use of the socket, which ZMQ does not allow across threads.
        self._lock = threading.RLock()
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = self._connect()
        self._request_ids = itertools.count(1)
        # Set by a failure; cleared by the probe thread when the server answers a ping. The
        # probe lock makes "start a probe unless one runs" and "the probe ends" atomic.
        self._down = False
        self._probe: threading.Thread | None = None
        self._probe_lock = threading.Lock()
        self._closed = False
        self._boot_id: str | None = None
        self._layout: PageLayout | None = None
        self._registration: Registration | None = None
        self._generation = 0
        # Request id -> lookups sent without waiting, until their result is taken.
        self._async_lookups: dict[int, _AsyncLookup] = {}

    @property
    def registration(self) -> Registration | None:
        """The current registration; re-made after a server restart, None before register()."""
        return self._registration

    @property
    def generation(self) -> int:
        """Bumps on every (re-)registration."""
        return self._generation

    @property
    def boot_id(self) -> str | None:
        """The boot id of the server run last heard from."""
        return self._boot_id

    def register(self, layout: PageLayout) -> Registration:
        """Create or join the pool for ``layout``; remembered for re-registration.

        Raises:
            ServerUnavailable, ServerError: see the module docstring.
        """
        with self._lock:
            self._layout = layout
            reply = self._call(Register(request_id=0, layout=layout), Registered)
            return self._adopt(reply)

    def lookup(
        self, pool: str, hashes: Sequence[bytes], *, world_size: int, lock: bool
    ) -> LookupResult:
        """Longest prefix of ``hashes`` committed for all ``world_size`` ranks.

        Args:
            pool: the pool name (see :func:`kvshelf.protocol.pool_name`); unknown = no hit.
            hashes: the request's chained block hashes.
            world_size: the number of ranks of the pool.
            lock: lock the hit pages until every rank calls :meth:`release`.

        Raises:
            ServerUnavailable, ServerError: see the module docstring.
        """
        request = Lookup(
            request_id=0, pool=pool, hashes=list(hashes), world_size=world_size, lock=lock
        )
        return self._lookup_result(self._call(request, LookupReply))

    def submit_lookup(
        self, pool: str, hashes: Sequence[bytes], *, world_size: int, lock: bool
    ) -> int:
        """Send a lookup without waiting for its reply.

        Args: as :meth:`lookup`.

        Returns:
            A ticket for :meth:`poll_lookup` (or :meth:`cancel_lookup`); exactly one of the
            two must be called until it returns a result or raises.

        Raises:
            ServerUnavailable: the server failed recently or the send was refused.
        """
        request = Lookup(
            request_id=0, pool=pool, hashes=list(hashes), world_size=world_size, lock=lock
        )
        with self._lock:
            now = time.monotonic()
            # Abandoned lookups whose reply never came (their lock lease expires by itself).
            expired = [
                request_id
                for request_id, pending in self._async_lookups.items()
                if pending.abandoned and pending.deadline < now
            ]
            for request_id in expired:
                del self._async_lookups[request_id]
            request_id = self._send(request)
            self._async_lookups[request_id] = _AsyncLookup(now + self._timeout_s)
            return request_id

    def poll_lookup(self, ticket: int, wait_s: float = 0.0) -> LookupResult | None:
        """The result of a submitted lookup, if its reply arrives within ``wait_s``.

        Args:
            ticket: from :meth:`submit_lookup`.
            wait_s: the longest to wait for the reply (0: do not wait).

        Returns:
            The result, or None while the reply may still arrive (call again later).

        Raises:
            ServerUnavailable: no reply within the timeout, or the connection was reset.
            ServerError: the server rejected the lookup.
        """
        with self._lock:
            pending = self._async_lookups[ticket]
            wait_until = time.monotonic() + wait_s
            while pending.reply is None and not pending.lost:
                self._drain_replies()
                remaining = wait_until - time.monotonic()
                if pending.reply is not None or pending.lost or remaining <= 0:
                    break
                self._wait_readable(remaining)
            if pending.reply is not None:
                del self._async_lookups[ticket]
                return self._lookup_result(pending.reply)
            if pending.lost:
                del self._async_lookups[ticket]
                raise ServerUnavailable(f"{self.endpoint}: connection reset before the reply")
            if time.monotonic() < pending.deadline:
                return None
            del self._async_lookups[ticket]
            self._fail()
            raise ServerUnavailable(f"{self.endpoint} did not answer within {self._timeout_s} s")

    def cancel_lookup(self, ticket: int) -> LookupResult | None:
        """Give up on a submitted lookup.

        Args:
            ticket: from :meth:`submit_lookup`.

        Returns:
            Its result if the reply already arrived (the caller owns any lock in it), else
            None: a lock in a reply arriving later is released by the client.
        """
        with self._lock:
            pending = self._async_lookups.get(ticket)
            if pending is None:
                return None
            if pending.reply is None and not pending.lost:
                self._drain_replies()
            if pending.reply is not None:
                del self._async_lookups[ticket]
                try:
                    return self._lookup_result(pending.reply)
                except ServerError:
                    return None
            if pending.lost:
                del self._async_lookups[ticket]
            else:
                pending.abandoned = True
            return None

    def collect_abandoned(self) -> bool:
        """Take replies that already arrived, releasing the locks of cancelled lookups.

        Returns:
            Whether cancelled lookups still wait for their reply (call again later).
        """
        with self._lock:
            if self._socket is not None and not self._down:
                # A failure resets the socket and forgets the cancelled lookups: their locks'
                # leases expire on the server.
                with contextlib.suppress(ServerUnavailable):
                    self._drain_replies()
            return any(pending.abandoned for pending in self._async_lookups.values())

    @staticmethod
    def _lookup_result(reply: Reply) -> LookupResult:
        reply = _checked(reply, LookupReply)
        assert isinstance(reply, LookupReply)
        return LookupResult(reply.num_hit_blocks, reply.lock_id, reply.pages, reply.boot_id)

    def reserve(self, pool: str, rank: int, hashes: Sequence[bytes]) -> Reservation:
        """Reserve pages to write the blocks ``hashes`` of ``rank``; None pages are skips.

        Raises:
            ServerUnavailable, ServerError: see the module docstring.
        """
        request = Reserve(request_id=0, pool=pool, rank=rank, hashes=list(hashes))
        reply = self._call(request, ReserveReply)
        return Reservation(reply.reservation_id, reply.pages, reply.boot_id)

    def commit(self, reservation_id: int) -> None:
        """Make a reservation's written pages visible to lookups."""
        self._call(Commit(request_id=0, reservation_id=reservation_id), None)

    def abort(self, reservation_id: int) -> None:
        """Drop a reservation and free its pages."""
        self._call(Abort(request_id=0, reservation_id=reservation_id), None)

    def release(self, lock_id: int, rank: int) -> None:
        """Release ``rank``'s share of a lookup lock once it has read its pages."""
        self._call(Release(request_id=0, lock_id=lock_id, rank=rank), None)

    def release_all_nowait(self, lock_id: int, world_size: int) -> None:
        """Release every rank's share of a lookup lock, without waiting for acknowledgements.

        Never raises: a release that cannot be sent only delays the unlock until the lock's
        lease expires on the server.

        Args:
            lock_id: the lock.
            world_size: the number of ranks sharing it.
        """
        with self._lock:
            for rank in range(world_size):
                try:
                    self._send(Release(request_id=0, lock_id=lock_id, rank=rank))
                except ServerUnavailable:
                    return

    def stats(self) -> dict[str, int]:
        """The server's counters."""
        return self._call(Stats(request_id=0), StatsReply).stats

    def ping(self) -> str:
        """Check the server answers.

        Returns:
            Its boot id.
        """
        return self._call(Ping(request_id=0), Pong).boot_id

    def close(self) -> None:
        """Close the socket; later calls raise :class:`ServerUnavailable`."""
        self._closed = True
        with self._lock:
            if self._socket is not None:
                self._socket.close(linger=0)
                self._socket = None

    def __enter__(self) -> KVShelfClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # Internals.

    def _connect(self) -> zmq.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IPV6, 1)  # dual stack, so an IPv6 server address works
        socket.connect(self.endpoint)
        return socket

    def _call(self, request: Request, expected: type | None) -> Reply:
        """Send ``request`` with a fresh request id and return the matching reply.

        Args:
            request: the request; its ``request_id`` is replaced.
            expected: the reply type wanted, or None for any non-error reply.
        """
        with self._lock:
            reply = self._roundtrip(request)
            if reply.boot_id != self._boot_id:
                self._on_new_boot(reply.boot_id, isinstance(request, Register))
            return _checked(reply, expected)

    def _send(self, request: Request) -> int:
        """Send ``request`` with a fresh request id, without waiting.

        Returns:
            The request id its reply will carry.
        """
        if self._socket is None:
            raise ServerUnavailable("client is closed")
        if self._down:
            raise ServerUnavailable(
                f"{self.endpoint} failed recently; probing it every {self._retry_interval_s} s"
            )
        request_id = next(self._request_ids)
        frame = encode(msgspec.structs.replace(request, request_id=request_id))
        try:
            # A DEALER queues for a peer that is still connecting; NOBLOCK only fails once its
            # queue is full, which means the server is not reading.
            self._socket.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._fail()
            raise ServerUnavailable(f"{self.endpoint}: {exc}") from None
        return request_id

    def _roundtrip(self, request: Request) -> Reply:
        request_id = self._send(request)
        assert self._socket is not None
        deadline = time.monotonic() + self._timeout_s
        try:
            while (remaining := deadline - time.monotonic()) > 0:
                if not self._wait_readable(remaining):
                    continue
                reply = self._receive()
                if reply is not None and reply.request_id == request_id:
                    return reply
        except zmq.ZMQError as exc:
            self._fail()
            raise ServerUnavailable(f"{self.endpoint}: {exc}") from None
        self._fail()
        raise ServerUnavailable(f"{self.endpoint} did not answer within {self._timeout_s} s")

    def _wait_readable(self, timeout_s: float) -> bool:
        """Wait until a reply can be received or ``timeout_s`` passed (millisecond steps).

        Returns:
            Whether a reply can be received.
        """
        assert self._socket is not None
        try:
            return bool(self._socket.poll(max(1, math.ceil(timeout_s * 1000)), zmq.POLLIN))
        except zmq.ZMQError as exc:
            self._fail()
            raise ServerUnavailable(f"{self.endpoint}: {exc}") from None

    def _drain_replies(self) -> None:
        """Take every reply already received, without waiting, for the submitted lookups."""
        assert self._socket is not None
        try:
            while self._socket.poll(0, zmq.POLLIN):
                self._receive()
        except zmq.ZMQError as exc:
            self._fail()
            raise ServerUnavailable(f"{self.endpoint}: {exc}") from None

    def _receive(self) -> Reply | None:
        """Receive one reply; a submitted lookup's reply is kept for it and not returned.

        Returns:
            The reply, or None if it was undecodable or belonged to a submitted lookup.
            Replies to requests that timed out earlier arrive late and are returned too;
            callers drop them by request id.
        """
        assert self._socket is not None
        try:
            reply = decode_reply(self._socket.recv(zmq.NOBLOCK))
        except ProtocolError:
            return None
        pending = self._async_lookups.get(reply.request_id)
        if pending is None:
            return reply
        if pending.abandoned:
            del self._async_lookups[reply.request_id]
            if isinstance(reply, LookupReply) and reply.lock_id:
                self.release_all_nowait(reply.lock_id, len(reply.pages))
        else:
            pending.reply = reply
        if reply.boot_id != self._boot_id:
            self._on_new_boot(reply.boot_id, registering=False)
        return None

    def _fail(self) -> None:
        # A fresh socket drops queued requests and late replies of the failed attempt.
        assert self._socket is not None
        self._socket.close(linger=0)
        self._socket = self._connect()
        for request_id, pending in list(self._async_lookups.items()):
            if pending.abandoned:
                del self._async_lookups[request_id]
            elif pending.reply is None:
                pending.lost = True
        with self._probe_lock:
            self._down = True
            if self._probe is None:
                self._probe = threading.Thread(
                    target=self._probe_until_up, name="kvshelf-probe", daemon=True
                )
                self._probe.start()

    def _probe_until_up(self) -> None:
        """Ping the server every retry interval, on a socket of its own, until it answers."""
        socket = self._connect()
        try:
            while not self._closed:
                time.sleep(self._retry_interval_s)
                socket.send(encode(Ping(request_id=0)), zmq.NOBLOCK)
                if socket.poll(max(1, int(self._timeout_s * 1000)), zmq.POLLIN):
                    try:
                        decode_reply(socket.recv(zmq.NOBLOCK))
                    except ProtocolError:
                        continue
                    break
        except zmq.ZMQError:
            pass
        finally:
            socket.close(linger=0)
            with self._probe_lock:
                self._down = False
                self._probe = None

    def _on_new_boot(self, boot_id: str, registering: bool) -> None:
        restarted = self._boot_id is not None
        self._boot_id = boot_id
        self._registration = None
        if restarted and self._layout is not None and not registering:
            # The restarted server has no pool: make it again before the caller goes on, so
            # that registration and generation already describe the new arena. A failure here
            # leaves registration None; the next register() call fixes it.
            try:
                reply = self._roundtrip(Register(request_id=0, layout=self._layout))
            except ServerUnavailable:
                return
            if isinstance(reply, Registered):
                self._adopt(reply)

    def _adopt(self, reply: Registered) -> Registration:
        self._registration = Registration(
            reply.pool, reply.shm_name, reply.arena_bytes, reply.page_bytes, reply.boot_id
        )
        self._generation += 1
        return self._registration


def _checked(reply: Reply, expected: type | None) -> Reply:
    """Return ``reply`` if it is of the ``expected`` type (None: any non-error reply).

    Raises:
        ServerError: an error reply, or a reply of another type.
    """
    if isinstance(reply, Error):
        raise ServerError(reply.code, reply.message)
    if expected is not None and not isinstance(reply, expected):
        raise ServerError(
            ErrorCode.MALFORMED, f"expected {expected.__name__}, got {type(reply).__name__}"
        )
    return reply
