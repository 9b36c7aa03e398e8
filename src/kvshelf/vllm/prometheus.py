"""kvshelf's connector metrics in vLLM's Prometheus ``/metrics``.

vLLM's frontend asks the connector class for a ``KVConnectorPromMetrics``
(``build_prom_metrics``) and hands it each engine's connector stats as they arrive: the
``data`` of :class:`~kvshelf.vllm.stats.KVShelfConnectorStats` (counter increments, gauge
values, lists of copy times). :class:`KVShelfPromMetrics` declares one Prometheus metric per
name of :data:`kvshelf.metrics.CONNECTOR_GROUPS`, named ``kvshelf_connector_`` + the name
(counters get Prometheus' ``_total``), with vLLM's labels (``model_name``, ``engine``), using
the metric classes vLLM passes in (so that vLLM's multiprocess mode applies to them too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)

from kvshelf.metric_types import Kind
from kvshelf.metrics import CONNECTOR_GROUPS

if TYPE_CHECKING:
    from vllm.config import VllmConfig

PREFIX = "kvshelf_connector_"


class KVShelfPromMetrics(KVConnectorPromMetrics):
    """One Prometheus metric per connector metric, one labelled child per engine.

    Args: those of ``KVConnectorPromMetrics``.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister_earlier()
        # name -> (kind, engine index -> the engine's labelled metric)
        self._metrics: dict[str, tuple[Kind, dict[int, Any]]] = {}
        for group in CONNECTOR_GROUPS:
            for metric in group:
                family = self._declare(metric.name, metric.kind, metric.help, metric.buckets)
                children = {
                    engine: family.labels(*values)
                    for engine, values in per_engine_labelvalues.items()
                }
                self._metrics[metric.name] = (metric.kind, children)

    def _declare(self, name: str, kind: Kind, help: str, buckets: tuple[float, ...]) -> PromMetric:
        common: dict[str, Any] = {
            "name": PREFIX + name,
            "documentation": help,
            "labelnames": self._labelnames,
        }
        if kind is Kind.COUNTER:
            return self._counter_cls(**common)
        if kind is Kind.GAUGE:
            return self._gauge_cls(**common, multiprocess_mode="mostrecent")
        return self._histogram_cls(**common, buckets=list(buckets))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            entry = self._metrics.get(name)
            if entry is None:  # a name from a newer kvshelf on the engine side
                continue
            kind, children = entry
            child = children[engine_idx]
            if kind is Kind.COUNTER:
                if value > 0:
                    child.inc(value)
            elif kind is Kind.GAUGE:
                child.set(value)
            else:
                for observation in value:
                    child.observe(observation)


def _unregister_earlier() -> None:
    """Drop kvshelf's connector metrics of an earlier stats logger in this process (vLLM
    unregisters its own ``vllm:`` metrics the same way), so that registering again works."""
    # prometheus_client has no public listing of collectors by name.
    for collector, names in list(REGISTRY._collector_to_names.items()):
        if any(name.startswith(PREFIX) for name in names):
            REGISTRY.unregister(collector)
