"""The connection to one kvshelf server: its channel, the fail-fast probe, restart detection.

Owns the channel (:mod:`kvshelf.client.channels`: ZMQ, or the server's node-local socket once
a reply has told the boot, where this process can reach it) and the one lock that serialises
every use of it, request ids, sending and receiving within ``timeout_s``, and what a failure
does: a timeout or a send the channel refuses resets the channel, raises
:class:`ServerUnavailable`, and starts a background probe that pings the server every
``retry_interval_s`` on a ZMQ socket of its own; until it hears an answer, every send fails at
once. Another process that found the server silent for a whole timeout can say so
(:meth:`Connection.assume_down`): the connection then fails the same way, and a call waiting
for a reply gives up within :data:`WAIT_SLICE_S` instead of waiting out its own timeout;
connections of one process that share an :class:`~kvshelf.client.outages.Outages` say so to
each other themselves (:meth:`Connection.timed_out`). A
reply carrying a new boot id means the server restarted and lost all state: the
connection re-registers the layout it was registered with and bumps ``generation``. Every
receive may take the reply of a lookup sent without waiting, so the connection also files
those replies under their tickets (:class:`PendingLookup`); what the tickets mean is
:mod:`kvshelf.client.lookups`' business.

Imports only the protocol and the client's channels, errors and results: no vLLM or torch.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from kvshelf.client.channels import Channel, ChannelError, LocalChannel, ZmqChannel
from kvshelf.client.errors import ServerUnavailable, checked
from kvshelf.client.outages import Outages
from kvshelf.client.results import Registration
from kvshelf.curve import ClientCurve
from kvshelf.protocol import (
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
    decode_reply,
    encode,
    local_socket_name,
)

logger = logging.getLogger(__name__)

WAIT_SLICE_S = 0.05
"""A wait for a reply looks this often whether :meth:`Connection.assume_down` was called."""


@dataclass
class PendingLookup:
    """A lookup sent without waiting whose result was not taken yet."""

    deadline: float
    reply: Reply | None = None
    # Set when the socket carrying it was replaced: its reply can never arrive.
    lost: bool = False
    # Set when the caller gave up on it: a lock in its reply is released on arrival.
    abandoned: bool = False


class Connection:
    """A thread-safe connection to one kvshelf server.

    ``lock`` (re-entrant) guards every use of the socket and of ``pending_lookups``; callers
    that combine several steps hold it across them. ``registration``, ``generation`` and
    ``boot_id`` are read-only outside this class.

    Args:
        host: the server's host.
        port: the server's port.
        timeout_s: the longest any call blocks waiting for a reply.
        retry_interval_s: the interval of the background probe after a failure.
        curve: CURVE keys for a server started with ``--curve-keys``; a server that refuses
            them never answers, which looks like a server that is down.
        local: move to the server's node-local socket when it can be reached (its name
            follows from the port and the boot id of a reply); False keeps ZMQ.
        outages: the connections this one tells when it waited a whole timeout in vain, and
            that tell it (None: it learns of an outage only by its own timeout).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout_s: float,
        retry_interval_s: float,
        curve: ClientCurve | None = None,
        local: bool = True,
        outages: Outages | None = None,
    ) -> None:
        if timeout_s <= 0 or retry_interval_s < 0:
            raise ValueError("timeout_s must be > 0 and retry_interval_s >= 0")
        self._port = port
        self.endpoint = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self._curve = curve
        # One lock serialises every use of the socket, which ZMQ does not allow across threads.
        self.lock = threading.RLock()
        self._context = zmq.Context.instance()
        self._use_local = local
        # The node-local socket this boot of the server named ("": none, or not reachable),
        # and whether the calls should move there once no reply is awaited on ZMQ.
        self._local_name = ""
        self._move_due = False
        # Round trips waiting for their reply (a restart's re-registration nests in another).
        self._waiting = 0
        self._channel: Channel | None = self._open()
        self._request_ids = itertools.count(1)
        # Set by a failure; cleared by the probe thread when the server answers a ping. The
        # probe lock makes "start a probe unless one runs" and "the probe ends" atomic.
        self._down = False
        self._probe: threading.Thread | None = None
        self._probe_lock = threading.Lock()
        # Set by assume_down; the next waiter (holding the lock) turns it into a fail().
        self._told_down = False
        self._closed = False
        self.boot_id: str | None = None
        self._layout: PageLayout | None = None
        self.registration: Registration | None = None
        # The holder token the server gave this client's first registration
        # (``Registered.holder``), sent with every later one: it holds a pool once however often
        # it registers, and only its own ``retires`` let go of a pool it holds.
        self._holder = 0
        self.generation = 0
        # Request id -> lookups sent without waiting, until their result is taken.
        self.pending_lookups: dict[int, PendingLookup] = {}
        self._outages = outages
        if outages is not None:
            outages.join(self)

    @property
    def up(self) -> bool:
        """Whether the socket is open and no failure is being probed."""
        return self._channel is not None and not self._down

    @property
    def transport(self) -> str:
        """``"local"`` or ``"zmq"``: what carries the calls now (``"closed"`` after close)."""
        return self._channel.kind if self._channel is not None else "closed"

    def register(self, layout: PageLayout, retires: str = "") -> Registration:
        """Create or join the pool for ``layout`` (letting go of the pool ``retires``);
        ``layout`` is remembered for re-registration after a restart.

        Raises:
            ServerUnavailable, ServerError: see :mod:`kvshelf.client`.
        """
        with self.lock:
            self._layout = layout
            request = Register(request_id=0, layout=layout, retires=retires, holder=self._holder)
            reply = self.call(request, Registered)
            return self._adopt(reply)

    def call(self, request: Request, expected: type | None) -> Reply:
        """Send ``request`` with a fresh request id and return the matching reply.

        Args:
            request: the request; its ``request_id`` is replaced.
            expected: the reply type wanted, or None for any non-error reply.

        Raises:
            ServerUnavailable, ServerError: see :mod:`kvshelf.client`.
        """
        with self.lock:
            reply = self._roundtrip(request)
            if reply.boot_id != self.boot_id:
                self._on_new_boot(reply, isinstance(request, Register))
            return checked(reply, expected)

    def send(self, request: Request) -> int:
        """Send ``request`` with a fresh request id, without waiting.

        Returns:
            The request id its reply will carry.

        Raises:
            ServerUnavailable: the client is closed, the server failed recently, or the send
                was refused.
        """
        if self._channel is None:
            raise ServerUnavailable("client is closed")
        if self._down:
            raise ServerUnavailable(
                f"{self.endpoint} failed recently; probing it every {self.retry_interval_s} s"
            )
        if self._move_due:  # at the next request: a one-call client never connects
            self._move_to_local()
        request_id = next(self._request_ids)
        frame = encode(msgspec.structs.replace(request, request_id=request_id))
        try:
            self._channel.send(frame)
        except ChannelError as exc:
            if self._channel.kind != "local":
                self.fail()
                raise ServerUnavailable(f"{self.endpoint}: {exc}") from None
            # The server behind the local socket is gone. ZMQ reaches whichever server now
            # holds the port, as it always does, so a restart costs no failed call.
            self._leave_local(exc)
            try:
                self._channel.send(frame)
            except ChannelError as zmq_exc:
                self.fail()
                raise ServerUnavailable(f"{self.endpoint}: {zmq_exc}") from None
        return request_id

    def release_all_nowait(self, lock_id: int, world_size: int) -> None:
        """Release every rank's share of a lookup lock, without waiting for acknowledgements.

        Never raises: a release that cannot be sent only delays the unlock until the lock's
        lease expires on the server.

        Args:
            lock_id: the lock.
            world_size: the number of ranks sharing it.
        """
        with self.lock:
            for rank in range(world_size):
                try:
                    self.send(Release(request_id=0, lock_id=lock_id, rank=rank))
                except ServerUnavailable:
                    return

    def wait_readable(self, timeout_s: float) -> bool:
        """Wait until a reply can be received or ``timeout_s`` passed (millisecond steps).

        Returns:
            Whether a reply can be received.
        """
        assert self._channel is not None
        try:
            return self._channel.wait_readable(timeout_s)
        except ChannelError as exc:
            raise self._channel_failed(exc) from None

    def drain_replies(self) -> None:
        """Take every reply already received, without waiting, for the pending lookups."""
        try:
            # A reply may switch the channel (a restart's re-registration): ask the current one.
            while self._channel is not None and self._channel.readable():
                self._receive()
        except ChannelError as exc:
            raise self._channel_failed(exc) from None

    def fail(self) -> None:
        """Give up on the socket after a failure: replace it and probe until the server answers.

        Pending lookups whose reply did not arrive are marked lost; abandoned ones are
        forgotten (their locks' leases expire on the server).
        """
        # A fresh channel drops queued requests and late replies of the failed attempt.
        assert self._channel is not None
        self._channel.close()
        self._channel = self._open()
        self._lose_pending()
        with self._probe_lock:
            self._down = True
            if self._probe is None:
                self._probe = threading.Thread(
                    target=self._probe_until_up, name="kvshelf-probe", daemon=True
                )
                self._probe.start()

    def timed_out(self) -> None:
        """A reply did not come within the whole timeout: :meth:`fail`, and tell the
        connections sharing this one's :class:`Outages`, which then fail fast instead of each
        waiting a timeout of its own."""
        self.fail()
        if self._outages is not None:
            self._outages.timed_out(self)

    def assume_down(self) -> None:
        """Take another party's word that the server is not answering (it waited a whole
        timeout for a reply): from now on sends fail at once and a call waiting for a reply
        gives up, until the probe hears the server again.

        Never waits: the socket's lock may be held by a call waiting for the server; that
        call resets the socket (:meth:`fail`) when it gives up.
        """
        with self._probe_lock:
            if self._down or self._closed:
                return
            self._down = True
            self._told_down = True
            self._probe = threading.Thread(
                target=self._probe_until_up, name="kvshelf-probe", daemon=True
            )
            self._probe.start()

    def give_up_if_told(self) -> bool:
        """Whether :meth:`assume_down` was called since the last look; if it was, fail now
        (with the lock held: the socket is replaced and pending lookups are marked lost)."""
        if not self._told_down:
            return False
        self._told_down = False
        self.fail()
        return True

    def close(self) -> None:
        """Close the socket; later sends raise :class:`ServerUnavailable`."""
        self._closed = True
        if self._outages is not None:
            self._outages.leave(self)
        with self.lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None

    # Internals.

    def _open(self) -> Channel:
        """The node-local channel if the server named one that answers a connect, else ZMQ
        (which never fails to open)."""
        self._move_due = False
        local = self._connect_local()
        return local if local is not None else ZmqChannel(self._context, self.endpoint, self._curve)

    def _connect_local(self) -> LocalChannel | None:
        """A channel to the node-local socket, or None: none is known, or it cannot be
        reached (its server is gone, another network namespace, a listener of another user);
        it is then forgotten until a new boot names one."""
        if not self._local_name:
            return None
        try:
            return LocalChannel(self._local_name, self.timeout_s)
        except OSError as exc:
            logger.info(
                "%s: node-local socket @%s: %s; using ZMQ", self.endpoint, self._local_name, exc
            )
            self._local_name = ""
            return None

    def _channel_failed(self, exc: ChannelError) -> ServerUnavailable:
        """Give up on the channel after ``exc``; returns the error to raise.

        A local socket that breaks means its server stopped: the next call goes over ZMQ,
        which reaches a successor on the port, so the connection is not marked down. Any
        other fault is a :meth:`fail`.
        """
        assert self._channel is not None
        if self._channel.kind == "local":
            self._leave_local(exc)
        else:
            self.fail()
        return ServerUnavailable(f"{self.endpoint}: {exc}")

    def _leave_local(self, exc: ChannelError) -> None:
        """Carry the calls over ZMQ until the server names a local socket again; lookups
        still waiting for a reply are marked lost, as :meth:`fail` does."""
        logger.info("%s: %s; calls go over ZMQ until the server names it again", self.endpoint, exc)
        assert self._channel is not None
        self._channel.close()
        self._local_name = ""
        self._channel = self._open()
        self._lose_pending()

    def _lose_pending(self) -> None:
        """Mark lost the lookups whose replies can no longer arrive; forget abandoned ones
        (their locks' leases expire on the server)."""
        for request_id, pending in list(self.pending_lookups.items()):
            if pending.abandoned:
                del self.pending_lookups[request_id]
            elif pending.reply is None:
                pending.lost = True

    def _note_local_socket(self, name: str) -> None:
        """A new boot's node-local socket is ``name`` ("": it has none): move there once no
        reply is awaited on the current channel (:meth:`_move_to_local`)."""
        if not self._use_local or name == self._local_name:
            return
        self._local_name = name
        self._move_due = bool(name) and self._channel is not None and self._channel.kind != "local"

    def _move_to_local(self) -> None:
        """Move the calls to the node-local socket, unless a reply is still awaited on the
        current channel (it would be lost) or the socket cannot be reached (another network
        namespace): then stay, and try again later or not at all."""
        now = time.monotonic()
        if self._waiting or any(
            pending.reply is None and not pending.lost and now < pending.deadline
            for pending in self.pending_lookups.values()
        ):
            return
        self._move_due = False
        channel = self._connect_local()
        if channel is None:
            return
        assert self._channel is not None
        self._channel.close()
        self._channel = channel

    def _roundtrip(self, request: Request) -> Reply:
        request_id = self.send(request)
        deadline = time.monotonic() + self.timeout_s
        self._waiting += 1
        try:
            while (remaining := deadline - time.monotonic()) > 0:
                if self.give_up_if_told():
                    raise ServerUnavailable(
                        f"{self.endpoint} did not answer another client within its timeout"
                    )
                if not self.wait_readable(min(remaining, WAIT_SLICE_S)):
                    continue
                reply = self._receive()
                if reply is not None and reply.request_id == request_id:
                    return reply
        except ChannelError as exc:
            raise self._channel_failed(exc) from None
        finally:
            self._waiting -= 1
        self.timed_out()
        # A CURVE server that refuses this client's key never answers: say so.
        hint = " (or refused this client's CURVE key)" if self._curve is not None else ""
        raise ServerUnavailable(f"{self.endpoint} did not answer within {self.timeout_s} s{hint}")

    def _receive(self) -> Reply | None:
        """Receive one reply; a pending lookup's reply is kept for it and not returned.

        Returns:
            The reply, or None if it was undecodable or belonged to a pending lookup.
            Replies to requests that timed out earlier arrive late and are returned too;
            callers drop them by request id.
        """
        assert self._channel is not None
        try:
            reply = decode_reply(self._channel.recv())
        except ProtocolError:
            return None
        pending = self.pending_lookups.get(reply.request_id)
        if pending is None:
            return reply
        if pending.abandoned:
            del self.pending_lookups[reply.request_id]
            if isinstance(reply, LookupReply) and reply.lock_id:
                self.release_all_nowait(reply.lock_id, len(reply.pages))
        else:
            pending.reply = reply
        if reply.boot_id != self.boot_id:
            self._on_new_boot(reply, registering=False)
        return None

    def _probe_until_up(self) -> None:
        """Ping the server every retry interval, on a socket of its own, until it answers."""
        channel = ZmqChannel(self._context, self.endpoint, self._curve)
        try:
            while not self._closed:
                time.sleep(self.retry_interval_s)
                channel.send(encode(Ping(request_id=0)))
                if channel.wait_readable(self.timeout_s):
                    try:
                        decode_reply(channel.recv())
                    except ProtocolError:
                        continue
                    break
        except ChannelError:
            pass
        finally:
            channel.close()
            with self._probe_lock:
                self._down = False
                self._told_down = False
                self._probe = None

    def _on_new_boot(self, reply: Reply, registering: bool) -> None:
        """``reply`` carries a boot id not seen before: the server started or restarted."""
        restarted = self.boot_id is not None
        self.boot_id = reply.boot_id
        self.registration = None
        # Registrations and pongs say whether the server has a local socket; any other reply
        # leaves it to a connect to the name this boot would have.
        if isinstance(reply, (Pong, Registered)):
            self._note_local_socket(reply.local_socket)
        else:
            self._note_local_socket(local_socket_name(self._port, reply.boot_id))
        if restarted and self._layout is not None and not registering:
            # The restarted server has no pool: make it again before the caller goes on, so
            # that registration and generation already describe the new arena. A failure here
            # leaves registration None; the next register() call fixes it.
            try:
                reply = self._roundtrip(
                    Register(request_id=0, layout=self._layout, holder=self._holder)
                )
            except ServerUnavailable:
                return
            if isinstance(reply, Registered):
                self._adopt(reply)

    def _adopt(self, reply: Registered) -> Registration:
        self._holder = reply.holder or self._holder
        self.registration = Registration(
            reply.pool, reply.shm_name, reply.arena_bytes, reply.page_bytes, reply.boot_id
        )
        self.generation += 1
        return self.registration
