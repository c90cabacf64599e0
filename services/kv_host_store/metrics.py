"""The store's Prometheus metrics (names from ``dhisparse.metrics``), read from the store at
scrape time: one source of truth, no gauges to keep in step with every RPC."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dhisparse import metrics as names
from dhisparse.metrics_server import serve_metrics
from services.kv_host_store.store import HostStore


class StoreCollector(Collector):
    """Exports one ``HostStore``'s stats; ``collect`` runs on the metrics server's thread."""

    def __init__(self, store: HostStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        s = self._store.stats()
        yield GaugeMetricFamily(
            names.HOST_STORE_USED_BYTES, "Arena bytes held by live regions", value=s.used_bytes
        )
        yield GaugeMetricFamily(
            names.HOST_STORE_CAPACITY_BYTES, "Arena size in bytes", value=s.capacity_bytes
        )
        yield GaugeMetricFamily(
            names.HOST_STORE_DURABLE_BYTES,
            "Bytes of rows marked durable (complete host backups)",
            value=s.durable_bytes,
        )
        yield GaugeMetricFamily(names.HOST_STORE_REGIONS, "Live regions", value=s.regions)
        yield GaugeMetricFamily(
            names.HOST_STORE_REQUESTS, "Requests holding regions", value=s.requests
        )
        # CounterMetricFamily exports the name with "_total" appended.
        yield CounterMetricFamily(
            names.HOST_STORE_REFUSED,
            "Allocations refused because no contiguous range fit",
            value=s.allocations_refused,
        )
        yield GaugeMetricFamily(
            names.HOST_STORE_OWNERS, "Registered worker processes whose lease runs",
            value=s.owners_live,
        )  # fmt: skip
        yield CounterMetricFamily(
            names.HOST_STORE_ADOPTIONS,
            "Requests of dead workers adopted by a live one",
            value=s.adoptions,
        )
        yield CounterMetricFamily(
            names.HOST_STORE_OWNERS_FENCED,
            "Worker generations a live peer found unreachable and fenced off to adopt from them",
            value=s.owners_fenced,
        )
        yield CounterMetricFamily(
            names.HOST_STORE_HANDOVERS,
            "Requests their live owner offered to its peers",
            value=s.handovers,
        )
        yield CounterMetricFamily(
            names.HOST_STORE_ORPHANS_EXPIRED,
            "Requests of dead workers freed because nobody adopted them in time",
            value=s.orphans_expired,
        )
        yield GaugeMetricFamily(
            names.HOST_STORE_PREFIX_RECORDS, "Cached prefixes the store owns",
            value=s.prefix_records,
        )  # fmt: skip
        yield GaugeMetricFamily(
            names.HOST_STORE_PREFIX_BYTES, "Arena bytes held by cached prefixes",
            value=s.prefix_bytes,
        )  # fmt: skip
        yield CounterMetricFamily(
            names.HOST_STORE_PREFIX_EVICTIONS,
            "Cached prefixes evicted (least recently used) to make room for an allocation",
            value=s.prefix_evictions,
        )


def build_registry(store: HostStore) -> CollectorRegistry:
    """A registry of its own (not the process-global one), so tests can run several stores."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    return registry


def start_metrics_server(
    registry: CollectorRegistry, host: str, port: int
) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serves ``/metrics`` on a daemon thread; ``port`` 0 picks a free one (see
    ``server.server_port``). Stop with ``server.shutdown(); server.server_close()``."""
    return serve_metrics(registry, host, port)
