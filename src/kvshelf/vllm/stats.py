"""kvshelf's counters in vLLM's connector stats (names and kinds: :mod:`kvshelf.metrics`).

``data`` maps a counter to its increment since the last report, a gauge to its value, and a
histogram (``WORKER_TIMINGS``) to the list of its observations since the last report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvshelf.metric_types import Kind
from kvshelf.metrics import CONNECTOR_GROUPS, gauge_names

# Values that describe "now" rather than count events: the latest one wins when vLLM merges
# the stats of successive steps, instead of adding up.
GAUGES = gauge_names(CONNECTOR_GROUPS)
# Values that are lists of observations: they concatenate.
HISTOGRAMS = frozenset(name for group in CONNECTOR_GROUPS for name in group.names(Kind.HISTOGRAM))


@dataclass
class KVShelfConnectorStats(KVConnectorStats):
    """Counters since the last report (events) plus current values (gauges).

    ``data`` maps a counter name to an int. Scheduler and worker stats have disjoint names,
    so vLLM's merge of the two is a plain union; worker stats of several ranks add up.
    """

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if name in GAUGES:
                self.data[name] = value
            elif name in HISTOGRAMS:
                self.data[name] = [*self.data.get(name, ()), *value]
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = {}
        for name, value in self.data.items():
            if name in HISTOGRAMS:
                reduced[f"{name}_count"] = len(value)
                reduced[f"{name}_sum"] = round(sum(value), 6)
            else:
                reduced[name] = value
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CounterDelta:
    """Turns cumulative counters into per-report increments."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, current: dict[str, Any]) -> dict[str, int]:
        delta: dict[str, int] = {}
        for name, value in current.items():
            if name in GAUGES:
                delta[name] = value
            else:
                delta[name] = value - self._last.get(name, 0)
        self._last = {k: v for k, v in current.items() if k not in GAUGES}
        return delta
