"""The client's synchronous calls, and :class:`KVShelfClient`, the client callers hold.

Owns the calls that send one request and wait for its reply (register, lookup, reserve,
commit, abort, release, stats, clear, ping) and the client's public face: it composes one
:class:`~kvshelf.client.connection.Connection` with the
:class:`~kvshelf.client.lookups.TicketedLookups` over it. What a failure or a server restart
does is the connection's business (see :mod:`kvshelf.client`).

Imports only the protocol and the client's other modules: no vLLM or torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshelf.client.connection import Connection
from kvshelf.client.errors import checked
from kvshelf.client.lookups import TicketedLookups
from kvshelf.client.outages import Outages
from kvshelf.client.results import (
    Cleared,
    LookupResult,
    Registration,
    Reservation,
    ServerStats,
    lookup_result,
)
from kvshelf.curve import ClientCurve
from kvshelf.protocol import (
    Abort,
    Clear,
    ClearReply,
    Commit,
    Events,
    EventsReply,
    Lookup,
    LookupReply,
    PageLayout,
    Ping,
    Pong,
    Release,
    Reserve,
    ReserveReply,
    Stats,
    StatsReply,
    lookup_deadline_ms,
)

# One Clear request per server.limits.CLEAR_PAGES_PER_REQUEST (8,192) pages: enough for a
# 64 GiB arena of 64 KiB pages, each request answered between others' requests.
MAX_CLEAR_REQUESTS = 1024


class KVShelfClient:
    """A thread-safe client of one kvshelf server.

    Besides the synchronous calls, it offers the ticketed lookups of
    :class:`~kvshelf.client.lookups.TicketedLookups` and the connection's
    ``release_all_nowait``, which never wait for a reply.

    Args:
        host: the server's host.
        port: the server's port.
        timeout_s: the longest any call blocks waiting for a reply.
        retry_interval_s: after a failure, calls raise
            :class:`~kvshelf.client.errors.ServerUnavailable` at once while a background probe
            pings the server at this interval; the first answer ends the outage.
        curve: CURVE keys (:meth:`ClientCurve.load` of a ``kvshelf keygen`` folder) for a
            server started with ``--curve-keys``.
        local: after registering, carry the calls over the server's node-local socket where
            it can be reached (:mod:`kvshelf.client.channels`); False keeps ZMQ.
        outages: clients that tell each other when the server stopped answering
            (:mod:`kvshelf.client.outages`); None: this one learns it by its own timeout.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout_s: float = 1.0,
        retry_interval_s: float = 1.0,
        curve: ClientCurve | None = None,
        local: bool = True,
        outages: Outages | None = None,
    ) -> None:
        connection = Connection(
            host,
            port,
            timeout_s=timeout_s,
            retry_interval_s=retry_interval_s,
            curve=curve,
            local=local,
            outages=outages,
        )
        self._connection = connection
        self.endpoint = connection.endpoint
        self._lookups = TicketedLookups(connection)
        self._call = connection.call

    @property
    def transport(self) -> str:
        """What carries the calls now: ``"local"`` (the node-local socket) or ``"zmq"``."""
        return self._connection.transport

    def submit_lookup(
        self,
        pool: str,
        hashes: Sequence[bytes],
        *,
        world_size: int,
        lock: bool,
        count_miss: bool = True,
        fetch: bool = True,
        block_keys: int = 1,
        ends: Sequence[Sequence[bytes]] = (),
        tenant: str = "",
    ) -> int:
        """Send a lookup without waiting (:meth:`TicketedLookups.submit_lookup`)."""
        return self._lookups.submit_lookup(
            pool,
            hashes,
            world_size=world_size,
            lock=lock,
            count_miss=count_miss,
            fetch=fetch,
            block_keys=block_keys,
            ends=ends,
            tenant=tenant,
        )

    def poll_lookup(self, ticket: int, wait_s: float = 0.0) -> LookupResult | None:
        """A submitted lookup's result, if it arrived (:meth:`TicketedLookups.poll_lookup`)."""
        return self._lookups.poll_lookup(ticket, wait_s)

    def cancel_lookup(self, ticket: int) -> LookupResult | None:
        """Give up on a submitted lookup (:meth:`TicketedLookups.cancel_lookup`)."""
        return self._lookups.cancel_lookup(ticket)

    def collect_abandoned(self) -> bool:
        """Release the locks of cancelled lookups (:meth:`TicketedLookups.collect_abandoned`)."""
        return self._lookups.collect_abandoned()

    def release_all_nowait(self, lock_id: int, world_size: int) -> None:
        """Release all ranks' shares of a lock (:meth:`Connection.release_all_nowait`)."""
        self._connection.release_all_nowait(lock_id, world_size)

    def assume_unavailable(self) -> None:
        """Another client found the server silent for a whole timeout: fail fast from now on,
        and give up any wait for a reply, until the server answers a ping again
        (:meth:`Connection.assume_down`). Never waits."""
        self._connection.assume_down()

    @property
    def registration(self) -> Registration | None:
        """The current registration; re-made after a server restart, None before register()."""
        return self._connection.registration

    @property
    def generation(self) -> int:
        """Bumps on every (re-)registration."""
        return self._connection.generation

    @property
    def boot_id(self) -> str | None:
        """The boot id of the server run last heard from."""
        return self._connection.boot_id

    def register(self, layout: PageLayout, retires: str = "") -> Registration:
        """Create or join the pool for ``layout``; remembered for re-registration.

        Args:
            layout: the pool's layout.
            retires: the pool this rank registered before on the same server boot and no
                longer uses (``Register.retires``), or "".

        Raises:
            ServerUnavailable, ServerError: see :mod:`kvshelf.client`.
        """
        return self._connection.register(layout, retires)

    def lookup(
        self,
        pool: str,
        hashes: Sequence[bytes],
        *,
        world_size: int,
        lock: bool,
        fetch: bool = True,
        block_keys: int = 1,
        ends: Sequence[Sequence[bytes]] = (),
        tenant: str = "",
    ) -> LookupResult:
        """Longest prefix of ``hashes`` committed for all ``world_size`` ranks.

        Args:
            pool: the pool name (see :func:`kvshelf.protocol.pool_name`); unknown = no hit.
            hashes: the request's chained block hashes.
            world_size: the number of ranks of the pool.
            lock: lock the hit pages until every rank calls :meth:`release`.
            fetch: let the server load blocks from tiers below L1 first; the result is then
                ``pending`` when they take longer than the server's fetch deadline.
            block_keys, ends: where a hit may end, for a model with state-space layers
                (:class:`~kvshelf.protocol.Lookup`); ``hashes`` then holds ``block_keys``
                keys per block.
            tenant: whose lookup it is (:class:`~kvshelf.protocol.Reserve`); "": none named.

        Raises:
            ServerUnavailable, ServerError: see :mod:`kvshelf.client`.
        """
        request = Lookup(
            request_id=0,
            pool=pool,
            hashes=list(hashes),
            world_size=world_size,
            lock=lock,
            deadline_ms=lookup_deadline_ms(self._connection.timeout_s),
            fetch=fetch,
            block_keys=block_keys,
            ends=[list(keys) for keys in ends],
            tenant=tenant,
        )
        return lookup_result(self._call(request, LookupReply))

    def reserve(
        self, pool: str, rank: int, hashes: Sequence[bytes], tenant: str = ""
    ) -> Reservation:
        """Reserve pages to write the blocks ``hashes`` of ``rank``; None pages are skips.

        ``tenant`` names who stores: the server accounts its pages and applies its share and
        ``--tenant-quota`` (:class:`~kvshelf.protocol.Reserve`); "": none named.

        Raises:
            ServerUnavailable, ServerError: see :mod:`kvshelf.client`.
        """
        request = Reserve(request_id=0, pool=pool, rank=rank, hashes=list(hashes), tenant=tenant)
        reply = self._call(request, ReserveReply)
        return Reservation(reply.reservation_id, reply.pages, reply.boot_id)

    def submit_reserve(
        self, pool: str, rank: int, hashes: Sequence[bytes], tenant: str = ""
    ) -> int:
        """Send :meth:`reserve` without waiting for its reply, e.g. for the next batch while
        this one copies; :meth:`take_reserve` must follow.

        Returns:
            The ticket for :meth:`take_reserve`.

        Raises:
            ServerUnavailable: the server failed recently or the send was refused.
        """
        return self._lookups.submit(
            Reserve(request_id=0, pool=pool, rank=rank, hashes=list(hashes), tenant=tenant)
        )

    def take_reserve(self, ticket: int) -> Reservation:
        """The reservation of a :meth:`submit_reserve`, waiting for it up to the timeout.

        Raises:
            ServerUnavailable, ServerError: as :meth:`reserve`.
        """
        while (reply := self._lookups.wait_reply(ticket, self._connection.timeout_s)) is None:
            pass  # the reply may still come: wait_reply raises once the timeout is over
        reply = checked(reply, ReserveReply)
        return Reservation(reply.reservation_id, reply.pages, reply.boot_id)

    def commit(self, reservation_id: int) -> None:
        """Make a reservation's written pages visible to lookups."""
        self._call(Commit(request_id=0, reservation_id=reservation_id), None)

    def commit_nowait(self, reservation_id: int) -> None:
        """Send :meth:`commit` without waiting for its acknowledgement.

        For a store whose pages are fully written: the commit then costs the writer no round
        trip. Its reply (an acknowledgement, or an error when the reservation expired, which
        freed its pages) is dropped by the next call that receives.

        Raises:
            ServerUnavailable: the client is closed, the server failed recently, or the send
                was refused.
        """
        with self._connection.lock:
            self._connection.send(Commit(request_id=0, reservation_id=reservation_id))

    def abort(self, reservation_id: int) -> None:
        """Drop a reservation and free its pages."""
        self._call(Abort(request_id=0, reservation_id=reservation_id), None)

    def release(self, lock_id: int, rank: int, copied: int = 0) -> None:
        """Release ``rank``'s share of a lookup lock once it has read its pages.

        Args:
            lock_id: the lock.
            rank: the releasing rank.
            copied: how many of the share's pages this rank copied (``loaded_objects_total``).
        """
        self._call(Release(request_id=0, lock_id=lock_id, rank=rank, copied=copied), None)

    def submit_release(self, lock_id: int, rank: int, copied: int = 0) -> int:
        """Send :meth:`release` without waiting for its acknowledgement, which
        :meth:`release_done` takes.

        Raises:
            ServerUnavailable: the server failed recently or the send was refused.
        """
        return self._lookups.submit(
            Release(request_id=0, lock_id=lock_id, rank=rank, copied=copied)
        )

    def release_done(self, ticket: int, wait_s: float = 0.0) -> bool:
        """Whether the acknowledgement of a :meth:`submit_release` came (within ``wait_s``);
        False while it may still come.

        Raises:
            ServerTimeout: no reply within the timeout (a ServerUnavailable).
            ServerUnavailable: the connection was reset.
            ServerError: the server refused the release (UNKNOWN_LOCK: its lease ran out).
        """
        reply = self._lookups.wait_reply(ticket, wait_s)
        if reply is None:
            return False
        checked(reply, None)
        return True

    def stats(self) -> dict[str, int]:
        """The server's counters."""
        return self._call(Stats(request_id=0), StatsReply).stats

    def server_stats(self) -> ServerStats:
        """The server's counters and its committed objects per pool."""
        reply = self._call(Stats(request_id=0), StatsReply)
        return ServerStats(reply.stats, reply.pool_objects)

    def clear(self, shared: bool = False) -> Cleared:
        """Empty the node's tiers: drop every committed object that no lookup lock pins; with
        ``shared``, start dropping kvshelf's keys from the shared tier too.

        The server drops a bounded number of L1 objects per request; this asks again while it
        says some are left, at most ``MAX_CLEAR_REQUESTS`` times (stores keep coming on a busy
        server: what they commit meanwhile may stay)."""
        cleared = 0
        for _ in range(MAX_CLEAR_REQUESTS):
            reply = self._call(Clear(request_id=0, shared=shared), ClearReply)
            cleared += reply.cleared_objects
            if not reply.remaining_objects:
                break
        return Cleared(
            cleared,
            reply.locked_objects,
            reply.cleared_disk_objects,
            reply.clearing_shared,
            reply.remaining_objects,
        )

    def events(self, pool: str, after_seq: int = 0, probe: Sequence[bytes] = ()) -> EventsReply:
        """Read ``pool``'s event log from ``after_seq`` on and probe where ``probe`` hashes are
        (:class:`~kvshelf.protocol.EventsReply`, whose ``boot_id`` tells the server run)."""
        return self._call(
            Events(request_id=0, pool=pool, after_seq=after_seq, probe=list(probe)), EventsReply
        )

    def ping(self) -> str:
        """Check the server answers.

        Returns:
            Its boot id.
        """
        return self._call(Ping(request_id=0), Pong).boot_id

    def close(self) -> None:
        """Close the socket; later calls raise :class:`~kvshelf.client.errors.ServerUnavailable`."""
        self._connection.close()

    def __enter__(self) -> KVShelfClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
