"""Reading the shipped dashboards: their panels, PromQL expressions and the metric names those
use, checked against ``dhisparse/metrics.py``. Shared by the static and the live tests."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

from dhisparse import metrics
from tests.deploy.conftest import DASHBOARD_DIR

# Every name in dhisparse/metrics.py and its Prometheus type (the comments there say which).
# A name added to metrics.py must be added here, so that the suffix rules below know it.
TYPES: dict[str, str] = {
    metrics.NUM_REQUESTS_RUNNING: "gauge",
    metrics.NUM_REQUESTS_WAITING: "gauge",
    metrics.TIME_TO_FIRST_TOKEN: "histogram",
    metrics.TIME_PER_OUTPUT_TOKEN: "histogram",
    metrics.E2E_REQUEST_LATENCY: "histogram",
    metrics.PROMPT_TOKENS: "counter",
    metrics.GENERATION_TOKENS: "counter",
    metrics.REQUEST_SUCCESS: "counter",
    metrics.ALLOCATION_WAIT: "histogram",
    metrics.QUEUE_DEPTH: "gauge",
    metrics.REQUESTS_REJECTED: "counter",
    metrics.ADMITTED_SESSIONS: "gauge",
    metrics.ADMITTED_BYTES: "gauge",
    metrics.FREE_CAPACITY_BYTES: "gauge",
    metrics.KV_POOL_BYTES: "gauge",
    metrics.RECLAIM_EVENTS: "counter",
    metrics.RECLAIM_PAGES: "counter",
    metrics.RECLAIM_LATENCY: "histogram",
    metrics.REPOPULATED_PAGES: "counter",
    metrics.RESOLVER_ROWS: "counter",
    metrics.HOST_READ_BYTES: "counter",
    metrics.PREFILL_TOKENS_COMPUTED: "counter",
    metrics.SESSIONS_RESUMED: "counter",
    metrics.PREFIX_CACHE_QUERIES: "counter",
    metrics.PREFIX_CACHE_HITS: "counter",
    metrics.PREFIX_CACHE_HIT_TOKENS: "counter",
    metrics.PREFIX_CACHE_LEFT: "counter",
    metrics.RANK_REQUESTS_RUNNING: "gauge",
    metrics.RANK_REQUESTS_WAITING: "gauge",
    metrics.RANK_KV_FREE_BYTES: "gauge",
    metrics.WORKER_CONFIG_INFO: "gauge",
    metrics.DECODE_PASSES: "counter",
    metrics.CUDA_GRAPHS: "gauge",
    metrics.ENGINE_SECONDS: "counter",
    metrics.PREFIX_CACHE_SECONDS: "counter",
    metrics.GC_PAUSE_SECONDS: "counter",
    metrics.GC_PAUSE_MAX_SECONDS: "gauge",
    metrics.KERNEL_BUILDS: "counter",
    metrics.KERNEL_BUILD_SECONDS: "counter",
    metrics.STREAMS_RESUMED: "counter",
    metrics.ADOPTIONS: "counter",
    metrics.ADOPTION_LATENCY: "histogram",
    metrics.SESSIONS_WAITING_RESTART: "gauge",
    metrics.ROUTING_DECISIONS: "counter",
    metrics.PREFIX_AFFINITY_PREDICTED_TOKENS: "counter",
    metrics.PREFIX_AFFINITY_INDEX_PAGES: "gauge",
    metrics.PREFIX_AFFINITY_FEED_RECORDS: "counter",
    metrics.PROMPT_TOKENS_CACHED: "counter",
    metrics.PROMPT_TOKENS_SHARED: "counter",
    metrics.ADMITTED_SHARED_BYTES: "gauge",
    metrics.SPEC_DRAFTS: "counter",
    metrics.SPEC_DRAFT_TOKENS: "counter",
    metrics.SPEC_ACCEPTED_TOKENS: "counter",
    metrics.SPEC_ACCEPTED_PER_POS: "counter",
    metrics.SPEC_BLOCK_WIDTH: "gauge",
    metrics.HOST_STORE_USED_BYTES: "gauge",
    metrics.HOST_STORE_CAPACITY_BYTES: "gauge",
    metrics.HOST_STORE_DURABLE_BYTES: "gauge",
    metrics.HOST_STORE_REGIONS: "gauge",
    metrics.HOST_STORE_REQUESTS: "gauge",
    metrics.HOST_STORE_REFUSED: "counter",
    metrics.HOST_STORE_OWNERS: "gauge",
    metrics.HOST_STORE_ADOPTIONS: "counter",
    metrics.HOST_STORE_OWNERS_FENCED: "counter",
    metrics.HOST_STORE_HANDOVERS: "counter",
    metrics.HOST_STORE_ORPHANS_EXPIRED: "counter",
    metrics.HOST_STORE_PREFIX_RECORDS: "gauge",
    metrics.HOST_STORE_PREFIX_BYTES: "gauge",
    metrics.HOST_STORE_PREFIX_EVICTIONS: "counter",
}

# How each type's series are named in PromQL (prometheus_client's exposition).
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}

METRIC_REF = re.compile(r"\bdhisparse:[A-Za-z0-9_:]+")


def metrics_py_names() -> set[str]:
    return {
        v for k, v in vars(metrics).items() if k.isupper() and isinstance(v, str) and k != "PREFIX"
    }


def base_metric(series: str) -> str | None:
    """The metrics.py name a PromQL series name refers to under the suffix rules, or None."""
    for name, kind in TYPES.items():
        for suffix in SUFFIXES[kind]:
            if series == name + suffix:
                return name
    return None


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel_id: int
    panel: str
    ref: str
    expr: str
    requires: str | None

    @property
    def id(self) -> str:
        return f"{self.dashboard.removesuffix('.json')}:{self.panel_id}{self.ref}"

    def series(self) -> set[str]:
        return set(METRIC_REF.findall(self.expr))


def load_dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def all_panels(dashboard: dict) -> Iterator[dict]:
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row keeps its panels inside


def queries() -> list[Query]:
    out = []
    for name, d in load_dashboards().items():
        for p in all_panels(d):
            for t in p.get("targets", []):
                out.append(
                    Query(
                        name,
                        p["id"],
                        p["title"],
                        t["refId"],
                        t["expr"],
                        p.get("dhisparse_requires"),
                    )
                )
    return out


def instantiate(expr: str, rate_interval: str = "1m") -> str:
    """The expression as Grafana sends it, with every model and instance selected."""
    return (
        expr.replace("$__rate_interval", rate_interval)
        .replace("$model", ".*")
        .replace("$instance", ".*")
    )
