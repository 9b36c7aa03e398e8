"""The ZMQ client both connector roles use to talk to the kvshelf server.

Every call is bounded by ``timeout_s``. After a failure (timeout, or a send the socket refuses)
the client fails fast with :class:`ServerUnavailable` until a background probe, which pings the
server every ``retry_interval_s``, hears from it again. So a dead server costs a caller one
timeout, not one per interval: vLLM's step loop does not stall while the cache is away.
Lookups can also be sent without waiting (:meth:`KVShelfClient.submit_lookup`) and collected
later (:meth:`KVShelfClient.poll_lookup`), so the scheduler never waits for a round trip. A
reply carrying a new boot id means the server restarted and lost all state: the client
re-registers its layout (if it has one) and bumps :attr:`KVShelfClient.generation`, so
callers know that page indices and the arena changed. A reply the server sent as an error
raises :class:`ServerError`; the request changed nothing.

Modules: ``connection`` (socket, timeouts, the fail-fast probe, restart detection and
re-registration), ``calls`` (the synchronous calls and :class:`KVShelfClient`), ``lookups``
(the ticketed lookups), ``outages`` (connections of one process that share what they learn of
an outage), ``errors`` and ``results``.

No vLLM or torch import: this package is used by the scheduler process as well.
"""

from kvshelf.client.calls import KVShelfClient
from kvshelf.client.errors import KVShelfError, ServerError, ServerTimeout, ServerUnavailable
from kvshelf.client.results import Cleared, LookupResult, Registration, Reservation, ServerStats

__all__ = [
    "Cleared",
    "KVShelfClient",
    "KVShelfError",
    "LookupResult",
    "Registration",
    "Reservation",
    "ServerError",
    "ServerStats",
    "ServerTimeout",
    "ServerUnavailable",
]
