"""The gateway's Prometheus metrics (names and buckets from ``dhisparse.metrics``), in a registry
of its own so that several apps can live in one process (tests).

Metrics count *worker requests*: a request with ``n`` choices is ``n`` of them, each with its own
prefill, as vLLM v1 counts them. "Waiting" is a request that has no token yet (queued in the
gateway or on the worker, or prefilling); "running" is one that is producing tokens.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from dhisparse import metrics as names
from services.gateway.generation import GenerationDelta

# Why a worker request went where it did (``affinity.Routed``).
ROUTING_REASONS = ("affinity", "load", "load-over-affinity")
# What became of a record of the shared affinity feed (``affinity_feed``).
FEED_OUTCOMES = ("sent", "applied", "dropped")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.running = Gauge(
            names.NUM_REQUESTS_RUNNING, "Requests producing tokens.", ["model"], registry=r
        )
        self.waiting = Gauge(
            names.NUM_REQUESTS_WAITING, "Requests with no token yet.", ["model"], registry=r
        )
        self.ttft = Histogram(
            names.TIME_TO_FIRST_TOKEN,
            "Time from the request's arrival at the gateway to its first token.",
            ["model"],
            buckets=names.TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            names.TIME_PER_OUTPUT_TOKEN,
            "Time between consecutive output tokens (inter-token latency).",
            ["model"],
            buckets=names.TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            names.E2E_REQUEST_LATENCY,
            "Time from the request's arrival to its last token.",
            ["model"],
            buckets=names.E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            names.PROMPT_TOKENS, "Prompt tokens of the requests served.", ["model"], registry=r
        )
        self.generation_tokens = Counter(
            names.GENERATION_TOKENS, "Tokens generated.", ["model"], registry=r
        )
        self.request_success = Counter(
            names.REQUEST_SUCCESS,
            "Requests finished, by finish reason.",
            ["model", "finished_reason"],
            registry=r,
        )
        # Admission (DESIGN §1): a worker request waits for capacity in the ledger.
        self.allocation_wait = Histogram(
            names.ALLOCATION_WAIT,
            "Time from a worker request's admission attempt to its lease (0 when at once).",
            ["model"],
            buckets=names.ALLOC_WAIT_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            names.QUEUE_DEPTH,
            "Worker requests waiting for capacity in this gateway's admission queue.",
            ["model"],
            registry=r,
        )
        self.rejected = Counter(
            names.REQUESTS_REJECTED,
            "Worker requests admission turned away, by reason and HTTP status.",
            ["model", "reason", "status"],
            registry=r,
        )
        self.admitted_sessions = Gauge(
            names.ADMITTED_SESSIONS,
            "Leases the ledger holds on the worker (every gateway replica's).",
            ["model", "worker"],
            registry=r,
        )
        self.admitted_bytes = Gauge(
            names.ADMITTED_BYTES,
            "KV bytes the ledger's leases hold on the worker.",
            ["model", "worker"],
            registry=r,
        )
        self.admitted_shared_bytes = Gauge(
            names.ADMITTED_SHARED_BYTES,
            "Of the KV bytes the ledger's leases hold on the worker, the prefix pages that "
            "live requests there share, counted once.",
            ["model", "worker"],
            registry=r,
        )
        self.free_capacity = Gauge(
            names.FREE_CAPACITY_BYTES,
            "The worker's registered KV capacity not held by leases.",
            ["model", "worker"],
            registry=r,
        )

        self.streams_resumed = Counter(
            names.STREAMS_RESUMED,
            "Streams whose worker died mid-generation, by outcome: re-attached to the resumed "
            "session, or failed.",
            ["model", "outcome"],
            registry=r,
        )
        self.adoptions = Counter(
            names.ADOPTIONS,
            "Streams whose worker died or drained mid-generation, by outcome: adopted by a live "
            "peer of its node, or no peer could hold it (it waits for the restart).",
            ["model", "outcome"],
            registry=r,
        )
        self.adoption_latency = Histogram(
            names.ADOPTION_LATENCY,
            "From a stream's break to the first response of the peer that adopted it.",
            ["model"],
            buckets=names.ALLOC_WAIT_BUCKETS,
            registry=r,
        )
        self.waiting_restart = Gauge(
            names.SESSIONS_WAITING_RESTART,
            "Streams waiting for their worker's restart (no live peer could adopt them).",
            ["model"],
            registry=r,
        )
        self._models_seen: set[str] = set()
        # Prefix affinity (``affinity``) and what the workers reported imported.
        self.routing_decisions = Counter(
            names.ROUTING_DECISIONS,
            "Admitted worker requests by why their worker was chosen: the longest predicted "
            "prefix hit (affinity), no predicted hit anywhere (load), or a longer predicted hit "
            "elsewhere lost to load or room (load-over-affinity).",
            ["model", "reason"],
            registry=r,
        )
        self.predicted_tokens = Counter(
            names.PREFIX_AFFINITY_PREDICTED_TOKENS,
            "Prompt tokens the chosen worker's node was predicted to hold as a cached prefix.",
            ["model"],
            registry=r,
        )
        self.affinity_pages = Gauge(
            names.PREFIX_AFFINITY_INDEX_PAGES,
            "Pages this gateway's prefix-affinity index remembers.",
            ["model"],
            registry=r,
        )
        self.affinity_feed = Counter(
            names.PREFIX_AFFINITY_FEED_RECORDS,
            "Records of the gateway replicas' shared prefix-affinity feed: this replica's "
            "appended (sent), the others' applied to its index (applied), and records lost to "
            "a full queue or an unreachable Redis (dropped).",
            ["model", "outcome"],
            registry=r,
        )
        self.feed_shared = False  # this replica shares affinity records (its series exist)
        self.prompt_tokens_cached = Counter(
            names.PROMPT_TOKENS_CACHED,
            "Prompt tokens the workers imported from a cached prefix instead of computing.",
            ["model"],
            registry=r,
        )
        self.prompt_tokens_shared = Counter(
            names.PROMPT_TOKENS_SHARED,
            "Of the cached prompt tokens, those whose device pages the workers share with other "
            "requests (admission counts those pages once).",
            ["model"],
            registry=r,
        )

    def export_zeros(self, model: str) -> None:
        """Exports the counters of ``model`` that may stay at zero for long (streams resumed,
        routing reasons, cached tokens) from its first request on, so that their rates
        exist before any worker ever died or any prefix was hit."""
        if model not in self._models_seen:
            self._models_seen.add(model)
            for outcome in ("resumed", "failed"):
                self.streams_resumed.labels(model, outcome)
            for outcome in ("adopted", "no_peer"):
                self.adoptions.labels(model, outcome)
            self.adoption_latency.labels(model)
            self.waiting_restart.labels(model)
            for reason in ROUTING_REASONS:
                self.routing_decisions.labels(model, reason)
            self.predicted_tokens.labels(model)
            self.prompt_tokens_cached.labels(model)
            self.prompt_tokens_shared.labels(model)
            self.affinity_pages.labels(model)
            if self.feed_shared:
                for outcome in FEED_OUTCOMES:
                    self.affinity_feed.labels(model, outcome)

    def track(self, model: str, arrival: float | None = None) -> RequestTracker:
        """Starts tracking one worker request that arrived at ``arrival`` (monotonic)."""
        return RequestTracker(self, model, time.monotonic() if arrival is None else arrival)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """One worker request from arrival to its end. ``finish`` is idempotent, so every exit
    path (finished, failed, cancelled) may call it."""

    def __init__(self, metrics: GatewayMetrics, model: str, arrival: float) -> None:
        self.m = metrics
        self.model = model
        self.arrival = arrival
        self.last_token_at: float | None = None
        self.done = False
        metrics.waiting.labels(model).inc()

    def on_delta(self, delta: GenerationDelta) -> None:
        n = len(delta.token_ids)
        if self.done or n == 0:
            return
        t = time.monotonic()
        if self.last_token_at is None:
            self.m.waiting.labels(self.model).dec()
            self.m.running.labels(self.model).inc()
            self.m.ttft.labels(self.model).observe(t - self.arrival)
            self.m.prompt_tokens.labels(self.model).inc(delta.prompt_tokens)
            self.m.prompt_tokens_cached.labels(self.model).inc(delta.cached_prompt_tokens)
            self.m.prompt_tokens_shared.labels(self.model).inc(delta.shared_prompt_tokens)
            # The first delta's other tokens came out of the same step as the first one.
        else:
            # A step that emits k tokens (speculative decoding) spreads its time over them.
            per_token = (t - self.last_token_at) / n
            for _ in range(n):
                self.m.tpot.labels(self.model).observe(per_token)
        self.m.generation_tokens.labels(self.model).inc(n)
        self.last_token_at = t

    def finish(self, finished_reason: str | None) -> None:
        """``finished_reason`` is stop/length/abort, or None for a failure (not counted as a
        success)."""
        if self.done:
            return
        self.done = True
        gauge = self.m.waiting if self.last_token_at is None else self.m.running
        gauge.labels(self.model).dec()
        if finished_reason is not None:
            self.m.request_success.labels(self.model, finished_reason).inc()
            self.m.e2e.labels(self.model).observe(time.monotonic() - self.arrival)
