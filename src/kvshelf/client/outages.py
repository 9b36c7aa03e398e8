"""What one process's connections to a server learn together: that it stopped answering.

Each :class:`~kvshelf.client.connection.Connection` learns of an outage by waiting a whole
timeout for a reply that never comes. A vLLM engine holds several connections to one server
(the scheduler's, each worker's, the events reader's), often in one process, and left alone
each pays that timeout in turn: a request that meets the worker's stalled store first and the
scheduler's stalled lookup next waits twice. Connections that join one :class:`Outages`
share the news instead: the first to time out tells the others, which fail fast from then on
(:meth:`Connection.assume_down`), so one outage costs the process one timeout. Each keeps its
own probe, so each comes back as soon as the server answers it.

:func:`shared_outages` is the process's group for one server, which the connector's clients
join; a client made without a group (a benchmark's monitor beside its attackers) learns only
for itself. No vLLM or torch import.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol


class _Member(Protocol):
    def assume_down(self) -> None: ...


class Outages:
    """Connections to one server that tell each other when it stopped answering."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Closed clients drop out by themselves once collected.
        self._members: weakref.WeakSet[_Member] = weakref.WeakSet()

    def join(self, member: _Member) -> None:
        with self._lock:
            self._members.add(member)

    def leave(self, member: _Member) -> None:
        with self._lock:
            self._members.discard(member)

    def timed_out(self, member: _Member) -> None:
        """``member`` waited a whole timeout in vain: every other member assumes the server is
        down (never waits: see :meth:`Connection.assume_down`)."""
        with self._lock:
            others = [other for other in self._members if other is not member]
        for other in others:
            other.assume_down()


_shared: dict[tuple[str, int], Outages] = {}
_shared_lock = threading.Lock()


def shared_outages(host: str, port: int) -> Outages:
    """This process's group of connections to the server at ``host``:``port``."""
    with _shared_lock:
        return _shared.setdefault((host, port), Outages())
