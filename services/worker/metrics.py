"""Worker metrics (DESIGN §7), updated from the engine thread after every step.

The pool classes and the resolver census are sampled at most every ``sample_every_s`` and
whenever the engine runs out of work: reading the census copies it from the GPU (a sync), and
pools change slowly next to a scrape interval. Counters stay exact, only later."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dhisparse import metrics as m
from services.worker.engine.engine import Engine
from services.worker.engine.heap import GcPauses
from services.worker.engine.kernel_builds import KernelBuilds
from services.worker.prefix_metrics import PrefixMetrics
from services.worker.request.request import RequestOutput

# the engine's phases (``ENGINE_SECONDS``) and prefix reuse's operations
# (``PREFIX_CACHE_SECONDS``, as ``prefix_<op>``) whose wall seconds are exported
PHASES = ("schedule", "prefill", "decode", "prefix_import", "prefix_leave")


def config_labels(engine: Engine) -> dict[str, str]:
    """What the worker chose at start-up, as the labels of ``dhisparse:worker_config_info``:
    device, serving mode, how KV is stored, CUDA graphs (and why they are off), drafter,
    durable sessions."""
    cfg = engine.cfg
    return {
        "device": str(engine.device),
        "mode": engine.kv.payload.mode,
        "kv_cache_dtype": engine.kv.cfg.kv_cache_dtype,
        "cuda_graphs": "on" if engine.passes.graphs is not None else "off",
        "graphs_off_reason": engine.graphs_off_reason or "",
        "graph_capture": cfg.graphs.capture,
        "drafter": cfg.speculation.drafter or "none",
        "durable_sessions": "on" if engine.kv.sessions is not None else "off",
        "prefix_cache": "on" if engine.scheduler.prefix is not None else "off",
    }


class WorkerMetrics:
    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        sample_every_s: float = 0.25,
    ) -> None:
        self.sample_every_s = sample_every_s
        self._sampled = float("-inf")
        self.registry = registry or CollectorRegistry()
        r, lbl = self.registry, ["model"]
        self.model = model_name
        self.running = Gauge(
            m.NUM_REQUESTS_RUNNING, "Requests in the running batch", lbl, registry=r
        )
        self.waiting = Gauge(m.NUM_REQUESTS_WAITING, "Requests waiting for a slot", lbl, registry=r)
        self.prompt_tokens = Counter(
            m.PROMPT_TOKENS, "Prompt tokens of finished prefills", lbl, registry=r
        )
        self.generation_tokens = Counter(m.GENERATION_TOKENS, "Generated tokens", lbl, registry=r)
        self.success = Counter(
            m.REQUEST_SUCCESS, "Finished requests", [*lbl, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            m.TIME_TO_FIRST_TOKEN, "Arrival to first token", lbl, buckets=m.TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            m.TIME_PER_OUTPUT_TOKEN,
            "Mean time per output token after the first, per request",
            lbl,
            buckets=m.TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            m.E2E_REQUEST_LATENCY, "Arrival to finish", lbl, buckets=m.E2E_BUCKETS, registry=r
        )
        self.pool_bytes = Gauge(
            m.KV_POOL_BYTES, "KV pool bytes by class (eq. 3)", [*lbl, "class"], registry=r
        )
        self.prefill_computed = Counter(
            m.PREFILL_TOKENS_COMPUTED, "Prompt tokens whose KV was computed", lbl, registry=r
        )
        self.sessions_resumed = Counter(
            m.SESSIONS_RESUMED,
            "Sessions adopted from a dead worker and continued from host backups",
            lbl,
            registry=r,
        )
        self.sessions_resumed.labels(model_name)
        self.prefill_computed.labels(model_name)
        self._resumed_seen = 0
        self.prefix = PrefixMetrics(r, model_name)
        self.decode_passes = Counter(
            m.DECODE_PASSES,
            "Decode passes by path: replayed CUDA graph, captured, or eager",
            [*lbl, "path"],
            registry=r,
        )
        self.cuda_graphs = Gauge(
            m.CUDA_GRAPHS, "Decode and verify pass CUDA graphs held", lbl, registry=r
        )
        for path in ("graph", "capture", "eager"):
            self.decode_passes.labels(model_name, path)
        self.cuda_graphs.labels(model_name)
        self.engine_seconds = Counter(
            m.ENGINE_SECONDS, "The engine's wall seconds by phase of its steps", [*lbl, "phase"],
            registry=r,
        )  # fmt: skip
        self.prefix_seconds = Counter(
            m.PREFIX_CACHE_SECONDS, "Wall seconds importing cached prefixes and leaving pages",
            [*lbl, "op"], registry=r,
        )  # fmt: skip
        self._seconds_seen = dict.fromkeys(PHASES, 0.0)
        for phase in PHASES:
            counter, label = self._phase(phase)
            counter.labels(model_name, label)
        self.gc_pause = Counter(
            m.GC_PAUSE_SECONDS,
            "Seconds the Python garbage collector stopped the worker, by generation",
            [*lbl, "generation"],
            registry=r,
        )
        self.gc_pause_max = Gauge(
            m.GC_PAUSE_MAX_SECONDS, "The longest single collector pause so far", lbl, registry=r
        )
        self.kernel_builds = Counter(m.KERNEL_BUILDS, "Triton kernels built", lbl, registry=r)
        self.kernel_build_seconds = Counter(
            m.KERNEL_BUILD_SECONDS,
            "Seconds launches waited for Triton kernels to be built",
            lbl,
            registry=r,
        )
        self.kernel_builds.labels(model_name)
        self.kernel_build_seconds.labels(model_name)
        self._builds = KernelBuilds.process()
        self._builds_seen = (0, 0.0)
        self._gc = GcPauses.process()
        self._gc_seen = list(self._gc.seconds)
        for gen in range(3):
            self.gc_pause.labels(model_name, str(gen))
        self._passes_seen = (0, 0, 0)

        self.resolver_rows = Counter(
            m.RESOLVER_ROWS, "Selected rows by how they resolved", [*lbl, "path"], registry=r
        )
        self.host_read_bytes = Counter(
            m.HOST_READ_BYTES, "Bytes read from host backups into the hot cache", lbl, registry=r
        )
        self.reclaim_events = Counter(
            m.RECLAIM_EVENTS, "Requests whose optional history was reclaimed", lbl, registry=r
        )
        self.reclaim_pages = Counter(m.RECLAIM_PAGES, "Optional pages reclaimed", lbl, registry=r)
        self.reclaim_latency = Histogram(
            m.RECLAIM_LATENCY,
            "Reclaim start to the request's last page freed",
            lbl,
            buckets=m.RECLAIM_LATENCY_BUCKETS,
            registry=r,
        )
        self.repopulated_pages = Counter(
            m.REPOPULATED_PAGES, "Optional pages refilled from host backups", lbl, registry=r
        )
        for metric in (
            self.reclaim_events,
            self.reclaim_pages,
            self.repopulated_pages,
            self.reclaim_latency,
        ):
            metric.labels(model_name)
        self._residency_seen = (0, 0, 0)
        self.spec_drafts = Counter(m.SPEC_DRAFTS, "Verification rounds", lbl, registry=r)
        self.spec_draft_tokens = Counter(
            m.SPEC_DRAFT_TOKENS, "Draft tokens verified", lbl, registry=r
        )
        self.spec_accepted = Counter(
            m.SPEC_ACCEPTED_TOKENS, "Draft tokens accepted", lbl, registry=r
        )
        self.spec_accepted_pos = Counter(
            m.SPEC_ACCEPTED_PER_POS, "Draft tokens accepted by position", [*lbl, "position"],
            registry=r,
        )  # fmt: skip
        self.spec_width = Gauge(
            m.SPEC_BLOCK_WIDTH, "Verification block width in use (0: off)", lbl, registry=r
        )
        rank = [*lbl, "rank"]
        self.rank_running = Gauge(
            m.RANK_REQUESTS_RUNNING, "Requests running on each data-parallel rank", rank,
            registry=r,
        )  # fmt: skip
        self.rank_waiting = Gauge(
            m.RANK_REQUESTS_WAITING, "Requests waiting on each data-parallel rank", rank,
            registry=r,
        )  # fmt: skip
        self.rank_kv_free = Gauge(
            m.RANK_KV_FREE_BYTES, "Free KV pool bytes of each data-parallel rank", rank,
            registry=r,
        )  # fmt: skip
        self._spec_seen = (0, 0, 0)
        self._spec_pos_seen: list[int] = []
        for path in ("direct", "hot", "host"):
            self.resolver_rows.labels(model_name, path)
        self.host_read_bytes.labels(model_name)
        self._prefill_seen = 0
        self._census_seen = (0, 0, 0, 0)
        self._counting = True  # False while ``start_after`` takes stock

    def start_after(self, engine: Engine) -> None:
        """Takes what ``engine``'s requests did before now (a start-up warm-up's: never a
        client's) as done before serving: the counters of the requests' work (tokens, passes,
        seconds, prefix reuse, residency, speculation, the census, latencies) count from here.
        Sessions resumed, kernel builds and collector pauses count from the process's start."""
        self._counting = False
        try:
            self.on_step(engine, [])  # an idle engine: its pools and census are sampled too
        finally:
            self._counting = True

    def _add(self, child: Any, amount: float) -> None:
        """Adds ``amount`` to a counter's child unless ``start_after`` is taking stock."""
        if self._counting:
            child.inc(amount)

    def _observe(self, child: Any, value: float) -> None:
        if self._counting:
            child.observe(value)

    def describe(self, engine: Engine) -> None:
        """Exports the worker's configuration (``config_labels``) as an info gauge."""
        labels = config_labels(engine)
        Gauge(
            m.WORKER_CONFIG_INFO,
            "The worker's configuration (always 1): device, mode, CUDA graphs, drafter",
            ["model", *labels],
            registry=self.registry,
        ).labels(self.model, *labels.values()).set(1)

    def on_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        md = self.model
        computed = engine.prefill_tokens_computed
        self._add(self.prefill_computed.labels(md), computed - self._prefill_seen)
        self._prefill_seen = computed
        resumed = engine.sessions_resumed
        self.sessions_resumed.labels(md).inc(resumed - self._resumed_seen)
        self._resumed_seen = resumed
        prefix = engine.scheduler.prefix
        others = engine.group.loads.others_prefix()
        self.prefix.update(None if prefix is None else prefix.stats.plus(others), self._counting)
        self.running.labels(md).set(engine.num_running)
        self._count_passes(engine)
        self._count_seconds(engine)
        self._count_gc()
        self._count_builds()
        self.waiting.labels(md).set(engine.num_waiting)
        for rank, load in enumerate(engine.group.loads.reported()):
            self.rank_running.labels(md, str(rank)).set(load.running)
            self.rank_waiting.labels(md, str(rank)).set(load.waiting)
            self.rank_kv_free.labels(md, str(rank)).set(load.kv_free_bytes)
        t = time.monotonic()
        if t - self._sampled >= self.sample_every_s or not engine.has_work():
            self._sampled = t
            self._sample(engine)
        st = engine.kv.payload.residency.stats
        if st is not None:
            now3 = (st.reclaim_events, st.reclaim_pages, st.repopulated_pages)
            for metric, new, old in zip(
                (self.reclaim_events, self.reclaim_pages, self.repopulated_pages),
                now3,
                self._residency_seen,
                strict=True,
            ):
                self._add(metric.labels(md), new - old)
            self._residency_seen = now3
            for seconds in st.reclaim_latency:
                self._observe(self.reclaim_latency.labels(md), seconds)
            st.reclaim_latency.clear()
        spec = engine.speculator
        if spec is not None:
            c = spec.counters
            now_spec = (c.drafts, c.draft_tokens, c.accepted)
            for metric, new, old in zip(
                (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted),
                now_spec,
                self._spec_seen,
                strict=True,
            ):
                self._add(metric.labels(md), new - old)
            self._spec_seen = now_spec
            seen = self._spec_pos_seen or [0] * len(c.per_position)
            for i, (new, old) in enumerate(zip(c.per_position, seen, strict=True)):
                self._add(self.spec_accepted_pos.labels(md, str(i)), new - old)
            self._spec_pos_seen = list(c.per_position)
            self.spec_width.labels(md).set(c.width)
        for out in outputs:
            n = len(out.new_token_ids)
            if n:
                self.generation_tokens.labels(md).inc(n)
            if out.completion_tokens == n and n:  # the request's first token
                self.prompt_tokens.labels(md).inc(out.prompt_tokens)
            if out.finished:
                self.success.labels(md, out.finish_reason.value).inc()  # type: ignore[union-attr]
        for arrival, first, done, ntok in engine.stats.drain_finished():
            if first is not None:
                self._observe(self.ttft.labels(md), first - arrival)
                if ntok > 1:
                    self._observe(self.tpot.labels(md), (done - first) / (ntok - 1))
            self._observe(self.e2e.labels(md), done - arrival)

    def _count_passes(self, engine: Engine) -> None:
        """Decode passes by path since the last step: every decode step runs one pass (a
        speculative round's verify pass included), replayed, captured or eager."""
        graphs = engine.passes.graphs
        replays, captures = (graphs.replays, graphs.captures) if graphs is not None else (0, 0)
        now = (replays, captures, engine.stats.decode_steps - replays - captures)
        for path, new, old in zip(
            ("graph", "capture", "eager"), now, self._passes_seen, strict=True
        ):
            self._add(self.decode_passes.labels(self.model, path), new - old)
        self._passes_seen = now
        self.cuda_graphs.labels(self.model).set(len(graphs) if graphs is not None else 0)

    def _phase(self, phase: str) -> tuple[Counter, str]:
        """The counter and label of one of ``PHASES``."""
        if phase.startswith("prefix_"):
            return self.prefix_seconds, phase.removeprefix("prefix_")
        return self.engine_seconds, phase

    def _count_seconds(self, engine: Engine) -> None:
        """The engine's and prefix reuse's wall seconds since the last step."""
        sched, st = engine.scheduler, engine.stats
        now = {
            "schedule": sched.schedule_s, "prefill": st.prefill_s, "decode": st.decode_s,
            "prefix_import": sched.import_s, "prefix_leave": sched.leave_s,
        }  # fmt: skip
        for phase, value in now.items():
            counter, label = self._phase(phase)
            self._add(
                counter.labels(self.model, label), max(0.0, value - self._seconds_seen[phase])
            )
        self._seconds_seen = now

    def _count_builds(self) -> None:
        count, seconds = self._builds.totals()
        seen_count, seen_seconds = self._builds_seen
        if count > seen_count:
            self.kernel_builds.labels(self.model).inc(count - seen_count)
            self.kernel_build_seconds.labels(self.model).inc(max(seconds - seen_seconds, 0.0))
            self._builds_seen = (count, seconds)

    def _count_gc(self) -> None:
        now = list(self._gc.seconds)
        for gen, (new, old) in enumerate(zip(now, self._gc_seen, strict=True)):
            if new > old:
                self.gc_pause.labels(self.model, str(gen)).inc(new - old)
        self._gc_seen = now
        self.gc_pause_max.labels(self.model).set(self._gc.longest)

    def _sample(self, engine: Engine) -> None:
        """Pool classes (gauges) and the census since the last sample (counters)."""
        md = self.model
        mem = engine.kv.memory()
        for cls in ("required", "optional", "reserve", "free"):
            self.pool_bytes.labels(md, cls).set(getattr(mem, cls))
        census = engine.kv.payload.census  # copies the counts from the device
        if census is None:
            return
        now = (census.direct, census.hot, census.host, census.copied)
        for path, new, old in zip(("direct", "hot", "host"), now, self._census_seen, strict=False):
            self._add(self.resolver_rows.labels(md, path), new - old)
        self._add(
            self.host_read_bytes.labels(md), (now[3] - self._census_seen[3]) * engine.kv.row_bytes
        )
        self._census_seen = now
