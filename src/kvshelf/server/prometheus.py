"""The server's HTTP endpoint: Prometheus ``/metrics`` and ``/healthz``, on a thread of its own.

``kvshelf server --metrics-port PORT`` starts it, bound to the ``--host`` address. Every series
derives from the declarations in :mod:`kvshelf.metrics`: ``kvshelf_`` + a ``kvshelf stats
--json`` field (group ``SERVER``; counters keep their ``_total``), the request handling
histograms (``SERVER_TIMINGS``) and the per-pool gauges (``SERVER_POOLS``).
:class:`ServerCollector` turns them into Prometheus families at each scrape.

The HTTP thread never calls into the socket loop and takes no lock the loop takes: it reads the
loop's counters, gauges and histogram lists (ints and list copies, consistent enough under the
GIL) and the loop's heartbeat. ``/healthz`` answers 200 while the heartbeat is younger than
``HEALTHY_WITHIN_S`` (the loop stamps it at least every 100 ms), else 503.

Must not import torch or vLLM.
"""

from __future__ import annotations

import http.server
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvshelf.metric_types import Histograms, Kind
from kvshelf.metrics import SERVER, SERVER_POOLS, SERVER_TENANTS, SERVER_TIMINGS

logger = logging.getLogger(__name__)

PREFIX = "kvshelf_"
# A loop that has not stamped its heartbeat for this long is not answering.
HEALTHY_WITHIN_S = 2.0
# Pools beyond this many (by name) are summed under pool="other": bounded label cardinality.
MAX_POOL_LABELS = 64


class ServerCollector(Collector):
    """The server's metrics as Prometheus families, read at each scrape.

    Args:
        stats: the ``kvshelf stats`` fields (:meth:`RequestHandler.stats`).
        timings: the request handling histograms.
        pool_objects: committed objects per pool name.
        tenants: L1 bytes and lookup hits per tenant label (already bounded).
    """

    def __init__(
        self,
        stats: Callable[[], dict[str, int]],
        timings: Histograms,
        pool_objects: Callable[[], dict[str, int]],
        tenants: Callable[[], tuple[dict[str, int], dict[str, int]]] = lambda: ({}, {}),
    ) -> None:
        self._stats = stats
        self._timings = timings
        self._pool_objects = pool_objects
        self._tenants = tenants

    def collect(self) -> Iterator[Metric]:
        values = self._stats()
        for metric in SERVER:
            value = values.get(metric.name)
            if value is None:
                continue
            name = PREFIX + metric.name
            if metric.kind is Kind.COUNTER:
                # The family appends "_total" to the sample itself.
                yield CounterMetricFamily(name.removesuffix("_total"), metric.help, value=value)
            else:
                yield GaugeMetricFamily(name, metric.help, value=value)
        timings = self._timings.snapshot()
        for metric in SERVER_TIMINGS:
            *counts, total, count = timings[metric.name]
            buckets = []
            cumulative = 0
            for bound, bucket_count in zip(metric.buckets, counts, strict=False):
                cumulative += int(bucket_count)
                buckets.append((repr(float(bound)), cumulative))
            buckets.append(("+Inf", int(count)))
            yield HistogramMetricFamily(
                PREFIX + metric.name, metric.help, buckets=buckets, sum_value=total
            )
        pools = SERVER_POOLS["pool_resident_objects"]
        family = GaugeMetricFamily(PREFIX + pools.name, pools.help, labels=list(pools.labels))
        for pool, value in _bounded(self._pool_objects()).items():
            family.add_metric([pool], value)
        yield family
        tenant_bytes, tenant_hits = self._tenants()
        metric = SERVER_TENANTS["tenant_bytes"]
        gauge = GaugeMetricFamily(PREFIX + metric.name, metric.help, labels=list(metric.labels))
        for tenant, value in sorted(tenant_bytes.items()):
            gauge.add_metric([tenant], value)
        yield gauge
        metric = SERVER_TENANTS["tenant_hit_objects_total"]
        counter = CounterMetricFamily(
            PREFIX + metric.name.removesuffix("_total"), metric.help, labels=list(metric.labels)
        )
        for tenant, value in sorted(tenant_hits.items()):
            counter.add_metric([tenant], value)
        yield counter


def _bounded(per_pool: dict[str, int]) -> dict[str, int]:
    """At most MAX_POOL_LABELS pools by name, the rest summed under "other"."""
    names = sorted(per_pool)
    bounded = {name: per_pool[name] for name in names[:MAX_POOL_LABELS]}
    if len(names) > MAX_POOL_LABELS:
        bounded["other"] = sum(per_pool[name] for name in names[MAX_POOL_LABELS:])
    return bounded


class MetricsServer:
    """``/metrics`` and ``/healthz`` served by a daemon thread until :meth:`close`.

    Args:
        host: the address to bind (the server's ``--host``).
        port: the TCP port.
        collector: the server's metrics.
        heartbeat: the loop's latest ``time.monotonic()`` stamp.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(
        self, host: str, port: int, collector: Collector, heartbeat: Callable[[], float]
    ) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        handler = _handler_class(registry, heartbeat)
        server_class = _IPv6Server if ":" in host else http.server.ThreadingHTTPServer
        self._server = server_class((host, port), handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvshelf-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


class _IPv6Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _handler_class(
    registry: CollectorRegistry, heartbeat: Callable[[], float]
) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            elif path == "/healthz":
                age = time.monotonic() - heartbeat()
                if age < HEALTHY_WITHIN_S:
                    self._reply(200, "text/plain", b"ok\n")
                else:
                    body = f"socket loop silent for {age:.1f} s\n".encode()
                    self._reply(503, "text/plain", body)
            else:
                self._reply(404, "text/plain", b"not found: try /metrics or /healthz\n")

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            logger.debug("metrics endpoint: " + format, *args)

    return Handler
