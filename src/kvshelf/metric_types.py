"""How kvshelf counts: metric declarations (:class:`Metric`, grouped in :class:`MetricGroup`)
and the thread-safe counters and histograms made from a group (:class:`Counters`,
:class:`Histograms`, :class:`Observations`).

Which metrics exist is :mod:`kvshelf.metrics`' business, not this module's. No import of vLLM,
torch or ZeroMQ: the server and every role import this module.
"""

from __future__ import annotations

import bisect
import enum
import threading
from collections.abc import Iterator
from dataclasses import dataclass


class Kind(enum.Enum):
    COUNTER = "counter"  # events since start; only goes up
    GAUGE = "gauge"  # a current value
    HISTOGRAM = "histogram"  # observations (durations) counted in buckets


@dataclass(frozen=True)
class Metric:
    """One metric.

    Attributes:
        name: the stable name (a ``kvshelf stats`` field or a connector stats key).
        kind: counter or gauge.
        unit: what one unit counts: ``objects``, ``bytes``, ``blocks``, ``requests``, ...
        help: one sentence for an operator.
        buckets: a histogram's upper bounds, ascending (empty for counters and gauges).
        labels: the label names of a metric with one series per label value (bounded).
    """

    name: str
    kind: Kind
    unit: str
    help: str
    buckets: tuple[float, ...] = ()
    labels: tuple[str, ...] = ()


class MetricGroup:
    """The metrics one component keeps, in declaration order; names are unique in a group."""

    def __init__(self, component: str, *metrics: Metric) -> None:
        names = [metric.name for metric in metrics]
        assert len(set(names)) == len(names), f"duplicate metric in {component}"
        self.component = component
        self._metrics = {metric.name: metric for metric in metrics}

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._metrics.values())

    def __getitem__(self, name: str) -> Metric:
        return self._metrics[name]

    def __contains__(self, name: object) -> bool:
        return name in self._metrics

    def names(self, kind: Kind | None = None) -> tuple[str, ...]:
        """The metric names of this group, of one kind or all."""
        return tuple(m.name for m in self._metrics.values() if kind is None or m.kind is kind)


class Counters:
    """The counters of one metric group, counted by name.

    A plain dict underneath: ``add`` is one dict update, cheap enough for per-step and
    per-request paths. An unknown name is a KeyError, so that nothing is counted under a
    name that is not declared.
    """

    __slots__ = ("_values",)

    def __init__(self, group: MetricGroup) -> None:
        self._values: dict[str, int] = dict.fromkeys(group.names(Kind.COUNTER), 0)

    def add(self, name: str, amount: int = 1) -> None:
        self._values[name] += amount

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def snapshot(self) -> dict[str, int]:
        """Every counter's value, by name (a copy)."""
        return dict(self._values)


class Histograms:
    """The histograms of one metric group: per name, counts per bucket, a sum and a count.

    ``observe`` is a bisect and three list updates, cheap enough for per-request paths. The
    lists are only ever updated in place, so another thread may copy them (``snapshot``) at
    any time under the GIL: a copy may be one observation behind, never corrupt.
    """

    __slots__ = ("_buckets", "_values")

    def __init__(self, group: MetricGroup) -> None:
        self._buckets = {m.name: m.buckets for m in group if m.kind is Kind.HISTOGRAM}
        # name -> [count per bucket (the last one: above every bound)..., sum, count]
        self._values: dict[str, list[float]] = {
            name: [0] * (len(buckets) + 1) + [0.0, 0] for name, buckets in self._buckets.items()
        }

    def observe(self, name: str, value: float) -> None:
        values = self._values[name]
        values[bisect.bisect_left(self._buckets[name], value)] += 1
        values[-2] += value
        values[-1] += 1

    def buckets(self, name: str) -> tuple[float, ...]:
        """A histogram's upper bounds."""
        return self._buckets[name]

    def snapshot(self) -> dict[str, list[float]]:
        """Per name: counts per bucket (not cumulative, the last above every bound), sum, count."""
        return {name: list(values) for name, values in self._values.items()}


class Observations:
    """Raw observations of one group's histograms, taken (and cleared) by a reporter.

    For values measured on one process and turned into histograms in another (a worker's copy
    times, reported through vLLM's connector stats): a few per step, so a list each.
    """

    __slots__ = ("_lock", "_values")

    def __init__(self, group: MetricGroup) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, list[float]] = {n: [] for n in group.names(Kind.HISTOGRAM)}

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._values[name].append(value)

    def take(self) -> dict[str, list[float]]:
        """The observations since the last take, by name (only names with any)."""
        with self._lock:
            taken = {name: values for name, values in self._values.items() if values}
            for name in taken:
                self._values[name] = []
        return taken
