"""Ticketed lookups: sent without waiting, collected later, so the scheduler never waits (and
the same tickets for any request sent ahead of time: a worker's next reserve).

Owns the life of a ticket: :meth:`TicketedLookups.submit_lookup` sends a lookup and returns
its request id as the ticket, :meth:`~TicketedLookups.poll_lookup` takes the result once the
reply arrived (or fails when it cannot come), :meth:`~TicketedLookups.cancel_lookup` gives up
on it (a lock in a reply arriving later is released for the caller), and
:meth:`~TicketedLookups.collect_abandoned` takes such late replies. The connection files the
replies under their tickets (:class:`~kvshelf.client.connection.PendingLookup`) whenever it
receives; this module decides what they mean.

Imports only the protocol and the client's connection, errors and results.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

from kvshelf.client.connection import WAIT_SLICE_S, Connection, PendingLookup
from kvshelf.client.errors import ServerError, ServerTimeout, ServerUnavailable
from kvshelf.client.results import LookupResult, lookup_result
from kvshelf.protocol import Lookup, Reply, Request, lookup_deadline_ms


class TicketedLookups:
    """The lookups sent without waiting over one connection, until their results are taken.

    Args:
        connection: the connection to send them on and whose lock guards them.
    """

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        # The same objects for the connection's life, kept here so each call reaches them
        # directly: the scheduler submits and polls every step.
        self._lock = connection.lock
        self._pending = connection.pending_lookups
        self._timeout_s = connection.timeout_s

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
        """Send a lookup without waiting for its reply.

        Args: as :meth:`kvshelf.client.KVShelfClient.lookup`, and ``count_miss``: whether the
            server counts a miss of this lookup under its reason (a request's first lookup);
            ``block_keys`` and ``ends``: where a hit may end, for a model with state-space
            layers (:class:`~kvshelf.protocol.Lookup`); ``tenant``: whose lookup it is.

        Returns:
            A ticket for :meth:`poll_lookup` (or :meth:`cancel_lookup`); exactly one of the
            two must be called until it returns a result or raises.

        Raises:
            ServerUnavailable: the server failed recently or the send was refused.
        """
        request = Lookup(
            request_id=0,
            pool=pool,
            hashes=list(hashes),
            world_size=world_size,
            lock=lock,
            deadline_ms=lookup_deadline_ms(self._timeout_s),
            count_miss=count_miss,
            fetch=fetch,
            block_keys=block_keys,
            ends=[list(keys) for keys in ends],
            tenant=tenant,
        )
        return self.submit(request)

    def submit(self, request: Request) -> int:
        """Send ``request`` without waiting; its reply is kept for the returned ticket.

        Returns:
            A ticket for :meth:`wait_reply` (:meth:`poll_lookup` for a lookup), to be taken
            until it returns a reply or raises.

        Raises:
            ServerUnavailable: the server failed recently or the send was refused.
        """
        with self._lock:
            now = time.monotonic()
            # Abandoned lookups whose reply never came (their lock lease expires by itself).
            expired = [
                request_id
                for request_id, pending in self._pending.items()
                if pending.abandoned and pending.deadline < now
            ]
            for request_id in expired:
                del self._pending[request_id]
            request_id = self._connection.send(request)
            self._pending[request_id] = PendingLookup(now + self._timeout_s)
            return request_id

    def poll_lookup(self, ticket: int, wait_s: float = 0.0) -> LookupResult | None:
        """The result of a submitted lookup, if its reply arrives within ``wait_s``.

        Args:
            ticket: from :meth:`submit_lookup`.
            wait_s: the longest to wait for the reply (0: do not wait).

        Returns:
            The result, or None while the reply may still arrive (call again later).

        Raises:
            ServerTimeout: no reply within the timeout (a ServerUnavailable).
            ServerUnavailable: the connection was reset.
            ServerError: the server rejected the lookup.
        """
        reply = self.wait_reply(ticket, wait_s)
        return None if reply is None else lookup_result(reply)

    def wait_reply(self, ticket: int, wait_s: float = 0.0) -> Reply | None:
        """The reply of a submitted request, if it arrives within ``wait_s``.

        Args:
            ticket: from :meth:`submit`.
            wait_s: the longest to wait for the reply (0: do not wait).

        Returns:
            The reply (an error reply too: the caller checks it), or None while it may still
            arrive (call again later).

        Raises:
            ServerTimeout: no reply within the timeout (a ServerUnavailable).
            ServerUnavailable: the connection was reset.
        """
        with self._lock:
            connection = self._connection
            pending = self._pending[ticket]
            wait_until = time.monotonic() + wait_s
            while pending.reply is None and not pending.lost:
                connection.drain_replies()
                remaining = wait_until - time.monotonic()
                if pending.reply is not None or connection.give_up_if_told() or remaining <= 0:
                    break
                connection.wait_readable(min(remaining, WAIT_SLICE_S))
            if pending.reply is not None:
                del self._pending[ticket]
                return pending.reply
            if pending.lost:
                del self._pending[ticket]
                raise ServerUnavailable(f"{connection.endpoint}: connection reset before the reply")
            if time.monotonic() < pending.deadline:
                return None
            del self._pending[ticket]
            connection.timed_out()
            raise ServerTimeout(f"{connection.endpoint} did not answer within {self._timeout_s} s")

    def cancel_lookup(self, ticket: int) -> LookupResult | None:
        """Give up on a submitted lookup.

        Args:
            ticket: from :meth:`submit_lookup`.

        Returns:
            Its result if the reply already arrived (the caller owns any lock in it), else
            None: a lock in a reply arriving later is released by the client.
        """
        with self._lock:
            pending = self._pending.get(ticket)
            if pending is None:
                return None
            if pending.reply is None and not pending.lost:
                self._connection.drain_replies()
            if pending.reply is not None:
                del self._pending[ticket]
                try:
                    return lookup_result(pending.reply)
                except ServerError:
                    return None
            if pending.lost:
                del self._pending[ticket]
            else:
                pending.abandoned = True
            return None

    def collect_abandoned(self) -> bool:
        """Take replies that already arrived, releasing the locks of cancelled lookups.

        Returns:
            Whether cancelled lookups still wait for their reply (call again later).
        """
        with self._lock:
            if self._connection.up:
                # A failure resets the socket and forgets the cancelled lookups: their locks'
                # leases expire on the server.
                with contextlib.suppress(ServerUnavailable):
                    self._connection.drain_replies()
            return any(pending.abandoned for pending in self._pending.values())
