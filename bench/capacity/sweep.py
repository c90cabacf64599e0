"""The capacity benchmark's engines and sweeps: one engine per mode, every mode stepped in
lockstep at each concurrency, then each mode's capacity probed on its own."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import torch

from bench.core.clock import OwnClock
from bench.core.lockstep import lockstep
from bench.core.model import BENCH_GLM
from bench.core.steps import StepRates
from dhisparse.family.config import ModelConfig
from dhisparse.tokenizer import Tokenizer
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.heap import GcPauses, freeze_heap
from services.worker.graphs.cuda_graph import GraphConfig
from services.worker.kv.config import ResidencyConfig
from services.worker.kv.workspace import workspace_bytes
from services.worker.model.preset_decoder import DSAModel
from services.worker.request.request import SamplingParams
from services.worker.serving.hierarchy_build import hierarchy_fixed_bytes

MODES = ("resident", "hisparse", "adaptive")


@dataclass(frozen=True)
class Setup:
    """What every mode's engine shares: the model, the session KV budget, the prompts."""

    cfg: ModelConfig
    model: DSAModel
    tokenizer: Tokenizer
    dtype: str  # bfloat16 on CUDA, float32 on a CPU
    per_token: int  # resident bytes per token
    budget: int  # session KV budget (bytes): holds --resident-sessions resident sessions
    prompts: list[list[int]]  # one per request of the largest concurrency


def build_engine(mode: str, args, setup: Setup) -> tuple[Engine, int, int]:
    """(engine, pool bytes, fixed bytes): the session budget plus the mode's fixed allocations
    (the index-score workspace in every mode; scratch, metadata and staging in the hierarchy)."""
    ctx = args.context
    common = dict(
        model=BENCH_GLM, device=args.device, dtype=setup.dtype, mode=mode, page_size=args.page,
        max_num_seqs=max(*args.concurrency, args.probe_sessions), max_model_len=ctx + args.decode_tokens + 16,
        max_prefill_tokens=ctx, hot_cache_rows=args.hot_cache_rows, resolver="auto",
        attention_backend="auto", host_arena_mib=args.host_gib * 1024,
        graphs=GraphConfig(not args.eager, args.graph_capture),
        residency=ResidencyConfig(
            overlap_refills=args.overlap_refills, populate_payback=args.populate_payback
        ),
    )  # fmt: skip
    probe = EngineConfig(kv_pool_mib=setup.budget / 2**20, **common)
    kv_cfg = probe.kv_config(setup.model.embed.weight.dtype)
    fixed = workspace_bytes(setup.model.cfg, kv_cfg)  # every mode's index-score workspace
    if mode != "resident":
        fixed += hierarchy_fixed_bytes(setup.model.cfg, kv_cfg)
    pool = setup.budget + fixed
    engine = Engine(
        EngineConfig(kv_pool_mib=pool / 2**20, **common), model=setup.model,
        tokenizer=setup.tokenizer,
    )  # fmt: skip
    return engine, pool, fixed


