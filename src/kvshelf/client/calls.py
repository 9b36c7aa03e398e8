"""The client's synchronous calls, and :class:`KVShelfClient`, the client callers hold.

Owns the calls that send one request and wait for its reply (register, lookup, reserve,
commit, abort, release, stats, ping) and the client's public face: it composes one
:class:`~kvshelf.client.connection.Connection` with the
:class:`~kvshelf.client.lookups.TicketedLookups` over it. What a failure or a server restart
does is the connection's business (see :mod:`kvshelf.client`).

Imports only the protocol and the client's other modules: no vLLM or torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshelf.client.connection import Connection
from kvshelf.client.lookups import TicketedLookups
from kvshelf.client.results import LookupResult, Registration, Reservation, lookup_result
from kvshelf.protocol import (
    Abort,
    Commit,
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
)


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
    """

    def __init__(
        self, host: str, port: int, *, timeout_s: float = 1.0, retry_interval_s: float = 1.0
    ) -> None:
        connection = Connection(host, port, timeout_s=timeout_s, retry_interval_s=retry_interval_s)
        self._connection = connection
        self.endpoint = connection.endpoint
        self._lookups = TicketedLookups(connection)
        self._call = connection.call

    def submit_lookup(
        self, pool: str, hashes: Sequence[bytes], *, world_size: int, lock: bool, fetch: bool = True
    ) -> int:
        """Send a lookup without waiting (:meth:`TicketedLookups.submit_lookup`)."""
        return self._lookups.submit_lookup(
            pool, hashes, world_size=world_size, lock=lock, fetch=fetch
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

    def register(self, layout: PageLayout) -> Registration:
        """Create or join the pool for ``layout``; remembered for re-registration.

        Raises:
            ServerUnavailable, ServerError: see :mod:`kvshelf.client`.
        """
        return self._connection.register(layout)

    def lookup(
        self, pool: str, hashes: Sequence[bytes], *, world_size: int, lock: bool, fetch: bool = True
    ) -> LookupResult:
        """Longest prefix of ``hashes`` committed for all ``world_size`` ranks.

        Args:
            pool: the pool name (see :func:`kvshelf.protocol.pool_name`); unknown = no hit.
            hashes: the request's chained block hashes.
            world_size: the number of ranks of the pool.
            lock: lock the hit pages until every rank calls :meth:`release`.
            fetch: let the server load blocks from tiers below L1 first; the result is then
                ``pending`` when they take longer than the server's fetch deadline.

        Raises:
            ServerUnavailable, ServerError: see :mod:`kvshelf.client`.
        """
        request = Lookup(
            request_id=0,
            pool=pool,
            hashes=list(hashes),
            world_size=world_size,
            lock=lock,
            fetch=fetch,
        )
        return lookup_result(self._call(request, LookupReply))

    def reserve(self, pool: str, rank: int, hashes: Sequence[bytes]) -> Reservation:
        """Reserve pages to write the blocks ``hashes`` of ``rank``; None pages are skips.

        Raises:
            ServerUnavailable, ServerError: see :mod:`kvshelf.client`.
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
        """Close the socket; later calls raise :class:`~kvshelf.client.errors.ServerUnavailable`."""
        self._connection.close()

    def __enter__(self) -> KVShelfClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
