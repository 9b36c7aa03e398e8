"""The connector's stats reports and the Prometheus metrics vLLM's frontend makes of them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvshelf.metric_types import Kind
from kvshelf.metrics import CONNECTOR_GROUPS

stats_module = pytest.importorskip("kvshelf.vllm.stats")
prometheus = pytest.importorskip("kvshelf.vllm.prometheus")


def samples() -> dict[tuple[str, str], float]:
    """(sample name, engine label) -> value, of kvshelf's connector metrics."""
    text = generate_latest(REGISTRY).decode()
    return {
        (s.name, s.labels.get("engine", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(prometheus.PREFIX) and "le" not in s.labels
    }


def build() -> object:
    types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
    engines = {0: ["model", "0"], 1: ["model", "1"]}
    return prometheus.KVShelfPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], engines
    )


def test_every_declared_connector_metric_is_registered_per_engine() -> None:
    build()
    build()  # a second stats logger in the same process replaces the first one's metrics
    names = {name for name, _ in samples()}
    for group in CONNECTOR_GROUPS:
        for metric in group:
            exported = prometheus.PREFIX + metric.name
            suffix = {Kind.COUNTER: "_total", Kind.GAUGE: "", Kind.HISTOGRAM: "_count"}
            assert exported + suffix[metric.kind] in names, metric.name


def test_reports_become_counter_increments_gauge_values_and_observations() -> None:
    metrics = build()
    worker_a = stats_module.KVShelfConnectorStats(
        data={"blocks_loaded": 3, "load_seconds": [0.001, 0.002]}
    )
    worker_b = stats_module.KVShelfConnectorStats(
        data={"blocks_loaded": 2, "load_seconds": [0.004], "blocks_protected": 5}
    )
    merged = worker_a.aggregate(worker_b)
    assert merged.reduce() == {
        "blocks_loaded": 5,
        "load_seconds_count": 3,
        "load_seconds_sum": 0.007,
        "blocks_protected": 5,
    }
    metrics.observe(merged.data, engine_idx=1)
    metrics.observe({"blocks_loaded": 1, "blocks_protected": 2, "lookups_new": 7}, engine_idx=1)
    values = samples()
    p = prometheus.PREFIX
    assert values[(f"{p}blocks_loaded_total", "1")] == 6
    assert values[(f"{p}blocks_loaded_total", "0")] == 0
    assert values[(f"{p}blocks_protected", "1")] == 2
    assert values[(f"{p}load_seconds_count", "1")] == 3
    assert values[(f"{p}load_seconds_sum", "1")] == pytest.approx(0.007)
