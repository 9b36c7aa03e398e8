"""kvshelf's counters in vLLM's connector stats (names and kinds: :mod:`kvshelf.metrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvshelf.metrics import CONNECTOR_GROUPS, gauge_names

# Values that describe "now" rather than count events: the latest one wins when vLLM merges
# the stats of successive steps, instead of adding up.
GAUGES = gauge_names(CONNECTOR_GROUPS)


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
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

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
