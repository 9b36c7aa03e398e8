"""The server's Prometheus endpoint: /metrics parsed with prometheus_client's parser, /healthz."""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvshelf.metric_types import Histograms, Kind
from kvshelf.metrics import SERVER, SERVER_POOLS, SERVER_TIMINGS
from kvshelf.protocol import PageLayout
from kvshelf.server.prometheus import HEALTHY_WITHIN_S, MetricsServer, ServerCollector
from testbed.server import ServerProcess, free_port

LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="l", page_bytes=4096, world_size=2, rank=0
)


def scrape(port: int) -> dict[str, float]:
    """Every sample of ``/metrics``: ``name{label=value,...}`` (labels sorted) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def health(port: int, timeout_s: float = 1.0) -> int | None:
    """``/healthz``'s status, or None when it does not answer within ``timeout_s``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (TimeoutError, urllib.error.URLError):
        return None


@pytest.fixture
def served() -> Iterator[tuple[ServerProcess, int]]:
    port = free_port()
    with ServerProcess(l1_size_gb=1 / 64, extra_args=["--metrics-port", str(port)]) as server:
        yield server, port


def test_metrics_are_the_stats_fields_and_move_by_what_the_requests_did(
    served: tuple[ServerProcess, int],
) -> None:
    server, port = served
    before = scrape(port)
    hashes = [bytes([i]) * 32 for i in range(6)]
    with server.client() as client:
        pool = client.register(LAYOUT).pool
        for rank in (0, 1):
            client.commit(client.reserve(pool, rank, hashes[:4]).reservation_id)
        hit = client.lookup(pool, hashes, world_size=2, lock=True)
        for rank in (0, 1):
            # Each rank copied its 4 hit pages (loaded_objects_total counts what ranks report).
            client.release(hit.lock_id, rank, copied=hit.num_hit_blocks)
        stats = client.stats()
        # Scraped while the client is connected: local_socket_clients counts it.
        after = scrape(port)

    # Every kvshelf stats field, under kvshelf_ + its name, with the same value.
    for metric in SERVER:
        assert after[f"kvshelf_{metric.name}"] == stats[metric.name], metric.name

    def moved(name: str) -> float:
        return after[name] - before[name]

    assert hit.num_hit_blocks == 4
    assert moved("kvshelf_committed_objects_total") == 8
    assert moved("kvshelf_lookup_requests_total") == 1
    assert moved("kvshelf_lookup_requested_objects_total") == 12
    assert moved("kvshelf_lookup_hit_objects_total") == 8
    assert moved("kvshelf_loaded_objects_total") == 8
    # The lookup stopped at block 4, which nobody stored.
    assert moved("kvshelf_miss_never_stored_total") == 1
    assert after["kvshelf_resident_bytes"] == 8 * 4096
    assert after["kvshelf_capacity_bytes"] == (1 << 30) // 64
    assert after[f"kvshelf_pool_resident_objects{{pool={pool}}}"] == 8
    # One observation per handled request, in seconds.
    counts = {"lookup": 1, "reserve": 2, "commit": 2, "release": 2}
    for request, count in counts.items():
        name = f"kvshelf_{request}_duration_seconds"
        assert moved(f"{name}_count") == count
        assert after[f"{name}_bucket{{le=+Inf}}"] == after[f"{name}_count"]
        assert 0 < moved(f"{name}_sum") < count * 0.5


def test_healthz_answers_while_the_loop_runs_and_not_while_it_is_stopped(
    served: tuple[ServerProcess, int],
) -> None:
    server, port = served
    assert health(port) == 200
    os.kill(server.pid, signal.SIGSTOP)
    try:
        # The whole process is stopped, the HTTP thread too: no answer (or a 503).
        assert health(port, timeout_s=HEALTHY_WITHIN_S) in (None, 503)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    deadline = time.monotonic() + 5.0
    while health(port) != 200:
        assert time.monotonic() < deadline, "never healthy again after SIGCONT"
        time.sleep(0.05)


def test_healthz_is_503_when_the_loop_stamps_no_heartbeat() -> None:
    # The HTTP thread alone, with a loop that stopped stamping HEALTHY_WITHIN_S ago.
    stamp = [time.monotonic()]
    collector = ServerCollector(dict, Histograms(SERVER_TIMINGS), dict)
    metrics = MetricsServer("127.0.0.1", 0, collector, lambda: stamp[0])
    try:
        assert health(metrics.port) == 200
        stamp[0] -= HEALTHY_WITHIN_S
        assert health(metrics.port) == 503
    finally:
        metrics.close()


def test_metrics_port_that_cannot_be_bound_stops_the_server_with_a_message() -> None:
    port = free_port()
    with ServerProcess(extra_args=["--metrics-port", str(port)]):
        second = ServerProcess(extra_args=["--metrics-port", str(port)])
        with pytest.raises(RuntimeError, match="--metrics-port"):
            second.start()
        assert second.returncode == 1


def test_every_declared_server_metric_is_exported(served: tuple[ServerProcess, int]) -> None:
    _, port = served
    names = set(scrape(port))
    for metric in (*SERVER, *SERVER_TIMINGS, *SERVER_POOLS):
        if metric.kind is Kind.HISTOGRAM:
            assert f"kvshelf_{metric.name}_count" in names
        elif metric.labels:
            continue  # one series per pool: none before a pool registers
        else:
            assert f"kvshelf_{metric.name}" in names


def test_every_declared_timing_is_observed_by_some_request_type() -> None:
    from kvshelf.server.handler import _TIMINGS

    assert set(_TIMINGS.values()) == set(SERVER_TIMINGS.names())