class Sweep:
    """One mode at one concurrency: C requests arrive at once and each decodes
    ``--decode-tokens`` tokens. Stepped by ``lockstep`` beside the other modes; its clock
    counts only its own steps (wall time, allocation waits), so the other modes' steps in
    between do not count against it."""

    def __init__(
        self, engine: Engine, mode: str, c: int, args, prompts: list[list[int]], gc: GcPauses
    ) -> None:
        self.engine, self.mode, self.c, self.args = engine, mode, c, args
        params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
        self.census0 = engine.kv.payload.census
        self._host = self.census0.host if self.census0 is not None else 0
        self.reqs = [engine.add_request(f"{mode}-{c}-{i}", prompts[i], params) for i in range(c)]
        self.stats0 = (engine.stats.decode_s, engine.stats.decode_tokens)
        self.steps = StepRates(engine)
        self.peak = 0
        self.clock = OwnClock()  # counts only this engine's steps
        self.waits: dict[int, float] = {}  # request -> its clock when admitted
        # decode seconds and steps by what else the step did (``KINDS``), or nothing else
        self.split = {k: [0.0, 0] for k in (*self.KINDS, "plain")}
        # decode seconds, tokens and steps of the steps that ran all C sessions and no prefill
        self.steady = [0.0, 0, 0]
        # with --trace: per step [requests running, decode ms, kind, host rows read, GC ms]
        self.trace: list[list] = []
        self.gc = gc  # the process's collector pauses; those inside this mode's steps count
        self.gc_s = 0.0

    @property
    def active(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        start = self.clock.now()
        before = self._events()
        decode_s = self.engine.stats.decode_s
        emitted, prefilled = (
            self.engine.stats.decode_tokens,
            self.engine.stats.prefill_tokens_computed,
        )
        full = self.engine.num_running == self.c
        gc_s = self.gc.total_s
        self.clock.timed(self._step)
        gc_s = self.gc.total_s - gc_s
        self.gc_s += gc_s
        after = self._events()
        kind = next(
            (k for k, a, b in zip(self.KINDS, after, before, strict=True) if a > b), "plain"
        )
        self.split[kind][0] += self.engine.stats.decode_s - decode_s
        self.split[kind][1] += 1
        st = self.engine.stats
        if full and st.prefill_tokens_computed == prefilled:
            # every session running, none prefilling: the steady state at C
            self.steady[0] += st.decode_s - decode_s
            self.steady[1] += st.decode_tokens - emitted
            self.steady[2] += 1
        if self.args.trace:
            census = self.engine.kv.payload.census
            host = census.host if census is not None else 0
            self.trace.append([
                self.engine.num_running, round(1e3 * (self.engine.stats.decode_s - decode_s), 3),
                kind, host - self._host, round(1e3 * gc_s, 3),
            ])  # fmt: skip
            self._host = host
        for i, r in enumerate(self.reqs):
            if i not in self.waits and r.admitted_time is not None:
                self.waits[i] = self.clock.stamp(r.admitted_time, start)
        self.steps.record()
        self.peak = max(self.peak, self.engine.num_running)

    # captured a decode graph; ran the pass eagerly (its graph key not captured yet);
    # queued a refill of optional history (its copy runs before the step's decode pass)
    KINDS = ("capture", "eager", "refill")

    def _events(self) -> tuple[int, int, int]:
        """Counts of ``KINDS`` so far."""
        res = self.engine.kv.payload.residency.stats
        graphs = self.engine.passes.graphs
        return (
            graphs.captures if graphs is not None else 0,
            graphs.eager if graphs is not None else 0,
            res.refill_pages if res is not None else 0,
        )

    def _step(self) -> None:
        self.engine.step()
        if self.args.device == "cuda":
            torch.cuda.synchronize()

    def row(self) -> dict:
        st, args, c = self.engine.stats, self.args, self.c
        decode_time = st.decode_s - self.stats0[0]
        decode_tokens = st.decode_tokens - self.stats0[1]
        waits = list(self.waits.values())
        row = {
            "mode": self.mode,
            "concurrency": c,
            "sessions_admitted": self.peak,
            "decode_tokens_per_s": decode_tokens / decode_time if decode_time else 0.0,
            "decode_tokens_per_s_median": self.steps.median,
            # over the steps that decoded all C sessions and prefilled none
            "steady_tokens_per_s": self.steady[1] / self.steady[0] if self.steady[0] else 0.0,
            "steady_steps": self.steady[2],
            "output_tokens_per_s": c * args.decode_tokens / self.clock.now(),
            "wall_s": self.clock.now(),
            "alloc_wait_mean_s": statistics.mean(waits),
            "alloc_wait_max_s": max(waits),
            # where decode time went: steps that also captured a graph (the capture runs the
            # step eagerly, then records it), ran eagerly, queued a refill, and the rest
            "decode_s_by_step": {k: round(v[0], 4) for k, v in self.split.items()},
            "steps_by_kind": {k: v[1] for k, v in self.split.items()},
            "gc_pause_s": round(self.gc_s, 4),  # the collector's pauses inside its steps
        }
        census1 = self.engine.kv.payload.census
        if census1 is not None:
            d = {
                k: getattr(census1, k) - getattr(self.census0, k)
                for k in ("direct", "hot", "host", "copied")
            }
            total = max(1, d["direct"] + d["hot"] + d["host"])
            row.update(
                census_direct=d["direct"] / total, census_hot=d["hot"] / total,
                census_host=d["host"] / total,
                host_bytes_per_token=d["copied"] * self.engine.kv.row_bytes / max(1, c * args.decode_tokens),
            )  # fmt: skip
        res = self.engine.kv.payload.residency.stats
        if res is not None:
            row.update(reclaims=res.reclaim_events, repopulated=res.repopulated_pages)
        if self.engine.passes.graphs is not None:  # captured so far (a capture step runs eagerly)
            row.update(graphs_captured=self.engine.passes.graphs.captures)
        if args.trace:
            row["trace"] = self.trace
        return row


def run_modes(modes: list[str], args, setup: Setup) -> list[dict]:
    """Every mode's engine at once; at each C the modes run in lockstep
    (``bench/core/lockstep.py``), then each mode's capacity is probed on its own."""
    prompts = setup.prompts
    engines = {}
    results = {}
    for mode in modes:
        engine, pool, fixed = build_engine(mode, args, setup)
        params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
        # Warm-up at the context measured: every kernel variant compiled (and decode graphs
        # captured for one and two requests at its index-key width) before anything is timed.
        engine.generate(prompts[:2], params)
        engines[mode] = engine
        results[mode] = {"mode": mode, "pool_bytes": pool, "fixed_bytes": fixed, "rows": []}
    if args.gc_freeze:  # as a worker does once its engine is built
        freeze_heap()
    pauses = GcPauses()
    for c in args.concurrency:
        sweeps = [Sweep(engines[m], m, c, args, prompts, pauses) for m in modes]
        lockstep(sweeps)
        for sw in sweeps:
            row = sw.row()
            results[sw.mode]["rows"].append(row)
            print(json.dumps(row), flush=True)
    pauses.close()
    for mode, engine in engines.items():
        results[mode]["capacity"] = probe_capacity(engine, mode, args, prompts)
        print(json.dumps({"mode": mode, "capacity": results[mode]["capacity"]}), flush=True)
        engine.close()
    engines.clear()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return [results[m] for m in modes]


def probe_capacity(engine: Engine, mode: str, args, prompts: list[list[int]]) -> dict:
    """Sessions of the context held at once: ``--probe-sessions`` requests that never finish
    arrive together; steps run until the queue stops draining (no admission for
    ``--probe-stable`` steps while nothing is settling: reclaims and copies done), then all are
    aborted. Unlike the concurrency sweep this is not bounded by how fast requests finish."""
    params = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)
    ids = [f"probe-{mode}-{i}" for i in range(args.probe_sessions)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, prompts[i % len(prompts)], params)
    t0 = time.perf_counter()
    peak, stable, steps = 0, 0, 0
    while engine.num_waiting and stable < args.probe_stable:
        engine.step()
        steps += 1
        running = engine.num_running
        stable = 0 if running > peak or engine.kv.payload.residency.settling() else stable + 1
        peak = max(peak, running)
    for rid in ids:
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    return {
        "sessions": peak,
        "offered": args.probe_sessions,
        "all_admitted": peak == args.probe_sessions,
        "steps": steps,
        "seconds": time.perf_counter() - t0,
    }
