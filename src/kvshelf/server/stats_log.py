"""The server's periodic log line: key counters every ``--stats-log-interval-s`` at INFO.

It reads the same counters ``kvshelf stats`` shows, on the socket loop's thread, and logs what
changed since the previous line next to the totals an operator checks first (used space,
hit ratio). Must not import torch or vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger("kvshelf.server")

# Counters whose change since the previous line the line shows.
_DELTAS = (
    "lookup_requests_total",
    "lookup_requested_objects_total",
    "lookup_hit_objects_total",
    "committed_objects_total",
    "evicted_objects_total",
    "bad_requests_total",
)


def _ratio(hits: int, requested: int) -> str:
    return f"{hits / requested:.1%}" if requested else "-"


class StatsLog:
    """Logs one INFO line of key counters at most every ``interval_s`` seconds.

    Args:
        interval_s: seconds between lines.
        read_stats: the server's counters (the ``kvshelf stats`` fields).
        now: the time of the first call to come, so the first line is one interval later.
    """

    def __init__(
        self, interval_s: float, read_stats: Callable[[], dict[str, int]], now: float
    ) -> None:
        assert interval_s > 0
        self._interval_s = interval_s
        self._read_stats = read_stats
        self._due = now + interval_s
        self._previous = dict.fromkeys(_DELTAS, 0)

    def tick(self, now: float) -> None:
        """Log the line if it is due."""
        if now < self._due:
            return
        self._due = now + self._interval_s
        stats = self._read_stats()
        delta = {name: stats[name] - self._previous[name] for name in _DELTAS}
        self._previous = {name: stats[name] for name in _DELTAS}
        capacity = stats["capacity_bytes"]
        logger.info(
            "stats: used %.1f%% (%d objects in %d pools), lookups +%d (hit ratio %s, %s since "
            "start), committed +%d, evicted +%d, bad requests +%d, uptime %d s",
            100 * stats["resident_bytes"] / capacity if capacity else 0.0,
            stats["resident_objects"],
            stats["pools"],
            delta["lookup_requests_total"],
            _ratio(delta["lookup_hit_objects_total"], delta["lookup_requested_objects_total"]),
            _ratio(stats["lookup_hit_objects_total"], stats["lookup_requested_objects_total"]),
            delta["committed_objects_total"],
            delta["evicted_objects_total"],
            delta["bad_requests_total"],
            stats["uptime_seconds"],
        )
