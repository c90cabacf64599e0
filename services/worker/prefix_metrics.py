"""The worker's prefix-reuse metrics (``serving.prefix_reuse``), counted from its cumulative
stats after every step. Cached bytes and evictions are the store's (``kv_host_store.metrics``):
the node's cache is one, whichever worker left or reads a prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from dhisparse import metrics as m
from services.worker.serving.prefix_reuse import PrefixStats


class PrefixMetrics:
    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        lbl, r = ["model"], registry
        self.model = model
        self.queries = Counter(
            m.PREFIX_CACHE_QUERIES, "Admissions that looked up a cached prefix", lbl, registry=r
        )
        self.hits = Counter(
            m.PREFIX_CACHE_HITS, "Admissions that imported a cached prefix", lbl, registry=r
        )
        self.hit_tokens = Counter(
            m.PREFIX_CACHE_HIT_TOKENS,
            "Prompt tokens imported from cached prefixes instead of computed",
            lbl,
            registry=r,
        )
        self.left = Counter(
            m.PREFIX_CACHE_LEFT,
            "Requests that left their pages in the host store (cached), or could not (refused); "
            "running requests whose computed prompt was kept early for waiting ones (published)",
            [*lbl, "outcome"],
            registry=r,
        )
        for c in (self.queries, self.hits, self.hit_tokens):
            c.labels(model)
        for outcome in ("cached", "refused", "published"):
            self.left.labels(model, outcome)
        self._seen = PrefixStats()

    def update(self, stats: PrefixStats | None, count: bool = True) -> None:
        """Counts what ``stats`` (the engine's; None: prefix reuse is off) gained since the
        last call; with ``count`` False only takes them as seen."""
        if stats is None:
            return
        if not count:
            self._seen = PrefixStats(**vars(stats))
            return
        md, seen = self.model, self._seen
        self.queries.labels(md).inc(stats.queries - seen.queries)
        self.hits.labels(md).inc(stats.hits - seen.hits)
        self.hit_tokens.labels(md).inc(stats.hit_tokens - seen.hit_tokens)
        self.left.labels(md, "cached").inc(stats.left - seen.left)
        self.left.labels(md, "refused").inc(stats.not_left - seen.not_left)
        self.left.labels(md, "published").inc(stats.published - seen.published)
        self._seen = PrefixStats(**vars(stats))
