"""Prefix-affinity routing: pure policy over ``AffinityIndex``, no I/O.

A worker's node imports a cached prefix instead of prefilling it (the node's host store,
``worker.serving.prefix_reuse``), so a request whose leading pages a node served recently is
best sent there — unless that node is much busier. Each healthy candidate gets

    score = weight * predicted_hit_tokens / prompt_tokens - load

where ``predicted_hit_tokens`` are the leading tokens its node likely holds (at most the prompt
less one token: the worker computes at least one) and ``load`` the larger of the share of its
KV capacity the ledger has admitted and the share of its seats taken (``load_share``). The
highest score goes first; at equal scores the worker that served the prefix itself, then the
least-loaded order (``LeastLoadedRouter``, whose ties rotate). With ``weight`` w, a prompt the
node holds entirely outweighs up to w of extra load (0.5: half a worker's capacity). A request
no candidate has a predicted hit for is ranked exactly as without affinity. Only workers that
report a prefix cache (``WorkerStatus.prefix_cache``) can have a predicted hit.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from services.gateway.affinity_index import AffinityIndex, Matched, Place
from services.gateway.prefix_keys import PromptPrefix
from services.gateway.routing import (
    AdmissionJob,
    LeastLoadedRouter,
    RankingRouter,
    WorkerStatus,
)


@dataclass(frozen=True)
class AffinityConfig:
    weight: float = 0.5  # a whole-prompt hit against this share of a worker's load
    max_pages: int = 2048  # leading pages keyed per prompt
    index_pages: int = 200_000  # pages the index remembers (least recently recorded go)
    holders: int = 4  # places remembered per page
    default_page_size: int = 16  # for workers that report none


def load_share(w: WorkerStatus) -> float:
    """How full ``w`` is, 0 (idle) to 1 (full) or more (queued past its seats): the larger of
    the ledger's admitted share of its KV capacity and its running and waiting requests over
    its seats."""
    seats = w.estimated_load / w.max_num_seqs if w.max_num_seqs > 0 else 0.0
    return max(w.admitted_share, seats)


def place_of(w: WorkerStatus) -> Place:
    return Place(w.address, w.kv_store_id)


@dataclass(frozen=True)
class Routed:
    """How one admitted request was placed: ``reason`` is ``affinity`` (the worker with the
    longest predicted hit), ``load`` (no candidate had one) or ``load-over-affinity`` (another
    candidate had a longer one, but load or room decided); ``predicted_tokens``: the chosen
    worker's predicted hit."""

    reason: str
    predicted_tokens: int


class PrefixAffinity:
    """The index and the policy over it, shared by the router (reads) and the worker pool
    (records where each request went)."""

    def __init__(self, config: AffinityConfig | None = None) -> None:
        self.cfg = config or AffinityConfig()
        self.index = AffinityIndex(self.cfg.index_pages, self.cfg.holders)
        # told of every record this replica makes (the shared feed, ``affinity_feed``)
        self.share: Callable[[Sequence[int], Place], None] | None = None

    def prefix(self, token_ids: Sequence[int]) -> PromptPrefix:
        return PromptPrefix(token_ids, self.cfg.max_pages)

    def page_size(self, w: WorkerStatus) -> int:
        return w.page_size or self.cfg.default_page_size

    def predict(self, prefix: PromptPrefix, workers: Sequence[WorkerStatus]) -> dict[str, Matched]:
        """Per worker address: the prompt tokens its node likely holds (``Matched.pages`` in
        tokens, capped at the prompt less one) and those the worker itself served."""
        out: dict[str, Matched] = {}
        by_page: dict[int, list[WorkerStatus]] = {}
        for w in workers:
            if w.prefix_cache:
                by_page.setdefault(self.page_size(w), []).append(w)
            else:
                out[w.address] = Matched()
        cap = max(0, len(prefix) - 1)
        for page, group in by_page.items():
            # a place's match does not depend on the others asked with it: each is matched
            # once per index version, however many rankings of one admission ask
            seen = prefix.matched.setdefault((self.index.version, page), {})
            places = {w.address: place_of(w) for w in group}
            new = [p for p in places.values() if p not in seen]
            if new:
                found = self.index.match(prefix.keys(page), new)
                seen.update((p, found[p.address]) for p in new)
            for address, place in places.items():
                m = seen[place]
                out[address] = Matched(min(cap, m.pages * page), min(cap, m.own_pages * page))
        return out

    def record(self, keys: Sequence[int], worker: WorkerStatus) -> None:
        place = place_of(worker)
        self.index.record(keys, place)
        if self.share is not None:
            self.share(keys, place)

    def routed(self, prefix: PromptPrefix, chosen: str, workers: Sequence[WorkerStatus]) -> Routed:
        """Why ``chosen`` got the request, among the candidates ``workers`` (``Routed``)."""
        hits = self.predict(prefix, workers)
        best = max((m.pages for m in hits.values()), default=0)
        mine = hits.get(chosen, Matched()).pages
        if best == 0:
            return Routed("load", 0)
        return Routed("affinity" if mine == best else "load-over-affinity", mine)


class PrefixAffinityRouter(RankingRouter):
    """A ``Router`` that ranks by the score in the module docstring."""

    def __init__(self, affinity: PrefixAffinity) -> None:
        self.affinity = affinity
        self.least_loaded = LeastLoadedRouter()

    def rank(
        self,
        workers: Sequence[WorkerStatus],
        exclude: Collection[str],
        job: AdmissionJob | None = None,
    ) -> list[str]:
        order = self.least_loaded.rank(workers, exclude)
        if job is None or job.prefix is None or len(order) < 2:
            return order
        by_address = {w.address: w for w in workers}
        candidates = [by_address[a] for a in order]
        hits = self.affinity.predict(job.prefix, candidates)
        if not any(m.pages for m in hits.values()):
            return order
        weight, tokens = self.affinity.cfg.weight, max(1, len(job.prefix))

        def key(i: int) -> tuple[float, int, int]:
            w = candidates[i]
            m = hits[w.address]
            score = weight * m.pages / tokens - load_share(w)
            return (-score, -m.own_pages, i)

        return [order[i] for i in sorted(range(len(order)), key=key)]
