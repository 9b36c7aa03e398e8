"""Every metric is declared once (kvshelf.metrics), and each component counts exactly those."""

from __future__ import annotations

import pytest

from kvshelf.metric_types import Counters, Kind
from kvshelf.metrics import CONNECTOR_GROUPS, LAZY, SCHEDULER, SERVER, WORKER
from kvshelf.roles.scheduler import SchedulerConnector
from kvshelf.roles.worker import WorkerConnector
from testbed.server import ServerProcess


def test_connector_metric_names_never_collide() -> None:
    # vLLM merges the scheduler's and the workers' connector stats by name: a name used by two
    # groups would add two different counts together.
    names = [name for group in CONNECTOR_GROUPS for name in group.names()]
    assert len(names) == len(set(names))


def test_counters_count_declared_counters_only() -> None:
    counters = Counters(SCHEDULER)
    counters.add("lookups")
    counters.add("lookup_hit_blocks", 5)
    assert counters["lookups"] == 1 and counters["lookup_hit_blocks"] == 5
    with pytest.raises(KeyError):
        counters.add("lookupz")
    with pytest.raises(KeyError):
        counters.add("inflight_store_requests")  # a gauge: read when a snapshot is taken
    assert set(counters.snapshot()) == set(SCHEDULER.names(Kind.COUNTER))


def test_scheduler_and_worker_snapshots_have_exactly_the_declared_names() -> None:
    # Neither constructor talks to a server; the client is never called here.
    scheduler = SchedulerConnector(None, "pool", block_size=4, world_size=1, get_block_ids=list)
    assert set(scheduler.snapshot()) == set(SCHEDULER.names())
    worker = WorkerConnector(lambda: None, "model", "layout", rank=0, world_size=1)
    assert set(worker.snapshot()) == set(WORKER.names())


def test_vllm_connector_stats_take_their_gauges_from_the_declarations() -> None:
    stats = pytest.importorskip("kvshelf.vllm.stats")
    assert {
        name for group in (SCHEDULER, LAZY, WORKER) for name in group.names(Kind.GAUGE)
    } == stats.GAUGES
    assert "inflight_store_requests" in stats.GAUGES and "drains" not in stats.GAUGES


def test_server_stats_fields_are_exactly_the_declared_ones() -> None:
    with ServerProcess(l1_size_gb=1 / 64) as server, server.client() as client:
        assert set(client.stats()) == set(SERVER.names())
